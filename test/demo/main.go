// Command demo is `make demo`: idemcp's main job on an embedded local
// control plane, in about a minute and with no cluster. It starts the
// kube-apiserver and etcd the tests build, installs idemcp's CRD and webhook,
// runs `idemcp manager`, applies a policy, creates an opted-in pod, then does
// what a kubelet would: it runs the MCP server and the injected sidecar as
// local processes with the args and env of the injected spec. A real MCP
// client retries tool calls the way agents do, directly and through idemcp,
// and the demo prints what ran.
//
//	go run ./test/demo --idemcp bin/idemcp --assets "$(hack/setup-envtest.sh)"
package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/test/mcpserver"
	"github.com/idemcp/idemcp/test/poll"
)

const (
	policyName = "payments"
	agentToken = "Bearer demo-agent"
)

var (
	// namespace is the demo's; on a real cluster one less likely to be taken.
	namespace = "demo"
	// serverPort is the MCP server's port in the pod; on the embedded
	// control plane, a free loopback port, since the demo runs the pod here.
	serverPort int32 = 18080
	// serverBase is where the demo reaches the MCP server directly.
	serverBase = fmt.Sprintf("http://127.0.0.1:%d", serverPort)
	// sidecarPort and sidecarAdminPort are the injected sidecar's, which
	// the manager is told to inject on the embedded control plane.
	sidecarPort, sidecarAdminPort int32
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "server" {
		serve(os.Args[2:])
		return
	}
	var d demo
	flag.StringVar(&d.idemcp, "idemcp", "bin/idemcp", "the idemcp binary to run as manager and sidecar")
	flag.StringVar(&d.assets, "assets", os.Getenv("KUBEBUILDER_ASSETS"), "directory of kube-apiserver, etcd and kubectl (hack/setup-envtest.sh prints it)")
	flag.StringVar(&d.kconfig, "cluster", "", "the kubeconfig of a real cluster to run on, instead of an embedded control plane")
	flag.StringVar(&d.image, "image", "", "with --cluster: idemcp's image, loaded in or pullable by the cluster (make image IMG=...)")
	flag.StringVar(&d.serverImage, "server-image", "", "with --cluster: the demo MCP server's image (make demo-images)")
	flag.Parse()
	if d.kconfig != "" {
		if d.image == "" || d.serverImage == "" {
			fmt.Fprintln(os.Stderr, "demo: --cluster needs --image and --server-image (make demo-images IMG=... DEMO_SERVER_IMG=..., then load or push both)")
			os.Exit(2)
		}
		namespace = "idemcp-demo"
	} else {
		// The demo runs the pod's processes on this machine: take ports
		// nothing else holds for the server and the sidecar.
		for _, p := range []*int32{&serverPort, &sidecarPort, &sidecarAdminPort} {
			n, err := freeport.Port("127.0.0.1")
			if err != nil {
				fmt.Fprintln(os.Stderr, "demo:", err)
				os.Exit(1)
			}
			*p = int32(n) //nolint:gosec // a port number
		}
		serverBase = fmt.Sprintf("http://127.0.0.1:%d", serverPort)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(d.run(ctx))
}

type demo struct {
	idemcp, assets string
	dir            string
	start          time.Time
	n              int

	env     *envtest.Environment
	cfg     *rest.Config
	k8s     client.Client
	kube    kubernetes.Interface
	kconfig string
	procs   []*proc
	pod     *corev1.Pod
	proxy   string // the sidecar's MCP endpoint

	// On a real cluster (--cluster).
	image, serverImage string
	installed          bool // idemcp was not there before: uninstall it at the end
	createdNS          bool
	manifest           []*unstructured.Unstructured
	stopForward        chan struct{}
}

type step struct {
	title string
	fn    func(context.Context) error
}

func (d *demo) cluster() bool { return d.image != "" }

func (d *demo) run(ctx context.Context) (code int) {
	d.start = time.Now()
	var err error
	if d.dir, err = os.MkdirTemp("", "idemcp-demo-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer d.cleanup()
	steps := []step{
		{"Start a local control plane (kube-apiserver and etcd)", d.controlPlane},
		{"Run idemcp manager against it (controller, webhook, policy stream)", d.manager},
		{"Apply an IdempotencyPolicy and an opted-in Deployment of an MCP server", d.apply},
		{"Create the Deployment's pod: the webhook injects the sidecar", d.createPod},
		{"Run the pod as a kubelet would: the MCP server and the injected sidecar, as local processes", d.runPod},
		{"An agent retries charge_card 5 times: directly, then through idemcp", d.retries},
		{"A burst: 20 concurrent identical calls through idemcp", d.burst},
		{"Change the policy live: refund becomes Deduplicate", d.liveChange},
		{"What kubectl shows", d.kubectl},
	}
	where := "the embedded control plane"
	if d.cluster() {
		steps = d.clusterSteps()
		where = "the cluster"
	}
	for _, s := range steps {
		d.n++
		fmt.Printf("\n[%d/%d] %s\n", d.n, len(steps), s.title)
		t := time.Now()
		if err := s.fn(ctx); err != nil {
			fmt.Fprintf(os.Stderr, "\ndemo: step %d (%s) failed: %v\nlogs of the processes it ran: %s\n", d.n, s.title, err, d.dir)
			d.dir = "" // keep the logs
			return 1
		}
		fmt.Printf("      (%s)\n", time.Since(t).Round(10*time.Millisecond))
	}
	fmt.Printf(`
Done in %s on %s. What happened:
  - the webhook injected idemcp's sidecar into an opted-in pod, with the policy's snapshot;
  - the agent's 5 retries charged the card 5 times directly and once through idemcp;
  - a live policy change reached the running sidecar without a restart.
Next:
  - README.md "Install on a cluster": make build-installer IMG=... and kubectl apply -f dist/install.yaml
  - config/samples: the policies and an example MCP server Deployment and Service
  - idemcp wrap -- node my-server.js: the same proxy in front of a stdio server
`, time.Since(d.start).Round(100*time.Millisecond), where)
	return 0
}

func (d *demo) controlPlane(context.Context) error {
	if d.assets == "" {
		return errors.New("no envtest binaries: run through make demo, or pass --assets \"$(hack/setup-envtest.sh)\"")
	}
	root := repoRoot()
	d.env = &envtest.Environment{
		BinaryAssetsDirectory: d.assets,
		CRDDirectoryPaths:     []string{filepath.Join(root, "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
		WebhookInstallOptions: envtest.WebhookInstallOptions{
			Paths:            []string{filepath.Join(root, "config", "webhook", "manifests.yaml")},
			LocalServingHost: "127.0.0.1",
		},
	}
	cfg, err := d.env.Start()
	if err != nil {
		return fmt.Errorf("starting kube-apiserver and etcd from %s: %w", d.assets, err)
	}
	d.cfg = cfg
	user, err := d.env.AddUser(envtest.User{Name: "demo-admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return err
	}
	kc, err := user.KubeConfig()
	if err != nil {
		return err
	}
	d.kconfig = filepath.Join(d.dir, "kubeconfig")
	if err := os.WriteFile(d.kconfig, kc, 0o600); err != nil {
		return err
	}
	if d.k8s, err = client.New(cfg, client.Options{Scheme: manager.NewScheme()}); err != nil {
		return err
	}
	if d.kube, err = kubernetes.NewForConfig(cfg); err != nil {
		return err
	}
	fmt.Printf("      kube-apiserver at %s; KUBECONFIG=%s\n", cfg.Host, d.kconfig)
	return nil
}

func (d *demo) manager(ctx context.Context) error {
	for _, ns := range []string{"idemcp-system", namespace} {
		obj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}
		if ns == namespace {
			obj.Labels = map[string]string{"idemcp.io/injection": "enabled"}
		}
		if err := d.k8s.Create(ctx, obj); err != nil {
			return err
		}
		// No controller-manager runs here to create it.
		if err := d.k8s.Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default", Namespace: ns}}); err != nil {
			return err
		}
	}
	wh := d.env.WebhookInstallOptions
	// The policy stream serves with the webhook's certificate (envtest's,
	// for 127.0.0.1); sidecars verify it with the CA next to it.
	if err := os.WriteFile(filepath.Join(wh.LocalServingCertDir, "ca.crt"), wh.LocalServingCAData, 0o600); err != nil {
		return err
	}
	stream, err := freeAddr()
	if err != nil {
		return err
	}
	p, err := d.start1("manager", d.idemcp, []string{"manager",
		"--policy-stream-bind-address=" + stream, "--policy-stream-url=https://" + stream,
		"--kubeconfig=" + d.kconfig, "--leader-elect=false", "--namespace=idemcp-system",
		"--metrics-bind-address=0", "--health-probe-bind-address=0",
		"--webhook-cert-management=", "--webhook-cert-dir=" + wh.LocalServingCertDir, fmt.Sprintf("--webhook-port=%d", wh.LocalServingPort),
		"--sidecar-image=ghcr.io/idemcp/idemcp:demo",
		fmt.Sprintf("--sidecar-port=%d", sidecarPort), fmt.Sprintf("--sidecar-admin-port=%d", sidecarAdminPort),
	}, nil)
	if err != nil {
		return err
	}
	addr := net.JoinHostPort(wh.LocalServingHost, fmt.Sprint(wh.LocalServingPort))
	if err := waitFor(ctx, p, 30*time.Second, func() error {
		conn, err := tls.Dial("tcp", addr, &tls.Config{InsecureSkipVerify: true}) //nolint:gosec // only probes that the port serves TLS
		if err == nil {
			_ = conn.Close()
		}
		return err
	}); err != nil {
		return fmt.Errorf("the manager's webhook did not listen on %s: %w", addr, err)
	}
	fmt.Printf("      manager pid %d, webhook on %s (log: %s)\n", p.cmd.Process.Pid, addr, p.log)
	return nil
}

func (d *demo) policy() *v1alpha1.IdempotencyPolicy {
	return &v1alpha1.IdempotencyPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: policyName, Namespace: namespace},
		Spec: v1alpha1.IdempotencyPolicySpec{
			TTL:      &metav1.Duration{Duration: time.Hour},
			Store:    v1alpha1.StoreSpec{Type: v1alpha1.StoreMemory},
			KeyScope: v1alpha1.ScopePrincipal,
			Tools: []v1alpha1.ToolRule{
				{Name: "charge_*", Mode: v1alpha1.ModeDeduplicate},
				{Name: "refund", Mode: v1alpha1.ModePassthrough},
			},
		},
	}
}

func (d *demo) apply(ctx context.Context) error {
	pol := d.policy()
	if err := d.k8s.Create(ctx, pol); err != nil {
		return fmt.Errorf("applying the policy: %w", err)
	}
	dep := d.deployment()
	if err := d.k8s.Create(ctx, dep); err != nil {
		return fmt.Errorf("creating the Deployment: %w", err)
	}
	out, _ := yaml.Marshal(pol.Spec)
	fmt.Printf("      policy %s/%s (keyScope Principal: an agent's retries on new connections share keys):\n%s", namespace, policyName, indent(string(out), "        "))
	fmt.Printf("      Deployment %s/%s: label idemcp.io/inject=true, annotation idemcp.io/policy=%s, port mcp %d\n", namespace, dep.Name, policyName, serverPort)
	return nil
}

func (d *demo) deployment() *appsv1.Deployment {
	labels := map[string]string{"app": "payments-mcp"}
	tmplLabels := map[string]string{"app": "payments-mcp", "idemcp.io/inject": "true"}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "payments-mcp", Namespace: namespace},
		Spec: appsv1.DeploymentSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{
					Labels:      tmplLabels,
					Annotations: map[string]string{"idemcp.io/policy": policyName},
				},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{
					Name:  "server",
					Image: "example.com/payments-mcp:1.0",
					Ports: []corev1.ContainerPort{{Name: "mcp", ContainerPort: serverPort}},
				}}},
			},
		},
	}
	if d.cluster() {
		c := &dep.Spec.Template.Spec.Containers[0]
		c.Image = d.serverImage
		c.Args = []string{"server", "--listen", fmt.Sprintf("0.0.0.0:%d", serverPort)}
		c.ReadinessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/counts", Port: intstr.FromInt32(serverPort)}}, PeriodSeconds: 1}
		c.SecurityContext = &corev1.SecurityContext{
			AllowPrivilegeEscalation: ptr.To(false), ReadOnlyRootFilesystem: ptr.To(true), RunAsNonRoot: ptr.To(true),
			Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
		}
		dep.Spec.Template.Spec.SecurityContext = &corev1.PodSecurityContext{SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}}
		// The root filesystem is read-only; the server writes only to /tmp.
		dep.Spec.Template.Spec.Volumes = []corev1.Volume{{Name: "tmp", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}}
		c.VolumeMounts = []corev1.VolumeMount{{Name: "tmp", MountPath: "/tmp"}}
	}
	return dep
}

