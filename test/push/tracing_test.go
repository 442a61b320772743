package push

import (
	"context"
	"fmt"
	"testing"
	"time"

	"go.opentelemetry.io/otel"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/tracing"
	"github.com/idemcp/idemcp/test/otlp"
	"github.com/idemcp/idemcp/test/poll"
)

// TestManagerTracesReconcileAndPush: with the manager's tracing on
// (tracing.NewProvider, configured by OTEL_* as `idemcp manager --tracing`
// is), a real OTLP receiver gets a span per reconcile of the policy and a
// "policy push" span per snapshot sent to each sidecar, ended when that
// sidecar acknowledged it, naming the pod and the hash: "why is Synced
// 1/2" can be followed in the traces.
func TestManagerTracesReconcileAndPush(t *testing.T) {
	const ns, name = "push-traced", "traced"
	endpoint, spans := otlp.Receiver(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
	tp, shutdown, err := tracing.NewProvider(context.Background(), "idemcp-manager")
	if err != nil {
		t.Fatal(err)
	}
	before := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	t.Cleanup(func() {
		otel.SetTracerProvider(before)
		_ = shutdown(context.Background())
	})

	namespace(t, ns)
	mgr := startManager(t, "traced", freeAddr(t))
	spec := memorySpec(v1alpha1.ModeAuto)
	createPolicy(t, ns, name, spec)
	start := compiled(t, ns, name, spec)
	var sidecars []*sidecarClient
	for i := range 2 {
		pod, token := createPod(t, ns, fmt.Sprintf("traced-%d", i), name)
		sidecars = append(sidecars, startSidecarClient(t, "https://"+mgr.addr, ns, name, pod.Name, token, start))
	}
	waitStatus(t, ns, name, 20*time.Second, synced(2, start.Hash))
	changed := time.Now()
	hash := updatePolicy(t, ns, name, func(s *v1alpha1.IdempotencyPolicySpec) {
		s.Tools = append(s.Tools, v1alpha1.ToolRule{Name: "refund", Mode: v1alpha1.ModePassthrough})
	})
	waitApplied(t, sidecars, hash, changed, 5*time.Second)

	poll.Within(t, 15*time.Second, "the manager's spans at the receiver", func() error {
		reconciles := 0
		acked := map[string]bool{} // pod/hash
		for _, s := range spans() {
			if s.Attributes[string(tracing.PolicyName)] != name || s.Attributes["k8s.namespace.name"] != ns {
				continue
			}
			if s.Service != "idemcp-manager" {
				return fmt.Errorf("span %q of service %q, want idemcp-manager", s.Name, s.Service)
			}
			switch s.Name {
			case "reconcile IdempotencyPolicy":
				reconciles++
			case "policy push":
				if s.Kind != "Producer" {
					return fmt.Errorf("policy push span of kind %q, want Producer", s.Kind)
				}
				if s.Attributes["idemcp.push.result"] == "acknowledged" {
					acked[fmt.Sprint(s.Attributes["k8s.pod.name"], "/", s.Attributes[string(tracing.PolicyHash)])] = true
				}
			}
		}
		if reconciles == 0 {
			return fmt.Errorf("no reconcile span for %s/%s", ns, name)
		}
		for _, sc := range sidecars {
			for _, h := range []string{start.Hash, hash} {
				if !acked[sc.pod+"/"+h] {
					return fmt.Errorf("no acknowledged policy push span for pod %s and hash %s (acknowledged: %v)", sc.pod, h, acked)
				}
			}
		}
		return nil
	})
}
