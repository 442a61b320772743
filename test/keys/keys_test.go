// Package keys_test is the acceptance test of kubectl idemcp keys: a real
// API server (envtest), the real manager serving its key API on the
// policy stream's listener, real sidecar processes in front of an MCP
// upstream, and a real redis-server. Users are service accounts bound to
// idemcp's own viewer and editor ClusterRoles (config/rbac), and every
// command runs as kubectl would run the plugin, from a kubeconfig.
package keys_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	eventsv1 "k8s.io/api/events/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/controllers/keyapi"
	"github.com/idemcp/idemcp/controllers/policystream"
	"github.com/idemcp/idemcp/internal/credentials"
	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/internal/plugin"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/internal/store/postgres/pgtest"
	"github.com/idemcp/idemcp/internal/store/redis/redistest"
	"github.com/idemcp/idemcp/test/envtestutil"
	"github.com/idemcp/idemcp/test/procs"
	"github.com/idemcp/idemcp/test/testdeps"
	"github.com/idemcp/idemcp/webhook"
)

var (
	k8s        client.Client
	clientset  *kubernetes.Clientset
	cfg        *rest.Config
	caPEM      []byte
	streamAddr string
	// caFile is the manager's CA, which a namespace's user cannot read
	// from the cluster-scoped webhook configuration.
	caFile string
)

func TestMain(m *testing.M) {
	addr, err := freeport.Addr("127.0.0.1")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	streamAddr = addr
	code := envtestutil.RunWithManager(m, manager.Options{
		Namespace: "idemcp-system", MissingPolicy: "deny", Sidecar: webhook.DefaultConfig("idemcp:keys"),
		// Every interface: TestKeysThroughTheAPIServer's Endpoints need an
		// address that is not loopback, which the API server refuses.
		PolicyStreamAddr: ":" + strings.TrimPrefix(streamAddr, "127.0.0.1:"), PolicyStreamService: policystream.DefaultServiceName,
		PolicyStreamCA:    func(context.Context) ([]byte, error) { return caPEM, nil },
		PolicyStreamFlush: 100 * time.Millisecond,
	}, func(c *envtestutil.Cluster) {
		k8s, cfg = c.Client, c.Config
		caPEM = c.Env.WebhookInstallOptions.LocalServingCAData
		caFile = filepath.Join(c.Env.WebhookInstallOptions.LocalServingCertDir, "manager-ca.crt")
		if err := os.WriteFile(caFile, caPEM, 0o600); err != nil {
			panic(err)
		}
		clientset = kubernetes.NewForConfigOrDie(c.Config)
	})
	procs.Cleanup()
	os.Exit(code)
}

// upstream is an MCP server's tools/call endpoint that counts what runs.
// hold makes the next call of charge_card block until its connection
// drops (the sidecar that sent it dies mid-call: nothing is charged);
// prime makes the next call of ship_order end its response stream after
// a priming event and refuse its resumption, so a living sidecar cannot
// know the outcome either.
type upstream struct {
	url   string
	mu    sync.Mutex
	ran   map[string]int
	hold  atomic.Bool
	prime atomic.Bool
	held  chan struct{}
}

func startUpstream(t *testing.T) *upstream {
	t.Helper()
	u := &upstream{ran: map[string]int{}, held: make(chan struct{}, 1)}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(u.serve), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	u.url = "http://" + ln.Addr().String()
	return u
}

func (u *upstream) count(tool string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.ran[tool]
}

func (u *upstream) serve(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(w, "no resumption here", http.StatusMethodNotAllowed)
		return
	}
	var msg struct {
		ID     json.RawMessage `json:"id"`
		Method string          `json:"method"`
		Params struct {
			Name string `json:"name"`
		} `json:"params"`
	}
	body, _ := io.ReadAll(r.Body)
	if json.Unmarshal(body, &msg) != nil || len(msg.ID) == 0 {
		w.WriteHeader(http.StatusAccepted)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	if msg.Method != "tools/call" {
		_, _ = fmt.Fprintf(w, `{"jsonrpc":"2.0","id":%s,"result":{"tools":[]}}`, msg.ID)
		return
	}
	tool := msg.Params.Name
	if tool == "charge_card" && u.hold.CompareAndSwap(true, false) {
		u.held <- struct{}{}
		<-r.Context().Done()
		return
	}
	if tool == "ship_order" && u.prime.CompareAndSwap(true, false) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "id: prime-1\nretry: 50\ndata: \n\n")
		return
	}
	u.mu.Lock()
	u.ran[tool]++
	n := u.ran[tool]
	u.mu.Unlock()
	_, _ = fmt.Fprintf(w, `{"jsonrpc":"2.0","id":%s,"result":{"content":[{"type":"text","text":"%s #%d done"}]}}`, msg.ID, tool, n)
}