// createPod creates the pod a ReplicaSet would (no controller-manager runs
// here), so that the real API server calls the webhook.
func (d *demo) createPod(ctx context.Context) error {
	dep := d.deployment()
	pod := &corev1.Pod{
		ObjectMeta: *dep.Spec.Template.ObjectMeta.DeepCopy(),
		Spec:       *dep.Spec.Template.Spec.DeepCopy(),
	}
	pod.Name, pod.Namespace = "payments-mcp-7d9f8-demo", namespace
	if err := d.k8s.Create(ctx, pod); err != nil {
		return fmt.Errorf("creating the pod (the webhook answers for it): %w", err)
	}
	d.pod = pod
	if sidecarOf(pod) == nil {
		return errors.New("the webhook admitted the pod without a sidecar; see the manager's log")
	}
	printInjected(pod)
	return nil
}

// printInjected prints the essentials of the injected pod spec.
func printInjected(pod *corev1.Pod) {
	sc := sidecarOf(pod)
	fmt.Printf("      injected: %s\n", pod.Annotations["idemcp.io/status"])
	fmt.Printf("      sidecar %q, image %s, restartPolicy %s (a native sidecar: up before the server, down after it)\n", sc.Name, sc.Image, ptr.Deref(sc.RestartPolicy, "-"))
	fmt.Printf("        args: %s\n", strings.Join(sc.Args, " "))
	var env []string
	for _, e := range sc.Env {
		switch {
		case e.ValueFrom != nil:
			env = append(env, e.Name+"=(from the pod)")
		case len(e.Value) > 40:
			env = append(env, fmt.Sprintf("%s=(%d bytes)", e.Name, len(e.Value)))
		default:
			env = append(env, e.Name+"="+e.Value)
		}
	}
	fmt.Printf("        env: %s\n", strings.Join(env, ", "))
	for _, c := range pod.Spec.Containers {
		for _, p := range c.Ports {
			fmt.Printf("      container %s port %s %d\n", c.Name, p.Name, p.ContainerPort)
		}
	}
	for _, p := range sc.Ports {
		fmt.Printf("      sidecar port %s %d\n", p.Name, p.ContainerPort)
	}
}

