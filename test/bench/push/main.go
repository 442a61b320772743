// Command push measures the policy push: how long a policy change takes to
// be applied by 100 and 1000 sidecars, and what the manager costs while it
// holds their streams. The API server and etcd are envtest's; the manager
// is the real `idemcp manager` binary in a process of its own (so its CPU
// and memory are its alone); the sidecars are in-process policy sync
// clients with real engines, each with its own TLS connection and a token
// bound to a pod of its own.
//
//	go run ./test/bench/push -out test/bench/results.md   (make bench)
//
// It replaces the "Policy push" section of the results file, or appends it.
package main

import (
	"bytes"
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/internal/engine"
	"github.com/idemcp/idemcp/internal/freeport"
	"github.com/idemcp/idemcp/internal/policy"
	"github.com/idemcp/idemcp/internal/policywire"
	"github.com/idemcp/idemcp/sidecar/policysync"
	"github.com/idemcp/idemcp/test/poll"
)

const (
	beginMark = "<!-- policy-push:begin -->"
	endMark   = "<!-- policy-push:end -->"
)

func main() {
	out := flag.String("out", "", "results file whose Policy push section to write (default: stdout only)")
	sizes := flag.String("sidecars", "100,1000,10000", "sidecar counts to measure")
	rounds := flag.Int("rounds", 5, "policy changes per size")
	flag.StringVar(&profileDir, "profile", "", "directory for CPU profiles of the manager (idle and during the changes) and of the bench process, per size")
	flag.StringVar(&memLimitFlag, "manager-memory-limit", "", "run the manager in a memory cgroup of this size (a quantity, such as 256Mi, the chart's default limit), as in a container with a memory limit (needs root)")
	flag.Parse()
	if err := run(*out, *sizes, *rounds); err != nil {
		fmt.Fprintln(os.Stderr, "bench push:", err)
		os.Exit(1)
	}
}

var profileDir, pprofAddr, memLimitFlag string

// memLimit is the manager's memory cgroup, nil without -manager-memory-limit.
var memLimit *memCgroup

type result struct {
	n                  int
	p50, p99, max      time.Duration
	changeP99          []time.Duration // per change
	connect            time.Duration
	cpuIdle, cpuChange float64 // cores
	rssMiB             float64
	updateMax          time.Duration // the slowest Update call of the API server
	reconnects         uint64        // streams opened again during the changes
	// perStreamKiB: the manager's VmRSS with every stream open over its
	// VmRSS before the first connected (pods, tokens and policy already
	// there), per stream.
	perStreamKiB float64
	// failover: from SIGTERM to the manager until every sidecar had opened
	// a new stream to its successor (0 when not measured).
	failover time.Duration
	nofile   uint64 // the bench process's open-file soft limit
}

