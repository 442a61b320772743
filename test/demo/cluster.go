package main

// The demo against a real cluster (make demo KUBECONFIG=...): the same
// story as on the embedded control plane, but a real kubelet runs the pod.
// It installs idemcp from dist/install.yaml with the given image, deploys
// the demo MCP server (its own image), port-forwards to the pod, and drives
// the same agent retries, burst and live policy change. It removes what it
// created, and uninstalls idemcp if it installed it.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/transport/spdy"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/cmd/manager"
)

// defaultImage is the manager's image in the committed dist/install.yaml.
const defaultImage = "ghcr.io/idemcp/idemcp:"

func (d *demo) clusterSteps() []step {
	return []step{
		{"Connect to the cluster of KUBECONFIG", d.connect},
		{"Install idemcp from dist/install.yaml with image " + d.image, d.install},
		{"Apply an IdempotencyPolicy, an opted-in Deployment of an MCP server and its Service", d.applyCluster},
		{"Wait for the pod: the webhook injected the sidecar, the kubelet started it first", d.waitPod},
		{"Port-forward to the pod: the server's port (direct) and the sidecar's (through idemcp)", d.forward},
		{"An agent retries charge_card 5 times: directly, then through idemcp", d.retries},
		{"A burst: 20 concurrent identical calls through idemcp", d.burst},
		{"Change the policy live: refund becomes Deduplicate", d.liveChange},
		{"What kubectl shows", d.kubectl},
	}
}

func (d *demo) connect(ctx context.Context) error {
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
		&clientcmd.ClientConfigLoadingRules{ExplicitPath: d.kconfig}, nil).ClientConfig()
	if err != nil {
		return fmt.Errorf("KUBECONFIG %s: %w", d.kconfig, err)
	}
	d.cfg = cfg
	if d.k8s, err = client.New(cfg, client.Options{Scheme: manager.NewScheme()}); err != nil {
		return err
	}
	if d.kube, err = kubernetes.NewForConfig(cfg); err != nil {
		return err
	}
	v, err := d.kube.Discovery().ServerVersion()
	if err != nil {
		return fmt.Errorf("reaching the API server at %s: %w", cfg.Host, err)
	}
	nodes, err := d.kube.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return fmt.Errorf("listing nodes: %w", err)
	}
	fmt.Printf("      %s, Kubernetes %s, %d node(s)\n", cfg.Host, v.GitVersion, len(nodes.Items))
	return nil
}

// install applies dist/install.yaml with the manager's image replaced, and
// waits until the manager serves the webhook.
func (d *demo) install(ctx context.Context) error {
	b, err := os.ReadFile(filepath.Join(repoRoot(), "dist", "install.yaml"))
	if err != nil {
		return err
	}
	var crd unstructured.Unstructured
	crd.SetAPIVersion("apiextensions.k8s.io/v1")
	crd.SetKind("CustomResourceDefinition")
	err = d.k8s.Get(ctx, client.ObjectKey{Name: "idempotencypolicies.idemcp.io"}, &crd)
	if err == nil {
		// Someone's installation: use it as it is, never change it.
		fmt.Println("      idemcp is installed already (its CRD exists): using it as it is, with its own image; it stays installed")
		return d.waitManager(ctx)
	}
	if !apierrors.IsNotFound(err) {
		return fmt.Errorf("looking for idemcp's CRD: %w", err)
	}
	d.installed = true
	objs, err := decodeAll(b)
	if err != nil {
		return fmt.Errorf("dist/install.yaml: %w", err)
	}
	d.manifest = objs
	images := 0
	for _, o := range objs {
		if o.GetKind() == "Deployment" {
			cs, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
			for i := range cs {
				c, _ := cs[i].(map[string]any)
				if img, _ := c["image"].(string); strings.HasPrefix(img, defaultImage) {
					c["image"] = d.image
					images++
				}
			}
			_ = unstructured.SetNestedSlice(o.Object, cs, "spec", "template", "spec", "containers")
		}
		// A namespace left terminating by a previous run refuses new
		// objects for a while: wait it out.
		if err := waitFor(ctx, nil, 2*time.Minute, func() error {
			return d.k8s.Apply(ctx, client.ApplyConfigurationFromUnstructured(o), client.FieldOwner("idemcp-demo"))
		}); err != nil {
			return fmt.Errorf("applying %s %s: %w", o.GetKind(), o.GetName(), err)
		}
	}
	if images == 0 {
		return fmt.Errorf("dist/install.yaml has no container with image %s*", defaultImage)
	}
	return d.waitManager(ctx)
}