func sidecarOf(pod *corev1.Pod) *corev1.Container {
	for _, cs := range [][]corev1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for i := range cs {
			if cs[i].Name == "idemcp-proxy" {
				return &cs[i]
			}
		}
	}
	return nil
}

// runPod starts the server and the sidecar with the injected spec's args and
// env. Two things differ from a node: listeners bind loopback, and the
// volumes the sidecar mounts are files under the demo's directory.
func (d *demo) runPod(ctx context.Context) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	srv, err := d.start1("server", self, []string{"server", "--listen", fmt.Sprintf("127.0.0.1:%d", serverPort)}, nil)
	if err != nil {
		return err
	}
	if err := waitFor(ctx, srv, 20*time.Second, func() error { return httpOK(fmt.Sprintf("http://127.0.0.1:%d/counts", serverPort)) }); err != nil {
		return fmt.Errorf("the MCP server did not start: %w", err)
	}
	sc := sidecarOf(d.pod)
	env, err := d.resolveEnv(ctx, sc)
	if err != nil {
		return err
	}
	mounts, err := d.materializeVolumes(ctx, sc)
	if err != nil {
		return err
	}
	var args []string
	for _, a := range sc.Args {
		for _, flagName := range []string{"--listen=:", "--admin-listen=:"} {
			if strings.HasPrefix(a, flagName) {
				a = strings.TrimSuffix(flagName, ":") + "127.0.0.1:" + strings.TrimPrefix(a, flagName)
			}
		}
		for from, to := range mounts {
			a = strings.ReplaceAll(a, from, to)
		}
		args = append(args, a)
	}
	for i := range env {
		for from, to := range mounts {
			env[i] = strings.ReplaceAll(env[i], from, to)
		}
	}
	if dir, ok := mounts["/var/run/secrets/idemcp"]; ok {
		// The sidecar's default token path, where the pod mounts it.
		env = append(env, "IDEMCP_POLICY_TOKEN_FILE="+filepath.Join(dir, "token"))
	}
	p, err := d.start1("sidecar", d.idemcp, args, env)
	if err != nil {
		return err
	}
	admin, proxy := "", ""
	for _, port := range sc.Ports {
		switch port.Name {
		case "idemcp-admin":
			admin = fmt.Sprintf("http://127.0.0.1:%d", port.ContainerPort)
		default:
			proxy = fmt.Sprintf("http://127.0.0.1:%d/mcp", port.ContainerPort)
		}
	}
	if err := waitFor(ctx, p, 20*time.Second, func() error { return httpOK(admin + "/readyz") }); err != nil {
		return fmt.Errorf("the sidecar did not become ready on %s/readyz: %w", admin, err)
	}
	d.proxy = proxy
	fmt.Printf("      server pid %d on 127.0.0.1:%d; sidecar pid %d, MCP at %s, admin at %s (logs in %s)\n",
		srv.cmd.Process.Pid, serverPort, p.cmd.Process.Pid, proxy, admin, d.dir)
	return nil
}