func run(out, sizes string, rounds int) error {
	fmt.Fprintf(os.Stderr, "bench push: load average (1, 5, 15 min) at the start: %s\n", loadAverages())
	defer func() {
		fmt.Fprintf(os.Stderr, "bench push: load average (1, 5, 15 min) at the end: %s\n", loadAverages())
	}()
	// Every sidecar costs a socket here and one in the manager, which
	// inherits this process's limits: raise the soft limit to the hard one.
	nofile, err := raiseNofile()
	if err != nil {
		return err
	}
	most := 0
	for _, s := range strings.Split(sizes, ",") {
		n, _ := strconv.Atoi(strings.TrimSpace(s))
		most = max(most, n)
	}
	if need := uint64(most) + 1024; nofile < need {
		return fmt.Errorf("%d sidecars need about %d open files, and the hard limit is %d (ulimit -Hn): raise it or measure fewer", most, need, nofile)
	}
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		assets, err := exec.Command("hack/setup-envtest.sh").Output()
		if err != nil {
			return fmt.Errorf("finding envtest (run from the repository root): %w", err)
		}
		_ = os.Setenv("KUBEBUILDER_ASSETS", strings.TrimSpace(string(assets)))
	}
	env := &envtest.Environment{CRDDirectoryPaths: []string{filepath.Join("config", "crd", "bases")}, ErrorIfCRDPathMissing: true, ControlPlaneStartTimeout: 2 * time.Minute}
	ctrl.SetLogger(logr.Discard())
	cfg, err := env.Start()
	if err != nil {
		return fmt.Errorf("starting envtest: %w", err)
	}
	defer func() { _ = env.Stop() }()
	cfg.QPS, cfg.Burst = -1, 0

	tmp, err := os.MkdirTemp("", "idemcp-bench-push-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	bin := filepath.Join(tmp, "idemcp")
	if b, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		return fmt.Errorf("building idemcp: %w\n%s", err, b)
	}
	if memLimitFlag != "" {
		q, err := resource.ParseQuantity(memLimitFlag)
		if err != nil || q.Value() <= 0 {
			return fmt.Errorf("-manager-memory-limit: %q is not a quantity more than 0, such as 256Mi", memLimitFlag)
		}
		if memLimit, err = newMemCgroup(q.Value()); err != nil {
			return err
		}
		defer memLimit.remove()
	}
	wh := env.WebhookInstallOptions
	if err := os.WriteFile(filepath.Join(wh.LocalServingCertDir, "ca.crt"), wh.LocalServingCAData, 0o600); err != nil {
		return err
	}
	kubeconfig := filepath.Join(tmp, "kubeconfig")
	if err := writeKubeconfig(cfg, kubeconfig); err != nil {
		return err
	}
	streamAddr := freeAddr()
	if profileDir != "" {
		if err := os.MkdirAll(profileDir, 0o755); err != nil {
			return err
		}
		pprofAddr = freeAddr()
	}
	args := []string{"manager", "--pprof-bind-address=" + cmp.Or(pprofAddr, "0"), "--leader-elect", "--leader-election-namespace=default",
		// The bench shares 2 cores with the API server and 1000 clients:
		// generous lease timings keep a slow renewal from ending the run.
		"--leader-elect-lease-duration=120s", "--leader-elect-renew-deadline=90s", "--leader-elect-retry-period=5s",
		"--metrics-bind-address=0", "--health-probe-bind-address=0", "--webhook-cert-management=",
		"--webhook-port=" + portOf(freeAddr()), "--webhook-cert-dir=" + wh.LocalServingCertDir,
		"--policy-stream-bind-address=" + streamAddr, "--sidecar-image=idemcp:bench", "--namespace=idemcp-system", "--zap-log-level=error"}
	mgr := &managerProc{bin: bin, args: args, env: append(os.Environ(), "KUBECONFIG="+kubeconfig)}
	if err := mgr.start(); err != nil {
		return err
	}
	defer mgr.kill()

	c, err := client.New(cfg, client.Options{Scheme: manager.NewScheme()})
	if err != nil {
		return err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	var results []result
	for _, s := range strings.Split(sizes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			return fmt.Errorf("-sidecars: %q", s)
		}
		r, err := measure(c, cs, wh.LocalServingCAData, "https://"+streamAddr, mgr, n, rounds)
		if err != nil {
			return fmt.Errorf("%d sidecars: %w", n, err)
		}
		results = append(results, r)
		fmt.Fprintf(os.Stderr, "%d sidecars: p50 %s p99 %s max %s, slowest Update %s, %d reconnects during the changes, manager %.1f KiB per stream, all reconnected %s after a failover\n",
			n, r.p50, r.p99, r.max, r.updateMax, r.reconnects, r.perStreamKiB, r.failover)
		if memLimit != nil {
			fmt.Fprintf(os.Stderr, "%d sidecars: %s\n", n, memLimit.summary())
		}
		if out != "" {
			if err := writeSection(out, render(results, rounds)); err != nil {
				return err
			}
		}
	}
	fmt.Print(render(results, rounds))
	return nil
}

