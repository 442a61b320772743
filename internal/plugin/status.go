package plugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// PolicyStatus is what status prints for one policy.
type PolicyStatus struct {
	Namespace  string `json:"namespace"`
	Policy     string `json:"policy"`
	PolicyHash string `json:"policyHash"`
	Ready      string `json:"ready"`
	// Sidecars are the policy stream's counts: it publishes how many
	// sidecars hold a stream, not which.
	Sidecars v1alpha1.SidecarsStatus `json:"sidecars"`
	Pods     []SidecarStatus         `json:"pods"`
}

// SidecarStatus is one injected pod.
type SidecarStatus struct {
	Pod   string `json:"pod"`
	Node  string `json:"node,omitempty"`
	Ready bool   `json:"ready"`
	// Image and Version are the sidecar's image and its tag.
	Image   string `json:"image"`
	Version string `json:"version"`
	// InjectedHash is the policy the webhook gave it at creation.
	InjectedHash string `json:"injectedHash"`
	// AppliedHash, Store and Stream are what its /readyz says (unknown
	// when it could not be read: ProbeError says why). Stream is
	// connected, disconnected or off (no policy stream configured); a
	// sidecar older than that field leaves it unknown.
	AppliedHash string `json:"appliedHash,omitempty"`
	Current     bool   `json:"current"`
	Store       string `json:"store"`
	Stream      string `json:"stream"`
	ProbeError  string `json:"probeError,omitempty"`
}

func newStatusCommand(g *globalFlags, newEnv envFunc) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "status POLICY [-n NAMESPACE] [-o json|yaml|wide]",
		Short: "Show each sidecar of a policy: ready, connected, the policy hash it applied, its store, its version",
		Long: `status shows an IdempotencyPolicy's sidecars, one line per injected pod:
whether the sidecar is ready, whether it holds the manager's policy stream,
the policy hash it enforces and whether it is the current one, whether its
store answers, and its version (image tag).

The stream, the policy hash and the store come from the sidecar's /readyz
on its admin port, read through the API server (pods/proxy, which the edit
and admin roles allow); without that permission they show as unknown, and
the hash the webhook gave the pod at creation is shown instead. The header
has the manager's own counts from the policy status.`,
		Example: `  kubectl idemcp status payments -n shop
  kubectl idemcp status payments -n shop -o json`,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) != 1 {
				return &ExitError{Code: 2, Err: errors.New("status takes one POLICY (kubectl get idpol lists them)")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(g.output, "", "json", "yaml", "wide"); err != nil {
				return err
			}
			e, err := newEnv(cmd)
			if err != nil {
				return err
			}
			st, err := Status(cmd.Context(), e, args[0])
			if err != nil {
				return err
			}
			if g.output == "json" || g.output == "yaml" {
				return printStructured(e.Out, g.output, st)
			}
			printStatus(e.Out, st, g.output == "wide")
			return nil
		},
	}
	addOutput(cmd.Flags(), g, "json|yaml|wide")
	return cmd
}