// resolveEnv does the kubelet's part for env vars: field refs and Secrets.
func (d *demo) resolveEnv(ctx context.Context, c *corev1.Container) ([]string, error) {
	var env []string
	for _, e := range c.Env {
		v := e.Value
		if s := e.ValueFrom; s != nil {
			switch {
			case s.FieldRef != nil && s.FieldRef.FieldPath == "metadata.name":
				v = d.pod.Name
			case s.FieldRef != nil && s.FieldRef.FieldPath == "metadata.namespace":
				v = d.pod.Namespace
			case s.FieldRef != nil && (s.FieldRef.FieldPath == "status.podIP" || s.FieldRef.FieldPath == "status.podIPs"):
				// The pod's processes run on this host's loopback.
				v = "127.0.0.1"
			case s.FieldRef != nil:
				return nil, fmt.Errorf("env %s: field %s is not one the demo resolves", e.Name, s.FieldRef.FieldPath)
			case s.SecretKeyRef != nil:
				sec, err := d.kube.CoreV1().Secrets(d.pod.Namespace).Get(ctx, s.SecretKeyRef.Name, metav1.GetOptions{})
				if err != nil {
					return nil, fmt.Errorf("env %s: %w", e.Name, err)
				}
				v = string(sec.Data[s.SecretKeyRef.Key])
			default:
				continue
			}
		}
		env = append(env, e.Name+"="+v)
	}
	return env, nil
}