func measure(c client.Client, cs *kubernetes.Clientset, ca []byte, endpoint string, mgr *managerProc, n, rounds int) (result, error) {
	ctx := context.Background()
	pid := mgr.pid()
	ns, name := fmt.Sprintf("bench-push-%d", n), "payments"
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		return result{}, err
	}
	if err := c.Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "mcp"}}); err != nil {
		return result{}, err
	}
	spec := v1alpha1.IdempotencyPolicySpec{}
	if err := c.Create(ctx, &v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Spec: spec}); err != nil {
		return result{}, err
	}
	start, _ := policy.Compile(spec)
	start.Namespace, start.Name = ns, name

	tokens := make([]string, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	sem := make(chan struct{}, 16)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			pod := &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: fmt.Sprintf("mcp-%d", i), Labels: map[string]string{v1alpha1.LabelPolicy: name}},
				Spec:       corev1.PodSpec{ServiceAccountName: "mcp", Containers: []corev1.Container{{Name: "mcp", Image: "mcp:1"}}},
			}
			if err := c.Create(ctx, pod); err != nil {
				errs <- err
				return
			}
			tr, err := cs.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "mcp", &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
				Audiences: []string{policywire.TokenAudience}, ExpirationSeconds: ptr.To[int64](3600),
				BoundObjectRef: &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
			}}, metav1.CreateOptions{})
			if err != nil {
				errs <- err
				return
			}
			tokens[i] = tr.Status.Token
		}()
	}
	wg.Wait()
	select {
	case err := <-errs:
		return result{}, err
	default:
	}

	// The pods and tokens exist; let the manager's cache take them in
	// before its memory without streams is read.
	time.Sleep(3 * time.Second)
	rssBefore := rssMiB(pid)
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	engines := make([]*engine.Engine, n)
	clients := make([]*policysync.Client, n)
	connectStart := time.Now()
	for i := range n {
		engines[i] = engine.New(engine.Options{Policy: start})
		pc, err := policysync.New(policysync.Options{Endpoint: endpoint, Namespace: ns, Name: name,
			Token: func() (string, error) { return tokens[i], nil }, CABundle: ca, Engine: engines[i],
			StoreIdentity: policywire.StoreIdentity(start.Spec.Store)})
		if err != nil {
			return result{}, err
		}
		clients[i] = pc
		go func() { _ = pc.Run(sctx) }()
	}
	if err := waitUntil(2*time.Minute, func() bool {
		for _, pc := range clients {
			if !pc.Connected() {
				return false
			}
		}
		return true
	}); err != nil {
		return result{}, fmt.Errorf("not every sidecar connected: %w", err)
	}
	r := result{n: n, connect: time.Since(connectStart), nofile: nofileLimit()}
	time.Sleep(2 * time.Second) // let the connect storm's status writes settle
	r.perStreamKiB = (rssMiB(pid) - rssBefore) * 1024 / float64(n)

	cpu0, at0 := cpuSeconds(pid), time.Now()
	idleProfile := profile(fmt.Sprintf("manager-idle-%d.pprof", n), 5*time.Second)
	time.Sleep(5 * time.Second)
	r.cpuIdle = (cpuSeconds(pid) - cpu0) / time.Since(at0).Seconds()
	idleProfile()
	sessions := make([]uint64, n)
	for i, pc := range clients {
		sessions[i] = pc.Sessions()
	}
	stopSelf := profileSelf(fmt.Sprintf("bench-changes-%d.pprof", n))
	changeProfile := profile(fmt.Sprintf("manager-changes-%d.pprof", n), time.Duration(rounds)*2*time.Second)

	var lat []time.Duration
	modes := []v1alpha1.ToolMode{v1alpha1.ModeDeduplicate, v1alpha1.ModePassthrough}
	cpu1, at1 := cpuSeconds(pid), time.Now()
	for round := range rounds {
		// Drain what earlier snapshots left on the channels.
		for _, pc := range clients {
			select {
			case <-pc.Applied():
			default:
			}
		}
		var hash string
		changed := time.Now()
		var updated time.Duration
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			var p v1alpha1.IdempotencyPolicy
			if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &p); err != nil {
				return err
			}
			p.Spec.DefaultMode = modes[round%2]
			compiled, err := policy.Compile(p.Spec)
			if err != nil {
				return err
			}
			hash = compiled.Hash
			at := time.Now()
			defer func() { updated = time.Since(at) }()
			return c.Update(ctx, &p)
		})
		r.updateMax = max(r.updateMax, updated)
		if err != nil {
			return r, err
		}
		got := make([]time.Duration, n)
		var wg sync.WaitGroup
		for i, pc := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				deadline := time.After(30 * time.Second)
				for {
					select {
					case h := <-pc.Applied():
						if h == hash {
							got[i] = time.Since(changed)
							return
						}
					case <-deadline:
						got[i] = 30 * time.Second
						return
					}
				}
			}()
		}
		wg.Wait()
		round := slices.Clone(got)
		slices.Sort(round)
		fmt.Fprintf(os.Stderr, "  change: Update took %s; applied p50 %s, max %s\n", updated, round[len(round)/2], round[len(round)-1])
		r.changeP99 = append(r.changeP99, round[len(round)*99/100])
		lat = append(lat, got...)
		time.Sleep(500 * time.Millisecond)
	}
	r.cpuChange = (cpuSeconds(pid) - cpu1) / time.Since(at1).Seconds()
	r.rssMiB = rssMiB(pid)
	stopSelf()
	changeProfile()
	for i, pc := range clients {
		r.reconnects += pc.Sessions() - sessions[i]
	}
	slices.Sort(lat)
	r.p50, r.p99, r.max = lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1]

	// Failover: the manager is stopped as a rolling update stops it
	// (SIGTERM: it hands the lease on) and a successor starts on the same
	// address; every sidecar must open a stream to it.
	for i, pc := range clients {
		sessions[i] = pc.Sessions()
	}
	t0 := time.Now()
	if err := mgr.restart(); err != nil {
		return r, fmt.Errorf("failover: %w", err)
	}
	if err := waitUntil(5*time.Minute, func() bool {
		for i, pc := range clients {
			if !pc.Connected() || pc.Sessions() == sessions[i] {
				return false
			}
		}
		return true
	}); err != nil {
		return r, fmt.Errorf("not every sidecar reconnected after the failover: %w", err)
	}
	r.failover = time.Since(t0)
	stop()
	return r, nil
}