// Status reads policy name in the Env's namespace and its sidecars.
func Status(ctx context.Context, e *Env, name string) (*PolicyStatus, error) {
	var p v1alpha1.IdempotencyPolicy
	if err := e.Client.Get(ctx, client.ObjectKey{Namespace: e.Namespace, Name: name}, &p); err != nil {
		return nil, fmt.Errorf("reading IdempotencyPolicy %s/%s: %w", e.Namespace, name, err)
	}
	st := &PolicyStatus{Namespace: p.Namespace, Policy: p.Name, PolicyHash: p.Status.PolicyHash, Ready: "Unknown", Pods: []SidecarStatus{}}
	if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady); c != nil {
		st.Ready = string(c.Status) + " (" + c.Reason + ")"
	}
	if p.Status.Sidecars != nil {
		st.Sidecars = *p.Status.Sidecars
	}
	var pods corev1.PodList
	if err := e.Client.List(ctx, &pods, client.InNamespace(p.Namespace), client.MatchingLabels{v1alpha1.LabelPolicy: p.Name}); err != nil {
		return nil, fmt.Errorf("listing the pods of %s/%s: %w", p.Namespace, p.Name, err)
	}
	for i := range pods.Items {
		pod := &pods.Items[i]
		sa, injected := statusAnnotation(pod)
		if !injected || pod.DeletionTimestamp != nil || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
			continue
		}
		s := SidecarStatus{Pod: pod.Name, Node: pod.Spec.NodeName, InjectedHash: sa.PolicyHash, Store: "unknown", Stream: "unknown"}
		if c := sidecarContainer(pod); c != nil {
			s.Image, s.Version = c.Image, imageTag(c.Image)
		}
		if cs := sidecarStatus(pod); cs != nil {
			s.Ready = cs.Ready
		}
		if sa.AdminPort != 0 && e.Probe != nil {
			body, err := e.Probe(ctx, pod.Namespace, pod.Name, sa.AdminPort)
			if err != nil {
				s.ProbeError = err.Error()
			} else {
				s.AppliedHash, s.Store, s.Stream = parseReadyz(body)
			}
		}
		hash := s.AppliedHash
		if hash == "" {
			hash = s.InjectedHash
		}
		s.Current = hash != "" && hash == p.Status.PolicyHash
		st.Pods = append(st.Pods, s)
	}
	sort.Slice(st.Pods, func(i, j int) bool { return st.Pods[i].Pod < st.Pods[j].Pod })
	return st, nil
}

// parseReadyz reads the sidecar's "ok policy=HASH store=STATE
// stream=STATE".
func parseReadyz(body string) (hash, store, stream string) {
	store, stream = "unknown", "unknown"
	for _, f := range strings.Fields(body) {
		if v, ok := strings.CutPrefix(f, "policy="); ok {
			hash = v
		}
		if v, ok := strings.CutPrefix(f, "store="); ok {
			store = v
		}
		if v, ok := strings.CutPrefix(f, "stream="); ok {
			stream = v
		}
	}
	return hash, store, stream
}

func printStatus(w io.Writer, st *PolicyStatus, wide bool) {
	_, _ = fmt.Fprintf(w, "IdempotencyPolicy %s/%s: Ready %s, policy hash %s\n", st.Namespace, st.Policy, st.Ready, orDash(st.PolicyHash))
	_, _ = fmt.Fprintf(w, "Sidecars (the manager's count): %d injected, %d connected to the policy stream, %d synced\n\n", st.Sidecars.Injected, st.Sidecars.Connected, st.Sidecars.Synced)
	if len(st.Pods) == 0 {
		_, _ = fmt.Fprintln(w, "No injected pod uses this policy.")
		return
	}
	tw := newTable(w, wide, "POD\tREADY\tSTREAM\tPOLICY-HASH\tCURRENT\tSTORE\tVERSION", "\tINJECTED-HASH\tNODE\tIMAGE")
	probeFailed := false
	for _, s := range st.Pods {
		hash := s.AppliedHash
		if hash == "" {
			hash = s.InjectedHash + " (at start)"
			probeFailed = true
		}
		line := fmt.Sprintf("%s\t%t\t%s\t%s\t%t\t%s\t%s", s.Pod, s.Ready, s.Stream, hash, s.Current, s.Store, orDash(s.Version))
		if wide {
			line += fmt.Sprintf("\t%s\t%s\t%s", orDash(s.InjectedHash), orDash(s.Node), orDash(s.Image))
		}
		_, _ = fmt.Fprintln(tw, line)
	}
	_ = tw.Flush()
	if probeFailed {
		_, _ = fmt.Fprintln(w, "\nA sidecar's /readyz could not be read (-o json shows why): its hash is the one it started with, its stream and store unknown.")
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// newTable starts a kubectl-style table on w with its header: the columns,
// and with -o wide the wide ones after them. Flush it when done.
func newTable(w io.Writer, wide bool, columns, wideColumns string) *tabwriter.Writer {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	if wide {
		columns += wideColumns
	}
	_, _ = fmt.Fprintln(tw, columns)
	return tw
}