// materializeVolumes writes what the sidecar's volumes would hold: a
// projected service account token (a real TokenRequest bound to the pod),
// ConfigMaps and Secrets. It returns mount path -> local directory.
func (d *demo) materializeVolumes(ctx context.Context, c *corev1.Container) (map[string]string, error) {
	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		var vol *corev1.Volume
		for i := range d.pod.Spec.Volumes {
			if d.pod.Spec.Volumes[i].Name == m.Name {
				vol = &d.pod.Spec.Volumes[i]
			}
		}
		if vol == nil {
			return nil, fmt.Errorf("volume %s is mounted but not declared", m.Name)
		}
		dir := filepath.Join(d.dir, "volumes", m.Name)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, err
		}
		files := map[string][]byte{}
		if vol.Projected != nil {
			for _, src := range vol.Projected.Sources {
				if t := src.ServiceAccountToken; t != nil {
					sa := d.pod.Spec.ServiceAccountName
					if sa == "" {
						sa = "default"
					}
					tok, err := d.kube.CoreV1().ServiceAccounts(d.pod.Namespace).CreateToken(ctx, sa, &authenticationv1.TokenRequest{
						Spec: authenticationv1.TokenRequestSpec{
							Audiences:         []string{t.Audience},
							ExpirationSeconds: t.ExpirationSeconds,
							BoundObjectRef:    &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: d.pod.Name, UID: d.pod.UID},
						},
					}, metav1.CreateOptions{})
					if err != nil {
						return nil, fmt.Errorf("requesting the projected token for volume %s: %w", m.Name, err)
					}
					files[t.Path] = []byte(tok.Status.Token)
				}
				if cm := src.ConfigMap; cm != nil {
					obj, err := d.kube.CoreV1().ConfigMaps(d.pod.Namespace).Get(ctx, cm.Name, metav1.GetOptions{})
					if err != nil {
						return nil, err
					}
					for k, v := range obj.Data {
						files[k] = []byte(v)
					}
				}
				if s := src.Secret; s != nil {
					obj, err := d.kube.CoreV1().Secrets(d.pod.Namespace).Get(ctx, s.Name, metav1.GetOptions{})
					if err != nil {
						return nil, err
					}
					for k, v := range obj.Data {
						files[k] = v
					}
				}
			}
		}
		for name, data := range files {
			if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
				return nil, err
			}
		}
		mounts[m.MountPath] = dir
	}
	return mounts, nil
}