// managerProc is the idemcp manager process, started again for a
// failover.
type managerProc struct {
	bin  string
	args []string
	env  []string
	cmd  *exec.Cmd
}

func (m *managerProc) start() error {
	if memLimit != nil {
		m.cmd = memLimit.command(m.bin, m.args...)
	} else {
		m.cmd = exec.Command(m.bin, m.args...)
	}
	m.cmd.Env = m.env
	m.cmd.Stderr = os.Stderr
	return m.cmd.Start()
}

func (m *managerProc) pid() int { return m.cmd.Process.Pid }

func (m *managerProc) kill() { _ = m.cmd.Process.Kill(); _ = m.cmd.Wait() }

// restart stops the manager with SIGTERM, waits for it to exit (it
// releases its lease on the way) and starts its successor.
func (m *managerProc) restart() error {
	_ = m.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = m.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		_ = m.cmd.Process.Kill()
		<-done
	}
	return m.start()
}

// raiseNofile raises this process's open-file soft limit to its hard
// limit and returns the new soft limit.
func raiseNofile() (uint64, error) {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		return 0, fmt.Errorf("reading the open-file limit: %w", err)
	}
	if l.Cur < l.Max {
		l.Cur = l.Max
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
			return 0, fmt.Errorf("raising the open-file soft limit to %d: %w", l.Max, err)
		}
	}
	return l.Cur, nil
}

func nofileLimit() uint64 {
	var l syscall.Rlimit
	_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l)
	return l.Cur
}