// waitManager waits until the manager is available and its webhook has a
// CA bundle.
func (d *demo) waitManager(ctx context.Context) error {
	if err := waitFor(ctx, nil, 3*time.Minute, func() error {
		var dep appsv1.Deployment
		if err := d.k8s.Get(ctx, client.ObjectKey{Namespace: "idemcp-system", Name: "idemcp-manager"}, &dep); err != nil {
			return err
		}
		if dep.Status.ObservedGeneration < dep.Generation || dep.Status.UpdatedReplicas < ptr.Deref(dep.Spec.Replicas, 1) || dep.Status.AvailableReplicas < 1 {
			return fmt.Errorf("deployment idemcp-system/idemcp-manager: %d of %d replicas updated, %d available (kubectl -n idemcp-system describe pod)",
				dep.Status.UpdatedReplicas, ptr.Deref(dep.Spec.Replicas, 1), dep.Status.AvailableReplicas)
		}
		return nil
	}); err != nil {
		return err
	}
	if err := waitFor(ctx, nil, time.Minute, func() error {
		var list admissionregistrationv1.MutatingWebhookConfigurationList
		if err := d.k8s.List(ctx, &list, client.MatchingLabels{"app.kubernetes.io/part-of": "idemcp"}); err != nil {
			return err
		}
		for _, w := range list.Items {
			for _, h := range w.Webhooks {
				if len(h.ClientConfig.CABundle) == 0 {
					return fmt.Errorf("webhook %s has no caBundle yet", h.Name)
				}
			}
		}
		if len(list.Items) == 0 {
			return errors.New("no MutatingWebhookConfiguration labelled app.kubernetes.io/part-of=idemcp")
		}
		return nil
	}); err != nil {
		return err
	}
	fmt.Println("      manager available, webhook CA bundle published")
	return nil
}

func decodeAll(b []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	var objs []*unstructured.Unstructured
	for {
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			if errors.Is(err, io.EOF) {
				return objs, nil
			}
			return nil, err
		}
		if len(m) == 0 {
			continue
		}
		objs = append(objs, &unstructured.Unstructured{Object: m})
	}
}

func (d *demo) applyCluster(ctx context.Context) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace, Labels: map[string]string{"idemcp.io/injection": "enabled"}}}
	if err := waitFor(ctx, nil, 2*time.Minute, func() error {
		err := d.k8s.Create(ctx, ns)
		if apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("namespace %s exists (a previous demo's? delete it: kubectl delete ns %s)", namespace, namespace)
		}
		return err
	}); err != nil {
		return err
	}
	d.createdNS = true
	if err := d.apply(ctx); err != nil {
		return err
	}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "payments-mcp", Namespace: namespace},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "payments-mcp"},
			Ports:    []corev1.ServicePort{{Name: "mcp", Port: 80, TargetPort: intstr.FromString("mcp")}},
		},
	}
	if err := d.k8s.Create(ctx, svc); err != nil {
		return fmt.Errorf("creating the Service: %w", err)
	}
	fmt.Printf("      Service %s/payments-mcp: port 80 -> targetPort mcp (after injection, the sidecar's port)\n", namespace)
	return nil
}

func (d *demo) waitPod(ctx context.Context) error {
	var last string
	err := waitFor(ctx, nil, 3*time.Minute, func() error {
		var pods corev1.PodList
		if err := d.k8s.List(ctx, &pods, client.InNamespace(namespace), client.MatchingLabels{"app": "payments-mcp"}); err != nil {
			return err
		}
		for i := range pods.Items {
			p := &pods.Items[i]
			for _, c := range p.Status.Conditions {
				if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
					d.pod = p
					return nil
				}
			}
			last = fmt.Sprintf("pod %s is %s", p.Name, p.Status.Phase)
		}
		if last == "" {
			last = "no pod yet (kubectl -n " + namespace + " describe rs)"
		}
		return errors.New(last)
	})
	if err != nil {
		return fmt.Errorf("%w (kubectl -n %s describe pod -l app=payments-mcp)", err, namespace)
	}
	if sidecarOf(d.pod) == nil {
		return fmt.Errorf("pod %s runs without the sidecar; see the manager's log (kubectl -n idemcp-system logs deploy/idemcp-manager)", d.pod.Name)
	}
	printInjected(d.pod)
	var sidecarReady, serverStarted time.Time
	for _, s := range d.pod.Status.InitContainerStatuses {
		if s.Name == "idemcp-proxy" && s.State.Running != nil {
			sidecarReady = s.State.Running.StartedAt.Time
		}
	}
	for _, s := range d.pod.Status.ContainerStatuses {
		if s.Name == "server" && s.State.Running != nil {
			serverStarted = s.State.Running.StartedAt.Time
		}
	}
	fmt.Printf("      pod %s Ready on node %s: sidecar started %s, server %s\n", d.pod.Name, d.pod.Spec.NodeName,
		sidecarReady.Format(time.TimeOnly), serverStarted.Format(time.TimeOnly))
	return nil
}