func (d *demo) retries(ctx context.Context) error {
	direct := serverBase + "/mcp"
	args := map[string]any{"card": "4242", "amount": 5}
	before, err := charges("charge_card")
	if err != nil {
		return err
	}
	for range 5 {
		if _, err := callOnce(ctx, direct, "charge_card", args); err != nil {
			return fmt.Errorf("calling the server directly: %w", err)
		}
	}
	mid, _ := charges("charge_card")
	replays := 0
	for i := range 5 {
		res, err := callOnce(ctx, d.proxy, "charge_card", args)
		if err != nil {
			return fmt.Errorf("calling through idemcp (attempt %d): %w", i+1, err)
		}
		if res.Meta["idemcp.io/replayed"] == true {
			replays++
		}
	}
	after, _ := charges("charge_card")
	fmt.Printf("      direct: %d charges / through idemcp: %d charge (%d of 5 answers were replays, marked result._meta[\"idemcp.io/replayed\"])\n",
		mid-before, after-mid, replays)
	if mid-before != 5 || after-mid != 1 || replays != 4 {
		return fmt.Errorf("expected 5 direct charges, 1 through idemcp and 4 replays; got %d, %d and %d", mid-before, after-mid, replays)
	}
	return nil
}

func (d *demo) burst(ctx context.Context) error {
	before, _ := charges("charge_card")
	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for range 20 {
		wg.Go(func() {
			if _, err := callOnce(ctx, d.proxy, "charge_card", map[string]any{"card": "5555", "amount": 20}); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		return err
	}
	after, _ := charges("charge_card")
	fmt.Printf("      20 concurrent calls: %d charge; the other 19 waited for it and got its result\n", after-before)
	if after-before != 1 {
		return fmt.Errorf("expected 1 charge, got %d", after-before)
	}
	return nil
}

func (d *demo) liveChange(ctx context.Context) error {
	args := map[string]any{"card": "4242", "amount": 5}
	before, _ := charges("refund")
	for range 2 {
		if _, err := callOnce(ctx, d.proxy, "refund", args); err != nil {
			return err
		}
	}
	mid, _ := charges("refund")
	fmt.Printf("      refund is Passthrough: 2 calls, %d refunds\n", mid-before)
	var pol v1alpha1.IdempotencyPolicy
	if err := d.k8s.Get(ctx, client.ObjectKey{Namespace: namespace, Name: policyName}, &pol); err != nil {
		return err
	}
	patch := client.MergeFrom(pol.DeepCopy())
	pol.Spec.Tools[1].Mode = v1alpha1.ModeDeduplicate
	changed := time.Now()
	if err := d.k8s.Patch(ctx, &pol, patch); err != nil {
		return fmt.Errorf("patching the policy: %w", err)
	}
	if err := waitFor(ctx, nil, 10*time.Second, func() error {
		var p v1alpha1.IdempotencyPolicy
		if err := d.k8s.Get(ctx, client.ObjectKey{Namespace: namespace, Name: policyName}, &p); err != nil {
			return err
		}
		sc := ptr.Deref(p.Status.Sidecars, v1alpha1.SidecarsStatus{})
		if p.Status.ObservedGeneration != p.Generation || sc.Synced != 1 {
			return fmt.Errorf("status: observedGeneration %d of %d, %d/%d sidecars synced", p.Status.ObservedGeneration, p.Generation, sc.Synced, sc.Connected)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("the sidecar did not acknowledge the new policy: %w", err)
	}
	fmt.Printf("      kubectl patch idpol: the sidecar applied and acknowledged it in %s\n", time.Since(changed).Round(time.Millisecond))
	for range 2 {
		if _, err := callOnce(ctx, d.proxy, "refund", args); err != nil {
			return err
		}
	}
	after, _ := charges("refund")
	fmt.Printf("      refund is now Deduplicate: 2 more calls, %d refund\n", after-mid)
	if mid-before != 2 || after-mid != 1 {
		return fmt.Errorf("expected 2 refunds before the change and 1 after; got %d and %d", mid-before, after-mid)
	}
	return nil
}

func (d *demo) kubectl(ctx context.Context) error {
	kubectl := d.kubectlPath()
	for _, args := range [][]string{
		{"get", "idpol", "-n", namespace},
		{"describe", "idpol", "-n", namespace, policyName},
	} {
		cmd := exec.CommandContext(ctx, kubectl, append([]string{"--kubeconfig", d.kconfig}, args...)...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("kubectl %s: %w\n%s", strings.Join(args, " "), err, out)
		}
		if args[0] == "describe" {
			out = describeTail(out)
		}
		fmt.Printf("      $ kubectl %s\n%s", strings.Join(args, " "), indent(string(out), "        "))
	}
	return nil
}

// describeTail keeps the part of `kubectl describe` from Status on.
func describeTail(out []byte) []byte {
	if i := bytes.Index(out, []byte("\nStatus:")); i >= 0 {
		return out[i+1:]
	}
	return out
}

// proc is a process the demo runs, with its output in a log file.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	err  error
}

func (d *demo) start1(name, bin string, args, env []string) (*proc, error) {
	logPath := filepath.Join(d.dir, name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	if env != nil {
		cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, env...)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("starting %s (%s): %w", name, bin, err)
	}
	p := &proc{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		_ = f.Close()
		close(p.done)
	}()
	d.procs = append(d.procs, p)
	return p, nil
}

func (d *demo) cleanup() {
	if d.cluster() {
		d.cleanupCluster()
	}
	for i := len(d.procs) - 1; i >= 0; i-- {
		p := d.procs[i]
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-p.done
		}
	}
	if d.env != nil {
		_ = d.env.Stop()
	}
	if d.dir != "" {
		_ = os.RemoveAll(d.dir)
	}
}

// waitFor polls cond until it succeeds, the timeout passes, or p exits.
func waitFor(ctx context.Context, p *proc, timeout time.Duration, cond func() error) error {
	var exited error
	err := poll.Until(ctx, timeout, func() error {
		err := cond()
		if err == nil || p == nil {
			return err
		}
		select {
		case <-p.done:
			exited = fmt.Errorf("%s exited (%w); its log: %s", p.name, p.err, p.log)
			return nil
		default:
			return err
		}
	})
	if exited != nil {
		return exited
	}
	return err
}

func freeAddr() (string, error) {
	return freeport.Addr("127.0.0.1")
}

func httpOK(url string) error {
	resp, err := probeClient.Get(url) //nolint:gosec,noctx // a loopback readiness probe, bounded by the client's timeout
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	_, _ = io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	return nil
}

// callOnce is one attempt of an agent: a new connection (and session), the
// agent's credentials, one tools/call.
func callOnce(ctx context.Context, endpoint, tool string, args map[string]any) (*mcp.CallToolResult, error) {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	hc := &http.Client{Transport: authTransport{}}
	c := mcp.NewClient(&mcp.Implementation{Name: "demo-agent", Version: "1.0.0"}, nil)
	cs, err := c.Connect(ctx, &mcp.StreamableClientTransport{Endpoint: endpoint, HTTPClient: hc}, nil)
	if err != nil {
		return nil, err
	}
	defer func() { _ = cs.Close() }()
	res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: tool, Arguments: args})
	if err != nil {
		return nil, err
	}
	if res.IsError {
		return nil, fmt.Errorf("%s answered an error: %v", tool, res.Content)
	}
	return res, nil
}