// profile starts a CPU profile of the manager over d; the returned func
// waits for it and writes it to the profile directory. A no-op without
// -profile.
func profile(name string, d time.Duration) func() {
	if profileDir == "" {
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", pprofAddr, int(d.Seconds())))
		if err != nil {
			fmt.Fprintln(os.Stderr, "profiling the manager:", err)
			return
		}
		defer func() { _ = resp.Body.Close() }()
		b, _ := io.ReadAll(resp.Body)
		_ = os.WriteFile(filepath.Join(profileDir, name), b, 0o644)
	}()
	return func() { <-done }
}

// profileSelf profiles the bench process (its sidecar clients) until the
// returned func is called.
func profileSelf(name string) func() {
	if profileDir == "" {
		return func() {}
	}
	f, err := os.Create(filepath.Join(profileDir, name))
	if err != nil {
		return func() {}
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return func() {}
	}
	return func() { pprof.StopCPUProfile(); _ = f.Close() }
}

func waitUntil(d time.Duration, cond func() bool) error {
	if err := poll.Until(context.Background(), d, poll.True(cond)); err != nil {
		return fmt.Errorf("timed out after %s", d)
	}
	return nil
}

// cpuSeconds is the user and system time of a process, from /proc.
func cpuSeconds(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	fields := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+2:]))
	utime, _ := strconv.ParseFloat(fields[11], 64)
	stime, _ := strconv.ParseFloat(fields[12], 64)
	return (utime + stime) / 100 // USER_HZ
}

func rssMiB(pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}

// loadAverages is the machine's 1, 5 and 15-minute load averages.
func loadAverages() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	return strings.Join(strings.Fields(string(b))[:3], ", ")
}

// loadAverage is the machine's 1-minute load average, from /proc.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	return strings.Fields(string(b))[0]
}

func freeAddr() string {
	a, err := freeport.Addr("127.0.0.1")
	if err != nil {
		panic(err)
	}
	return a
}

func portOf(addr string) string {
	_, p, _ := net.SplitHostPort(addr)
	return p
}

func writeKubeconfig(cfg *rest.Config, path string) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["envtest"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos["admin"] = &clientcmdapi.AuthInfo{ClientCertificateData: cfg.CertData, ClientKeyData: cfg.KeyData, Token: cfg.BearerToken}
	kc.Contexts["envtest"] = &clientcmdapi.Context{Cluster: "envtest", AuthInfo: "admin"}
	kc.CurrentContext = "envtest"
	return clientcmd.WriteToFile(*kc, path)
}

func render(results []result, rounds int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n## Policy push\n\n", beginMark)
	fmt.Fprintf(&b, "Generated by `go run ./test/bench/push -out test/bench/results.md` (part of `make bench`) on %s, %s, %d cores.\n\n",
		time.Now().UTC().Format("2006-01-02 15:04 MST"), runtime.Version(), runtime.NumCPU())
	b.WriteString("The real `idemcp manager` binary in its own process against envtest's API server and etcd; N in-process\n" +
		"sidecar clients (real engines, one TLS connection and one pod-bound token each) in the bench process.\n" +
		fmt.Sprintf("Latency: from the `kubectl apply` (Update) of a changed policy to each sidecar's atomic swap, %d changes per size,\n", rounds) +
		"over every sidecar of every change. CPU and memory are the manager process's (user+system time, VmRSS), idle\n" +
		"while holding the streams, and during the changes (which include writing the status, batched).\n" +
		"Everything shares the machine's cores, so the figures are an upper bound" + fmt.Sprintf(" (load average %s when this run ended).\n", loadAverage()) +
		"Reconnects counts streams opened again during the changes: 0 means every sidecar kept the stream it opened.\n\n")
	b.WriteString("Manager per stream: its VmRSS with every stream open less its VmRSS just before the first one connected (the pods,\n" +
		"their tokens and the policy already in its cache), over the number of streams. Failover: the manager gets SIGTERM (as in a\n" +
		"rolling update: it hands its lease on) and a successor starts on the same address, its start and cache sync included;\n" +
		"the time runs until every sidecar has a stream to the successor. A sidecar brings the review ticket its stream to the\n" +
		"first manager came with, so the successor needs no TokenReview for its token (the review cache is per process).\n\n")
	if memLimit != nil {
		fmt.Fprintf(&b, "The manager ran in a memory cgroup (-manager-memory-limit), as in a container with a memory limit: %s.\n\n", memLimit.summary())
	}
	b.WriteString("| sidecars | p50 | p99 | max | all connected after | reconnects | manager CPU idle | manager CPU during changes | manager RSS | manager KiB per stream | reconnected after failover |\n")
	b.WriteString("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	for _, r := range results {
		fmt.Fprintf(&b, "| %d | %s | %s | %s | %s | %d | %.3f cores | %.3f cores | %.0f MiB | %.1f | %s |\n", r.n,
			r.p50.Round(100*time.Microsecond), r.p99.Round(100*time.Microsecond), r.max.Round(100*time.Microsecond),
			r.connect.Round(10*time.Millisecond), r.reconnects, r.cpuIdle, r.cpuChange, r.rssMiB, r.perStreamKiB, r.failover.Round(10*time.Millisecond))
	}
	b.WriteString(goalTable(results))
	fmt.Fprintf(&b, "\n%s\n", endMark)
	return b.String()
}