// forward port-forwards to the pod through the API server, as kubectl
// port-forward does: the server's port and the sidecar's.
func (d *demo) forward(ctx context.Context) error {
	sc := sidecarOf(d.pod)
	var proxyPort int32
	for _, p := range sc.Ports {
		if p.Name != "idemcp-admin" {
			proxyPort = p.ContainerPort
		}
	}
	if proxyPort == 0 {
		return errors.New("the sidecar declares no MCP port")
	}
	tr, upgrader, err := spdy.RoundTripperFor(d.cfg)
	if err != nil {
		return err
	}
	u, err := url.Parse(d.cfg.Host)
	if err != nil {
		return err
	}
	u.Path = strings.TrimSuffix(u.Path, "/") + fmt.Sprintf("/api/v1/namespaces/%s/pods/%s/portforward", namespace, d.pod.Name)
	dialer := spdy.NewDialer(upgrader, &http.Client{Transport: tr}, http.MethodPost, u)
	ready := make(chan struct{})
	d.stopForward = make(chan struct{})
	var out, errOut bytes.Buffer
	fw, err := portforward.NewOnAddresses(dialer, []string{"127.0.0.1"},
		[]string{fmt.Sprintf("0:%d", serverPort), fmt.Sprintf("0:%d", proxyPort)}, d.stopForward, ready, &out, &errOut)
	if err != nil {
		return err
	}
	failed := make(chan error, 1)
	go func() { failed <- fw.ForwardPorts() }()
	select {
	case <-ready:
	case err := <-failed:
		return fmt.Errorf("port-forward to pod %s: %w %s", d.pod.Name, err, errOut.String())
	case <-time.After(30 * time.Second):
		return fmt.Errorf("port-forward to pod %s did not get ready in 30s: %s", d.pod.Name, errOut.String())
	}
	ports, err := fw.GetPorts()
	if err != nil {
		return err
	}
	for _, p := range ports {
		switch int32(p.Remote) { //nolint:gosec // a port number
		case serverPort:
			serverBase = fmt.Sprintf("http://127.0.0.1:%d", p.Local)
		case proxyPort:
			d.proxy = fmt.Sprintf("http://127.0.0.1:%d/mcp", p.Local)
		}
	}
	if err := httpOK(serverBase + "/counts"); err != nil {
		return fmt.Errorf("the server through the port-forward: %w", err)
	}
	fmt.Printf("      server :%d -> %s, sidecar :%d -> %s\n", serverPort, serverBase, proxyPort, d.proxy)
	return nil
}

// kubectlPath is kubectl from PATH, else the one make demo built.
func (d *demo) kubectlPath() string {
	if p, err := exec.LookPath("kubectl"); err == nil {
		return p
	}
	return filepath.Join(d.assets, "kubectl")
}

// cleanupCluster deletes what the demo created, and idemcp if it installed
// it: the namespace first (the manager releases the policy's finalizer),
// then the webhook, so no pod create waits on a manager going away.
func (d *demo) cleanupCluster() {
	if d.stopForward != nil {
		close(d.stopForward)
	}
	if d.k8s == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if d.createdNS {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}
		_ = d.k8s.Delete(ctx, ns)
		if err := waitFor(ctx, nil, 2*time.Minute, func() error {
			err := d.k8s.Get(ctx, client.ObjectKey{Name: namespace}, ns)
			if apierrors.IsNotFound(err) {
				return nil
			}
			return fmt.Errorf("namespace %s still terminating", namespace)
		}); err != nil {
			fmt.Fprintf(os.Stderr, "demo: cleaning up: %v\n", err)
		}
	}
	if !d.installed {
		return
	}
	for i := len(d.manifest) - 1; i >= 0; i-- {
		if d.manifest[i].GetKind() == "MutatingWebhookConfiguration" {
			_ = d.k8s.Delete(ctx, d.manifest[i])
		}
	}
	for i := len(d.manifest) - 1; i >= 0; i-- {
		if err := d.k8s.Delete(ctx, d.manifest[i]); err != nil && !apierrors.IsNotFound(err) {
			fmt.Fprintf(os.Stderr, "demo: uninstalling %s %s: %v\n", d.manifest[i].GetKind(), d.manifest[i].GetName(), err)
		}
	}
	if err := waitFor(ctx, nil, 2*time.Minute, func() error {
		err := d.k8s.Get(ctx, client.ObjectKey{Name: "idemcp-system"}, &corev1.Namespace{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		return errors.New("namespace idemcp-system still terminating")
	}); err != nil {
		fmt.Fprintf(os.Stderr, "demo: uninstalling: %v\n", err)
	}
	fmt.Println("demo: removed the demo namespace and uninstalled idemcp")
}