type authTransport struct{}

func (authTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", agentToken)
	return http.DefaultTransport.RoundTrip(r)
}

func charges(tool string) (int, error) {
	resp, err := probeClient.Get(serverBase + "/counts") //nolint:noctx // loopback, bounded by the client's timeout
	if err != nil {
		return 0, err
	}
	defer func() { _ = resp.Body.Close() }()
	var m map[string]int
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		return 0, err
	}
	return m[tool], nil
}

// serve is the demo's MCP server process: the counting server on /mcp, and
// how many times each tool ran on /counts.
func serve(args []string) {
	fs := flag.NewFlagSet("demo server", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:18080", "address")
	_ = fs.Parse(args)
	s := mcpserver.New()
	mux := http.NewServeMux()
	mux.Handle("/mcp", s.Handler(false))
	mux.HandleFunc("/counts", func(w http.ResponseWriter, _ *http.Request) {
		m := map[string]int{}
		for _, t := range []string{"charge_card", "refund"} {
			m[t] = s.Counts.Get(t)
		}
		_ = json.NewEncoder(w).Encode(m)
	})
	srv := &http.Server{Addr: *listen, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	if err := srv.ListenAndServe(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// probeClient reads the server's counts: a stalled port-forward must not
// hang the demo.
var probeClient = &http.Client{Timeout: 10 * time.Second}

func indent(s, prefix string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return prefix + strings.Join(lines, "\n"+prefix) + "\n"
}

func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}