// post sends one tools/call through a sidecar as the principal "agent"
// with an explicit key, and returns the response's status and body.
func post(t *testing.T, sidecar, tool, key, args string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	body := `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"` + tool + `","arguments":` + args + `}}`
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+sidecar+"/mcp", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Authorization", "Bearer agent")
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("calling %s through %s: %v", tool, sidecar, err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// call is post, and returns the JSON-RPC error code (0 for a result) and
// the response.
func call(t *testing.T, sidecar, tool, key, args string) (int, string) {
	t.Helper()
	status, text := post(t, sidecar, tool, key, args)
	if i := strings.Index(text, "data: "); i >= 0 {
		text = strings.TrimSpace(text[i+len("data: "):])
	}
	var m struct {
		Error *struct {
			Code int `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(text), &m); err != nil {
		t.Fatalf("calling %s: %d %q is not a JSON-RPC response", tool, status, text)
	}
	if m.Error != nil {
		return m.Error.Code, text
	}
	return 0, text
}

// user is a service account bound to roles, with a kubeconfig of its own.
type user struct {
	name, kubeconfig string
}

func newUser(t *testing.T, ns, name string, roles ...string) user {
	t.Helper()
	ctx := context.Background()
	if err := k8s.Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}); err != nil {
		t.Fatal(err)
	}
	for _, role := range roles {
		if err := k8s.Create(ctx, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name + "-" + role},
			RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: role},
			Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: name, Namespace: ns}},
		}); err != nil {
			t.Fatal(err)
		}
	}
	tr, err := clientset.CoreV1().ServiceAccounts(ns).CreateToken(ctx, name, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3600)}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	kc := clientcmdapi.NewConfig()
	kc.Clusters["envtest"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos[name] = &clientcmdapi.AuthInfo{Token: tr.Status.Token}
	kc.Contexts[name] = &clientcmdapi.Context{Cluster: "envtest", AuthInfo: name, Namespace: ns}
	kc.CurrentContext = name
	path := filepath.Join(t.TempDir(), name+".kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		t.Fatal(err)
	}
	return user{name: "system:serviceaccount:" + ns + ":" + name, kubeconfig: path}
}

// kubectl runs kubectl idemcp as u and returns its exit code and output.
func (u user) kubectl(args ...string) (int, string, string) {
	var out, errOut bytes.Buffer
	args = append(args, "--kubeconfig", u.kubeconfig, "--manager-url", "https://"+streamAddr, "--manager-ca", caFile)
	code := plugin.Main(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func (u user) mustKubectl(t *testing.T, args ...string) string {
	t.Helper()
	code, out, errOut := u.kubectl(args...)
	if code != 0 {
		t.Fatalf("kubectl idemcp %s as %s: exit %d\n%s%s", strings.Join(args, " "), u.name, code, out, errOut)
	}
	return out
}

// installRoles creates idemcp's viewer and editor ClusterRoles from
// config/rbac, as the installer does.
func installRoles(t *testing.T) {
	t.Helper()
	for _, f := range []string{"idempotencypolicy_viewer_role.yaml", "idempotencypolicy_editor_role.yaml"} {
		b, err := os.ReadFile(filepath.Join("..", "..", "config", "rbac", f))
		if err != nil {
			t.Fatal(err)
		}
		var role rbacv1.ClusterRole
		if err := yaml.Unmarshal(b, &role); err != nil {
			t.Fatal(err)
		}
		if err := k8s.Create(context.Background(), &role); err != nil && !strings.Contains(err.Error(), "already exists") {
			t.Fatal(err)
		}
	}
}

const (
	viewerRole = "idempotencypolicy-viewer-role"
	editorRole = "idempotencypolicy-editor-role"
)

func namespace(t *testing.T, name string) {
	t.Helper()
	ctx := context.Background()
	if err := k8s.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: name, Name: "mcp"}}); err != nil {
		t.Fatal(err)
	}
}

// sidecar starts `idemcp sidecar` as the webhook configures it for pod
// name of the policy: the policy snapshot, the policy stream with the
// pod's projected token, and the policy's Secrets as env vars.
func sidecar(t *testing.T, p *v1alpha1.IdempotencyPolicy, podName, upstreamURL string, extraEnv []string, extraArgs ...string) *procs.Sidecar {
	t.Helper()
	ctx := context.Background()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: p.Namespace, Name: podName, Labels: map[string]string{v1alpha1.LabelPolicy: p.Name}},
		Spec:       corev1.PodSpec{ServiceAccountName: "mcp", Containers: []corev1.Container{{Name: "mcp", Image: "mcp:1"}}},
	}
	if err := k8s.Create(ctx, pod); err != nil {
		t.Fatal(err)
	}
	tr, err := clientset.CoreV1().ServiceAccounts(p.Namespace).CreateToken(ctx, "mcp", &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		Audiences: []string{policywire.TokenAudience}, ExpirationSeconds: ptr.To[int64](3600),
		BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte(tr.Status.Token), 0o600); err != nil {
		t.Fatal(err)
	}
	snap, err := json.Marshal(&v1alpha1.IdempotencyPolicy{
		TypeMeta:   metav1.TypeMeta{APIVersion: v1alpha1.GroupVersion.String(), Kind: "IdempotencyPolicy"},
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace}, Spec: p.Spec,
	})
	if err != nil {
		t.Fatal(err)
	}
	env := append([]string{"IDEMCP_POLICY=" + string(snap), "POD_NAME=" + podName, "POD_NAMESPACE=" + p.Namespace}, extraEnv...)
	args := append([]string{"--upstream", upstreamURL, "--policy-endpoint", "https://" + streamAddr,
		"--policy-ca", string(caPEM), "--policy-token-file", tokenFile}, extraArgs...)
	return procs.StartSidecar(t, procs.Binary(t), env, args...)
}

func createPolicy(t *testing.T, ns, name string, spec v1alpha1.IdempotencyPolicySpec) *v1alpha1.IdempotencyPolicy {
	t.Helper()
	p := &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: spec}
	if err := k8s.Create(context.Background(), p); err != nil {
		t.Fatal(err)
	}
	envtestutil.Eventually(t, "the policy to be reconciled", func() error {
		if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(p), p); err != nil {
			return err
		}
		if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionStoreReady); c == nil || c.Status != metav1.ConditionTrue {
			return fmt.Errorf("StoreReady is %+v", c)
		}
		return nil
	})
	return p
}

// waitKey waits until the list, as u, shows a key of tool in state.
func waitKey(t *testing.T, u user, ns, policyName, tool, state string) keyRow {
	t.Helper()
	var row keyRow
	envtestutil.Eventually(t, fmt.Sprintf("a %s key of %s", state, tool), func() error {
		rows := listKeys(t, u, ns, policyName)
		for _, r := range rows {
			if r.Tool == tool && r.State == state {
				row = r
				return nil
			}
		}
		return fmt.Errorf("keys list shows %+v", rows)
	})
	return row
}

type keyRow struct {
	Key, Tool, State, Pod, Holder string
}

func listKeys(t *testing.T, u user, ns, policyName string) []keyRow {
	t.Helper()
	out := u.mustKubectl(t, "keys", "list", policyName, "-n", ns, "-o", "json")
	var l struct {
		Records []keyRow `json:"records"`
	}
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		t.Fatalf("keys list -o json printed %q: %v", out, err)
	}
	return l.Records
}

// eventNaming waits for an Event on the policy whose note names who and
// the key.
func eventNaming(t *testing.T, ns, policyName, reason, who, key string) {
	t.Helper()
	envtestutil.Eventually(t, "an Event "+reason+" naming "+who, func() error {
		var evs eventsv1.EventList
		if err := k8s.List(context.Background(), &evs, client.InNamespace(ns)); err != nil {
			return err
		}
		var seen []string
		for _, e := range evs.Items {
			if e.Regarding.Kind == "IdempotencyPolicy" && e.Regarding.Name == policyName && e.Reason == reason &&
				strings.Contains(e.Note, who) && strings.Contains(e.Note, key[:12]) {
				return nil
			}
			seen = append(seen, e.Reason+": "+e.Note)
		}
		return fmt.Errorf("events: %q", seen)
	})
}

var forbidden = regexp.MustCompile(`may not (delete|get) idempotencypolicies/(keys|results)`)

// TestKeysOnRedis: a sidecar dies mid-call under onAbandoned: Error; its
// retries answer outcome unknown. The viewer lists the key but cannot
// release it nor read a result; the editor releases it and the next retry
// runs the tool exactly once; forget makes the next identical call run;
// each leaves an Event naming the editor.
func TestKeysOnRedis(t *testing.T) {
	const ns, name = "keys-redis", "payments"
	rds := redistest.Start(t)
	namespace(t, ns)
	testSharedStore(t, ns, name,
		v1alpha1.StoreSpec{Type: v1alpha1.StoreRedis, Redis: &v1alpha1.RedisStoreSpec{External: &v1alpha1.ExternalRedis{Addresses: []string{rds.Addr}}}},
		"IDEMCP_REDIS_KEY_PREFIX="+"idemcp:"+ns+"/"+name+":")
}

// TestKeysOnPostgres is TestKeysOnRedis with a PostgreSQL store, whose URL
// the manager and the sidecars read from the policy's Secret.
func TestKeysOnPostgres(t *testing.T) {
	const ns, name = "keys-postgres", "payments"
	srv := pgtest.Start(t)
	namespace(t, ns)
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pg", Labels: map[string]string{v1alpha1.LabelCredentials: "true"}}, Data: map[string][]byte{"url": []byte(srv.URL)}}
	if err := k8s.Create(context.Background(), sec); err != nil {
		t.Fatal(err)
	}
	testSharedStore(t, ns, name,
		v1alpha1.StoreSpec{Type: v1alpha1.StorePostgres, Postgres: &v1alpha1.PostgresStoreSpec{URLSecretRef: v1alpha1.SecretKeyRef{Name: "pg", Key: "url"}}},
		"IDEMCP_POSTGRES_URL="+srv.URL, "IDEMCP_POSTGRES_KEY_PREFIX="+"idemcp:"+ns+"/"+name+":")
}

// testSharedStore is the keys scenario on a store every sidecar of the
// policy shares, which the manager reads directly, in the namespace ns
// the caller made.
func testSharedStore(t *testing.T, ns, name string, st v1alpha1.StoreSpec, storeEnv ...string) {
	installRoles(t)
	viewer := newUser(t, ns, "viewer", viewerRole)
	editor := newUser(t, ns, "editor", viewerRole, editorRole)
	p := createPolicy(t, ns, name, v1alpha1.IdempotencyPolicySpec{
		Store:         st,
		LeaseDuration: &metav1.Duration{Duration: 2 * time.Second},
		Tools:         []v1alpha1.ToolRule{{Name: "charge_card", Mode: v1alpha1.ModeDeduplicate, OnAbandoned: v1alpha1.AbandonedError}},
	})
	var seal corev1.Secret
	if err := k8s.Get(context.Background(), client.ObjectKey{Namespace: ns, Name: credentials.SealSecretName(name)}, &seal); err != nil {
		t.Fatal(err)
	}
	env := append([]string{"IDEMCP_SEAL_KEYS=" + string(seal.Data[credentials.SealKeysKey])}, storeEnv...)
	up := startUpstream(t)
	a := sidecar(t, p, "mcp-0", up.url, env)
	b := sidecar(t, p, "mcp-1", up.url, env)

	// The sidecar of mcp-0 dies while charge_card runs.
	const args = `{"card":"4242424242424242","amount":12.5}`
	up.hold.Store(true)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, "http://"+a.Addr+"/mcp", strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"charge_card","arguments":`+args+`}}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		req.Header.Set("Authorization", "Bearer agent")
		req.Header.Set("Idempotency-Key", "order-1")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			_ = resp.Body.Close()
		}
	}()
	<-up.held
	pending := waitKey(t, viewer, ns, name, "charge_card", "pending")
	if pending.Pod != "mcp-0" {
		t.Fatalf("the pending key's pod is %q, want mcp-0", pending.Pod)
	}
	a.Kill()
	unknown := waitKey(t, viewer, ns, name, "charge_card", "outcome-unknown")
	if code, resp := call(t, b.Addr, "charge_card", "order-1", args); code != -32012 {
		t.Fatalf("a retry after the sidecar died got %d %s, want -32012 (outcome unknown)", code, resp)
	}

	// The viewer sees it, never its arguments, and may not resolve it.
	out := viewer.mustKubectl(t, "keys", "list", name, "-n", ns)
	if !strings.Contains(out, unknown.Key[:12]) || !strings.Contains(out, "outcome-unknown") || !strings.Contains(out, "charge_card") {
		t.Fatalf("keys list shows\n%s\nwant the outcome-unknown charge_card key %s", out, unknown.Key[:12])
	}
	if strings.Contains(out, "4242") || strings.Contains(out, unknown.Key) {
		t.Fatalf("keys list shows arguments or a whole key hash:\n%s", out)
	}
	if code, out, errOut := viewer.kubectl("keys", "release", name, unknown.Key[:12], "-n", ns); code != 1 || !forbidden.MatchString(errOut) {
		t.Fatalf("the viewer's release: exit %d\n%s%s\nwant exit 1 and a refusal naming the permission", code, out, errOut)
	}

	// The editor releases it; the next retry runs the tool, once.
	out = editor.mustKubectl(t, "keys", "release", name, unknown.Key[:12], "-n", ns)
	if !strings.Contains(out, "released") {
		t.Fatalf("keys release printed %q", out)
	}
	eventNaming(t, ns, name, "KeyReleased", editor.name, unknown.Key)
	for i := range 3 {
		if code, resp := call(t, b.Addr, "charge_card", "order-1", args); code != 0 || !strings.Contains(resp, "charge_card #1 done") {
			t.Fatalf("retry %d after the release got %d %s, want charge #1", i+1, code, resp)
		}
	}
	if n := up.count("charge_card"); n != 1 {
		t.Fatalf("charge_card ran %d times after the release and 3 retries, want exactly 1", n)
	}

	// The result: the viewer may not read it, the editor may.
	completed := waitKey(t, viewer, ns, name, "charge_card", "completed")
	if code, out, errOut := viewer.kubectl("keys", "show", name, completed.Key[:12], "--result", "-n", ns); code != 1 || !forbidden.MatchString(errOut) || strings.Contains(out, "done") {
		t.Fatalf("the viewer's show --result: exit %d\n%s%s\nwant exit 1, a refusal and no result", code, out, errOut)
	}
	if out := viewer.mustKubectl(t, "keys", "show", name, completed.Key[:12], "-n", ns); strings.Contains(out, "done") || !strings.Contains(out, "completed") {
		t.Fatalf("the viewer's show printed\n%s\nwant the key, completed, without its result", out)
	}
	if out := editor.mustKubectl(t, "keys", "show", name, completed.Key[:12], "--result", "-n", ns); !strings.Contains(out, "charge_card #1 done") {
		t.Fatalf("the editor's show --result printed\n%s\nwant the stored result", out)
	}

	// Forget: the next identical call runs.
	if code, _, errOut := viewer.kubectl("keys", "forget", name, completed.Key[:12], "-n", ns); code != 1 || !forbidden.MatchString(errOut) {
		t.Fatalf("the viewer's forget: exit %d %s, want a refusal", code, errOut)
	}
	editor.mustKubectl(t, "keys", "forget", name, completed.Key[:12], "-n", ns)
	eventNaming(t, ns, name, "KeyForgotten", editor.name, completed.Key)
	if code, resp := call(t, b.Addr, "charge_card", "order-1", args); code != 0 || !strings.Contains(resp, "charge_card #2 done") {
		t.Fatalf("the call after forget got %d %s, want it to run (charge #2)", code, resp)
	}
	if n := up.count("charge_card"); n != 2 {
		t.Fatalf("charge_card ran %d times, want 2 (once after the release, once after forget)", n)
	}
}

// TestKeysOnMemoryThroughTwoSidecars: a Memory store's records are only in
// each sidecar; the manager lists and resolves them over the policy
// stream, with two replicas holding records of their own.
func TestKeysOnMemoryThroughTwoSidecars(t *testing.T) {
	const ns, name = "keys-memory", "orders"
	installRoles(t)
	namespace(t, ns)
	viewer := newUser(t, ns, "viewer", viewerRole)
	editor := newUser(t, ns, "editor", viewerRole, editorRole)
	p := createPolicy(t, ns, name, v1alpha1.IdempotencyPolicySpec{
		Store:         v1alpha1.StoreSpec{Type: v1alpha1.StoreMemory},
		LeaseDuration: &metav1.Duration{Duration: 2 * time.Second},
		Tools:         []v1alpha1.ToolRule{{Name: "*", Mode: v1alpha1.ModeDeduplicate, OnAbandoned: v1alpha1.AbandonedError}},
	})
	up := startUpstream(t)
	a := sidecar(t, p, "orders-0", up.url, nil)
	b := sidecar(t, p, "orders-1", up.url, nil)
	envtestutil.Eventually(t, "both sidecars to hold the policy stream", func() error {
		if err := k8s.Get(context.Background(), client.ObjectKeyFromObject(p), p); err != nil {
			return err
		}
		if p.Status.Sidecars == nil || p.Status.Sidecars.Connected != 2 {
			return fmt.Errorf("status.sidecars is %+v", p.Status.Sidecars)
		}
		return nil
	})

	// One result in each replica; a ship_order in orders-1 whose outcome
	// its sidecar cannot know (the server refused to resume its stream).
	if code, resp := call(t, a.Addr, "charge_card", "a-1", `{"amount":1}`); code != 0 {
		t.Fatalf("charge through orders-0: %d %s", code, resp)
	}
	if code, resp := call(t, b.Addr, "charge_card", "b-1", `{"amount":2}`); code != 0 {
		t.Fatalf("charge through orders-1: %d %s", code, resp)
	}
	up.prime.Store(true)
	if status, resp := post(t, b.Addr, "ship_order", "ship-1", `{"order":7}`); status != http.StatusOK || !strings.Contains(resp, "prime-1") {
		t.Fatalf("the first ship_order got %d %q, want the server's priming event", status, resp)
	}
	unknown := waitKey(t, viewer, ns, name, "ship_order", "outcome-unknown")
	if code, resp := call(t, b.Addr, "ship_order", "ship-1", `{"order":7}`); code != -32012 {
		t.Fatalf("a retry of the unknown ship_order got %d %s, want -32012", code, resp)
	}

	rows := listKeys(t, viewer, ns, name)
	holders := map[string]string{}
	for _, r := range rows {
		holders[r.Tool+"@"+r.Holder] = r.State
	}
	if holders["charge_card@orders-0"] != "completed" || holders["charge_card@orders-1"] != "completed" || holders["ship_order@orders-1"] != "outcome-unknown" {
		t.Fatalf("keys list shows %+v, want a completed charge_card in each sidecar and the outcome-unknown ship_order in orders-1", rows)
	}
	if out := viewer.mustKubectl(t, "keys", "list", name, "-n", ns, "-o", "wide"); !strings.Contains(out, "HOLDER") || !strings.Contains(out, "orders-0") || !strings.Contains(out, "orders-1") {
		t.Fatalf("keys list -o wide printed\n%s\nwant the HOLDER column with both sidecars", out)
	}
	if code, _, errOut := viewer.kubectl("keys", "release", name, unknown.Key[:12], "-n", ns); code != 1 || !forbidden.MatchString(errOut) {
		t.Fatalf("the viewer's release: exit %d %s, want a refusal", code, errOut)
	}

	// Released in the sidecar that holds it: the next retry runs, once.
	out := editor.mustKubectl(t, "keys", "release", name, unknown.Key[:12], "-n", ns)
	if !strings.Contains(out, "orders-1") {
		t.Fatalf("keys release printed %q, want the sidecar that held the key", out)
	}
	eventNaming(t, ns, name, "KeyReleased", editor.name, unknown.Key)
	for i := range 2 {
		if code, resp := call(t, b.Addr, "ship_order", "ship-1", `{"order":7}`); code != 0 || !strings.Contains(resp, "ship_order #1 done") {
			t.Fatalf("retry %d after the release: %d %s, want ship_order #1", i+1, code, resp)
		}
	}
	if n := up.count("ship_order"); n != 1 {
		t.Fatalf("ship_order ran %d times, want exactly 1", n)
	}

	// Forget orders-0's result: its next identical call runs again.
	var charge0 string
	for _, r := range listKeys(t, viewer, ns, name) {
		if r.Tool == "charge_card" && r.Holder == "orders-0" {
			charge0 = r.Key
		}
	}
	editor.mustKubectl(t, "keys", "forget", name, charge0[:12], "-n", ns)
	eventNaming(t, ns, name, "KeyForgotten", editor.name, charge0)
	if code, resp := call(t, a.Addr, "charge_card", "a-1", `{"amount":1}`); code != 0 || !strings.Contains(resp, "charge_card #3 done") {
		t.Fatalf("the call after forget got %d %s, want it to run (charge #3)", code, resp)
	}
}

// TestKeysNeedATokenTheAPIServerAccepts: without a token, with one the API
// server does not accept, or with a sidecar's (audience idemcp, which may
// only read its policy), the key API answers 401 and shows nothing.
func TestKeysNeedATokenTheAPIServerAccepts(t *testing.T) {
	const ns, name = "keys-authn", "payments"
	namespace(t, ns)
	createPolicy(t, ns, name, v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreMemory}})
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "mcp-0", Labels: map[string]string{v1alpha1.LabelPolicy: name}},
		Spec:       corev1.PodSpec{ServiceAccountName: "mcp", Containers: []corev1.Container{{Name: "mcp", Image: "mcp:1"}}},
	}
	if err := k8s.Create(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	tr, err := clientset.CoreV1().ServiceAccounts(ns).CreateToken(context.Background(), "mcp", &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		Audiences: []string{policywire.TokenAudience}, ExpirationSeconds: ptr.To[int64](3600),
		BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}}
	for _, tc := range []struct{ name, auth string }{
		{"no token", ""},
		{"a token the API server does not accept", "Bearer not-a-token"},
		{"a sidecar's token (audience idemcp)", "Bearer " + tr.Status.Token},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, m := range []struct{ method, path string }{
				{http.MethodGet, keyapi.KeysPath(ns, name)},
				{http.MethodPost, keyapi.KeysPath(ns, name) + "/0123456789ab/forget"},
			} {
				req, _ := http.NewRequest(m.method, "https://"+streamAddr+m.path, nil)
				if tc.auth != "" {
					req.Header.Set("Authorization", tc.auth)
				}
				resp, err := hc.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				if resp.StatusCode != http.StatusUnauthorized || strings.Contains(string(b), "records") {
					t.Fatalf("%s %s: %d %s, want 401 and nothing listed", m.method, m.path, resp.StatusCode, b)
				}
			}
		})
	}
}

// TestKeysThroughTheAPIServer: without --manager-url the plugin reaches
// the manager through the API server's service proxy, as a user who may
// get services/proxy of the policy stream's Service; the API server
// keeps Authorization for itself, so the user's token travels in
// X-Idemcp-Authorization, and the manager still decides with RBAC.
func TestKeysThroughTheAPIServer(t *testing.T) {
	const ns, name, mgrNS = "keys-proxy", "payments", "idemcp-system"
	ctx := context.Background()
	installRoles(t)
	namespace(t, ns)
	if err := k8s.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: mgrNS}}); err != nil && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	// The Service as config/webhook makes it, its endpoint the manager
	// this test runs (envtest has no endpoints controller).
	_, portText, _ := net.SplitHostPort(streamAddr)
	var port int32
	_, _ = fmt.Sscan(portText, &port)
	mgrPod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: mgrNS, Name: "idemcp-manager-0"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "manager", Image: "idemcp:keys"}}}}
	if err := k8s.Create(ctx, mgrPod); err != nil {
		t.Fatal(err)
	}
	ip := hostIP(t)
	mgrPod.Status.PodIP, mgrPod.Status.PodIPs = ip, []corev1.PodIP{{IP: ip}}
	if err := k8s.Status().Update(ctx, mgrPod); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: mgrNS, Name: policystream.DefaultServiceName},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "policy-stream", Port: policystream.DefaultPort, TargetPort: intstr.FromInt32(port)}}}}); err != nil {
		t.Fatal(err)
	}
	if err := k8s.Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: mgrNS, Name: policystream.DefaultServiceName + "-keys", Labels: map[string]string{discoveryv1.LabelServiceName: policystream.DefaultServiceName}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints: []discoveryv1.Endpoint{{Addresses: []string{ip}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)},
			TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: mgrNS, Name: mgrPod.Name, UID: mgrPod.UID}}},
		Ports: []discoveryv1.EndpointPort{{Name: ptr.To("policy-stream"), Port: ptr.To(port), Protocol: ptr.To(corev1.ProtocolTCP)}},
	}); err != nil {
		t.Fatal(err)
	}
	viewer := newUser(t, ns, "viewer", viewerRole)
	proxy := func(u user) {
		if err := k8s.Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: mgrNS, Name: "keys-proxy-" + ns},
			Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"services/proxy"}, ResourceNames: []string{fmt.Sprintf("https:%s:%d", policystream.DefaultServiceName, policystream.DefaultPort)}, Verbs: []string{"get", "create"}}}}); err != nil && !strings.Contains(err.Error(), "already exists") {
			t.Fatal(err)
		}
		sa := strings.Split(u.name, ":")
		if err := k8s.Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: mgrNS, Name: "keys-proxy-" + ns + "-" + sa[3]},
			RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "keys-proxy-" + ns},
			Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Namespace: sa[2], Name: sa[3]}}}); err != nil {
			t.Fatal(err)
		}
	}
	proxy(viewer)
	p := createPolicy(t, ns, name, v1alpha1.IdempotencyPolicySpec{Store: v1alpha1.StoreSpec{Type: v1alpha1.StoreMemory}, DefaultMode: v1alpha1.ModeDeduplicate})
	up := startUpstream(t)
	sc := sidecar(t, p, "mcp-0", up.url, nil)
	envtestutil.Eventually(t, "the sidecar to hold the policy stream", func() error {
		if err := k8s.Get(ctx, client.ObjectKeyFromObject(p), p); err != nil {
			return err
		}
		if p.Status.Sidecars == nil || p.Status.Sidecars.Connected != 1 {
			return fmt.Errorf("status.sidecars is %+v", p.Status.Sidecars)
		}
		return nil
	})
	if code, resp := call(t, sc.Addr, "charge_card", "order-9", `{"amount":3}`); code != 0 {
		t.Fatalf("charge: %d %s", code, resp)
	}
	through := func(u user, args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		code := plugin.Main(append(args, "--kubeconfig", u.kubeconfig), &out, &errOut)
		return code, out.String(), errOut.String()
	}
	code, out, errOut := through(viewer, "keys", "list", name, "-n", ns)
	if code != 0 || !strings.Contains(out, "charge_card") || !strings.Contains(out, "completed") || !strings.Contains(out, "mcp-0") {
		t.Fatalf("keys list through the API server: exit %d\n%s%s\nwant the completed charge_card of mcp-0", code, out, errOut)
	}
	row := waitKey(t, viewer, ns, name, "charge_card", "completed")
	if code, out, errOut := through(viewer, "keys", "forget", name, row.Key[:12], "-n", ns); code != 1 || !forbidden.MatchString(errOut) {
		t.Fatalf("the viewer's forget through the API server: exit %d\n%s%s\nwant the manager's refusal", code, out, errOut)
	}
	// RBAC names the proxied Service as the URL does, scheme and port
	// included; without it the API server refuses before the manager.
	other := newUser(t, ns, "no-proxy", viewerRole)
	if code, out, errOut := through(other, "keys", "list", name, "-n", ns); code != 1 || !strings.Contains(errOut, "Forbidden") && !strings.Contains(errOut, "forbidden") {
		t.Fatalf("keys list without services/proxy: exit %d\n%s%s\nwant the API server's refusal", code, out, errOut)
	}
}

// hostIP is an IPv4 address of this machine other than loopback, which
// the API server proxies to.
func hostIP(t *testing.T) string {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() && !n.IP.IsLinkLocalUnicast() {
			return n.IP.String()
		}
	}
	testdeps.Missing(t, "no IPv4 address other than loopback: the API server proxies to none else")
	return ""
}