// goalSidecars is the size the push goals are stated for.
const goalSidecars = 10000

// goalTable judges the largest size measured against the push goals; a
// size below goalSidecars is reported, not judged.
func goalTable(results []result) string {
	if len(results) == 0 {
		return ""
	}
	r := slices.MaxFunc(results, func(a, b result) int { return cmp.Compare(a.n, b.n) })
	verdict := func(ok bool, spread []float64) string {
		switch {
		case r.n < goalSidecars:
			return fmt.Sprintf("**not measured at %d** (largest size %d)", goalSidecars, r.n)
		case len(spread) > 1 && (slices.Max(spread) > 1.15*median(spread) || slices.Min(spread) < 0.85*median(spread)):
			return "**noisy**"
		case ok:
			return "met"
		default:
			return "**not met**"
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n### Goals (policy push, %d sidecars)\n\n", r.n)
	b.WriteString("A figure with a range over the changes is **noisy** when the range reaches further than ±15% from its median.\n\n")
	b.WriteString("| goal | figure | measured | verdict |\n| --- | --- | ---: | --- |\n")
	p99s := make([]float64, len(r.changeP99))
	for i, d := range r.changeP99 {
		p99s[i] = d.Seconds()
	}
	rangeOf := func(xs []float64) string {
		if len(xs) == 0 {
			return ""
		}
		return fmt.Sprintf(" (per change %.0f-%.0f ms)", 1000*slices.Min(xs), 1000*slices.Max(xs))
	}
	fmt.Fprintf(&b, "| p99 < 1 s from `kubectl apply` to each sidecar's swap | p99 over every sidecar of every change | %s%s | %s |\n",
		r.p99.Round(100*time.Microsecond), rangeOf(p99s), verdict(r.p99 < time.Second, p99s))
	fmt.Fprintf(&b, "| manager ≤ 40 KiB per connected stream | VmRSS with the streams open less before, per stream | %.1f KiB | %s |\n",
		r.perStreamKiB, verdict(r.perStreamKiB <= 40, nil))
	fmt.Fprintf(&b, "| all reconnected within 60 s after a manager failover | SIGTERM to the last sidecar's new stream | %s | %s |\n",
		r.failover.Round(10*time.Millisecond), verdict(r.failover > 0 && r.failover <= time.Minute, nil))
	return b.String()
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func writeSection(path, section string) error {
	old, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	s := string(old)
	if i, j := strings.Index(s, beginMark), strings.Index(s, endMark); i >= 0 && j > i {
		s = s[:i] + section + strings.TrimPrefix(s[j+len(endMark):], "\n")
	} else {
		if s != "" && !strings.HasSuffix(s, "\n\n") {
			s += "\n"
		}
		s += section
	}
	return os.WriteFile(path, []byte(s), 0o644)
}
