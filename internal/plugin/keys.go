package plugin

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/util/duration"
	"k8s.io/client-go/rest"

	"github.com/idemcp/idemcp/controllers/keyapi"
	"github.com/idemcp/idemcp/controllers/policystream"
)

type keysFlags struct {
	state, tool string
	since       time.Duration
	result      bool
}

func newKeysCommand(g *globalFlags, newEnv envFunc) *cobra.Command {
	kf := &keysFlags{}
	cmd := &cobra.Command{
		Use:   "keys (list POLICY | show POLICY KEY | release POLICY KEY | forget POLICY KEY)",
		Short: "List a policy's stored keys, release an outcome-unknown claim, forget a stored result",
		Long: `keys inspects and resolves what a policy's store holds, through the idemcp
manager: it reads Redis itself (it holds the credentials and the seal
keys), and a Memory store's records from each sidecar over the policy
stream. KEY is the key hash that list shows (any unique prefix of at least
6 hex digits). Arguments are never stored, so never shown; a result only
with show --result.

Kubernetes RBAC decides, checked by the manager with a SubjectAccessReview
for you: list and show need get/list on idempotencypolicies/keys (the view
role), release and forget need delete on idempotencypolicies/keys, and
show --result needs get on idempotencypolicies/results (the edit role).
Every release and forget leaves an Event on the policy naming you.

The manager is reached through the API server (get on the Service's
services/proxy in its namespace), or with --manager-url directly, such as
through kubectl -n idemcp-system port-forward svc/idemcp-policy-stream 9444
(its certificate is checked against the webhook's CA, or --manager-ca).
Either way it needs a bearer token from your kubeconfig (a token, OIDC or
an exec plugin; not a client certificate).`,
		Example: `  kubectl idemcp keys list payments -n shop --state outcome-unknown
  kubectl idemcp keys show payments 3f9a1c2b7d0e -n shop
  kubectl idemcp keys release payments 3f9a1c2b7d0e -n shop
  kubectl idemcp keys forget payments 3f9a1c2b7d0e -n shop`,
	}
	run := func(nargs int, usage string, body func(ctx context.Context, e *Env, k *keyClient, args []string) error) func(*cobra.Command, []string) error {
		return func(cmd *cobra.Command, args []string) error {
			if len(args) != nargs {
				return &ExitError{Code: 2, Err: fmt.Errorf("%s (kubectl get idpol lists the policies, kubectl idemcp keys list POLICY the keys)", usage)}
			}
			e, err := newEnv(cmd)
			if err != nil {
				return err
			}
			k, err := newKeyClient(cmd.Context(), e, g.managerURL, g.managerCA)
			if err != nil {
				return err
			}
			return body(cmd.Context(), e, k, args)
		}
	}
	list := &cobra.Command{
		Use:   "list POLICY [--state pending|outcome-unknown|completed] [--tool NAME] [--since DURATION] [-o json|yaml|wide]",
		Short: "List the keys a policy's store holds: tool, state, age, expiry, pod and key hash",
		Long: `list shows every key a policy's store holds, newest first: its hash, the tool,
its state (pending: the call runs; outcome-unknown: its sidecar died
mid-call, and onAbandoned Error answers every retry -32012 until it is
released; completed: its result is replayed), its age, when it expires and
the pod whose sidecar claimed it. -o wide adds the full hash, the lease's
end and, for a Memory store, the sidecar that holds it.`,
		Example: `  kubectl idemcp keys list payments -n shop
  kubectl idemcp keys list payments -n shop --state outcome-unknown --tool charge_card --since 1h`,
		PreRunE: func(*cobra.Command, []string) error {
			switch kf.state {
			case "", "pending", "outcome-unknown", "completed":
			default:
				return &ExitError{Code: 2, Err: fmt.Errorf("--state %q is not one of pending, outcome-unknown, completed", kf.state)}
			}
			return checkOutput(g.output, "", "json", "yaml", "wide")
		},
		RunE: run(1, "list takes one POLICY", func(ctx context.Context, e *Env, k *keyClient, args []string) error {
			var l keyapi.List
			if err := k.do(ctx, http.MethodGet, keyapi.KeysPath(e.Namespace, args[0]), &l); err != nil {
				return err
			}
			l.Records = filterRecords(l.Records, kf, e.Now())
			for _, n := range l.Notes {
				_, _ = fmt.Fprintf(e.ErrOut, "note: %s\n", n)
			}
			if g.output == "json" || g.output == "yaml" {
				return printStructured(e.Out, g.output, l)
			}
			printKeys(e.Out, l.Records, e.Now(), g.output == "wide")
			return nil
		}),
	}
	list.Flags().StringVar(&kf.state, "state", "", "only keys in this state: pending, outcome-unknown or completed")
	list.Flags().StringVar(&kf.tool, "tool", "", "only keys of this tool")
	list.Flags().DurationVar(&kf.since, "since", 0, "only keys claimed within this long, such as 30m or 2h")
	addOutput(list.Flags(), g, "json|yaml|wide")

	show := &cobra.Command{
		Use:   "show POLICY KEY [--result] [-o json|yaml]",
		Short: "Show one key; with --result, its stored result too",
		Long: `show prints one key as list does. --result prints the stored JSON-RPC
response too, which needs get on idempotencypolicies/results (the edit
role): a result may hold what only its caller should read.`,
		Example: `  kubectl idemcp keys show payments 3f9a1c2b7d0e -n shop
  kubectl idemcp keys show payments 3f9a1c2b7d0e -n shop --result -o json`,
		PreRunE: func(*cobra.Command, []string) error { return checkOutput(g.output, "", "json", "yaml") },
		RunE: run(2, "show takes a POLICY and a KEY", func(ctx context.Context, e *Env, k *keyClient, args []string) error {
			path := keyapi.KeysPath(e.Namespace, args[0]) + "/" + url.PathEscape(args[1])
			if kf.result {
				var r keyapi.Result
				if err := k.do(ctx, http.MethodGet, path+"/result", &r); err != nil {
					return err
				}
				if g.output != "" {
					return printStructured(e.Out, g.output, r)
				}
				printKeys(e.Out, []keyapi.Record{r.Record}, e.Now(), true)
				_, _ = fmt.Fprintf(e.Out, "\nResult:\n%s\n", r.Response)
				return nil
			}
			var r keyapi.Record
			if err := k.do(ctx, http.MethodGet, path, &r); err != nil {
				return err
			}
			if g.output != "" {
				return printStructured(e.Out, g.output, r)
			}
			printKeys(e.Out, []keyapi.Record{r}, e.Now(), true)
			return nil
		}),
	}
	show.Flags().BoolVar(&kf.result, "result", false, "print the stored result too (needs get on idempotencypolicies/results)")
	addOutput(show.Flags(), g, "json|yaml")

	change := func(op, short, long, what string) *cobra.Command {
		c := &cobra.Command{
			Use:     op + " POLICY KEY [-o json|yaml]",
			Short:   short,
			Long:    long,
			Example: fmt.Sprintf("  kubectl idemcp keys %s payments 3f9a1c2b7d0e -n shop", op),
			PreRunE: func(*cobra.Command, []string) error { return checkOutput(g.output, "", "json", "yaml") },
			RunE: run(2, op+" takes a POLICY and a KEY", func(ctx context.Context, e *Env, k *keyClient, args []string) error {
				var ch keyapi.Change
				path := keyapi.KeysPath(e.Namespace, args[0]) + "/" + url.PathEscape(args[1]) + "/" + op
				if err := k.do(ctx, http.MethodPost, path, &ch); err != nil {
					return err
				}
				for _, n := range ch.Notes {
					_, _ = fmt.Fprintf(e.ErrOut, "note: %s\n", n)
				}
				if g.output != "" {
					return printStructured(e.Out, g.output, ch)
				}
				for _, r := range ch.Records {
					where := ""
					if r.Holder != "" {
						where = " in the sidecar of " + r.Holder
					}
					_, _ = fmt.Fprintf(e.Out, "key %s (tool %s, %s)%s %s: %s\n", keyapi.Short(r.Key), orDash(r.Tool), r.State, where, pastTense(op), what)
				}
				return nil
			}),
		}
		addOutput(c.Flags(), g, "json|yaml")
		return c
	}
	cmd.AddCommand(list, show,
		change("release", "Release a pending or outcome-unknown claim: the next retry runs the tool",
			`release drops a claim whose lease ran out (outcome-unknown: its sidecar died
mid-call), after you checked that the call did not take effect: the next
retry with its key runs the tool. A claim under a live lease (its call
still runs) is refused, since a retry would run the tool a second time.
A completed result is refused too: forget it instead.`, "the next retry runs the tool"),
		change("forget", "Forget a stored result: the next identical call runs the tool",
			`forget drops a completed result, for a replay that is disputed or wrong: the
next identical call runs the tool instead of getting it. A claim is
refused: release it instead.`, "the next identical call runs the tool"))
	return cmd
}

func pastTense(op string) string {
	if op == "forget" {
		return "forgotten"
	}
	return op + "d"
}

func filterRecords(recs []keyapi.Record, kf *keysFlags, now time.Time) []keyapi.Record {
	out := []keyapi.Record{}
	for _, r := range recs {
		if kf.state != "" && r.State != kf.state || kf.tool != "" && r.Tool != kf.tool ||
			kf.since > 0 && !r.Claimed.IsZero() && now.Sub(r.Claimed) > kf.since {
			continue
		}
		out = append(out, r)
	}
	return out
}

func printKeys(w io.Writer, recs []keyapi.Record, now time.Time, wide bool) {
	if len(recs) == 0 {
		_, _ = fmt.Fprintln(w, "No keys stored.")
		return
	}
	tw := newTable(w, wide, "KEY\tTOOL\tSTATE\tAGE\tEXPIRES\tPOD", "\tHOLDER\tLEASE-ENDS\tFULL-KEY")
	for _, r := range recs {
		line := fmt.Sprintf("%s\t%s\t%s\t%s\t%s\t%s", keyapi.Short(r.Key), orDash(r.Tool), r.State, age(now, r.Claimed), until(now, r.Expires), orDash(r.Pod))
		if wide {
			lease := "-"
			if !r.LeaseUntil.IsZero() {
				lease = r.LeaseUntil.UTC().Format(time.RFC3339)
			}
			line += fmt.Sprintf("\t%s\t%s\t%s", orDash(r.Holder), lease, r.Key)
		}
		_, _ = fmt.Fprintln(tw, line)
	}
	_ = tw.Flush()
}

func age(now, t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return duration.HumanDuration(now.Sub(t))
}

func until(now, t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return "in " + duration.HumanDuration(t.Sub(now))
}

// keyClient reaches the manager's key API with the user's bearer token.
type keyClient struct {
	base  string
	http  *http.Client
	token string
	// header is where the token goes: Authorization directly, TokenHeader
	// through the API server (which keeps Authorization for itself).
	header string
}

func newKeyClient(ctx context.Context, e *Env, managerURL, managerCA string) (*keyClient, error) {
	token, err := bearerToken(e.Config)
	if err != nil {
		return nil, err
	}
	if managerURL != "" {
		// The manager serves with the webhook's certificate: its CA is the
		// webhook's caBundle, or the file --manager-ca names.
		pool := x509.NewCertPool()
		var ca []byte
		if managerCA != "" {
			if ca, err = os.ReadFile(managerCA); err != nil {
				return nil, fmt.Errorf("--manager-ca: %w", err)
			}
		} else if in := FindInstall(ctx, e); in.Webhook != nil {
			ca = in.Webhook.ClientConfig.CABundle
		}
		if !pool.AppendCertsFromPEM(ca) {
			if managerCA != "" {
				return nil, fmt.Errorf("--manager-ca %s holds no PEM certificate", managerCA)
			}
			return nil, fmt.Errorf("--manager-url: the manager's CA is the caBundle of the %s webhook, which could not be read (list of mutatingwebhookconfigurations): pass it with --manager-ca FILE", WebhookName)
		}
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
		return &keyClient{base: strings.TrimRight(managerURL, "/"), http: &http.Client{Transport: tr, Timeout: 30 * time.Second}, token: token, header: "Authorization"}, nil
	}
	rt, err := rest.TransportFor(e.Config)
	if err != nil {
		return nil, fmt.Errorf("connecting to the cluster: %w", err)
	}
	in := FindInstall(ctx, e)
	svc := policystream.DefaultServiceName
	if in.Options.PolicyStreamService != "" {
		svc = in.Options.PolicyStreamService
	}
	base := strings.TrimRight(e.Config.Host, "/") + e.Config.APIPath
	if e.Config.APIPath == "" {
		base = strings.TrimRight(e.Config.Host, "/")
	}
	base += fmt.Sprintf("/api/v1/namespaces/%s/services/https:%s:%d/proxy", in.Options.Namespace, svc, policystream.DefaultPort)
	return &keyClient{base: base, http: &http.Client{Transport: rt, Timeout: 30 * time.Second}, token: token, header: keyapi.TokenHeader}, nil
}

// bearerToken is the token the kubeconfig's user sends (a static token,
// a token file, OIDC or an exec plugin), read by running a request
// through the same wrappers client-go uses, without sending it.
func bearerToken(cfg *rest.Config) (string, error) {
	if cfg.Impersonate.UserName != "" || len(cfg.Impersonate.Groups) > 0 || cfg.Impersonate.UID != "" {
		// The manager reviews the token itself: it would decide for the
		// token's own user, not for the one impersonated.
		return "", &ExitError{Code: 2, Err: errors.New("keys does not take --as, --as-group or --as-uid (nor a kubeconfig that impersonates): the manager authorizes the user whose token it gets; use that user's own kubeconfig")}
	}
	var got string
	rt, err := rest.HTTPWrappersForConfig(cfg, roundTripper(func(r *http.Request) (*http.Response, error) {
		got = r.Header.Get("Authorization")
		return &http.Response{StatusCode: http.StatusOK, Body: http.NoBody, Request: r, Header: http.Header{}}, nil
	}))
	if err != nil {
		return "", fmt.Errorf("reading the kubeconfig's credentials: %w", err)
	}
	req, err := http.NewRequest(http.MethodGet, "https://kubectl-idemcp.invalid/", nil)
	if err != nil {
		return "", err
	}
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return "", fmt.Errorf("reading the kubeconfig's credentials: %w", err)
	}
	_ = resp.Body.Close()
	token, ok := strings.CutPrefix(got, "Bearer ")
	if !ok || token == "" {
		return "", errors.New("keys needs a bearer token, which the manager checks with the API server (TokenReview); the kubeconfig's user has none (a client certificate, or basic auth): use a user with a token, OIDC or an exec plugin, or pass --token")
	}
	return token, nil
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func (k *keyClient) do(ctx context.Context, method, path string, out any) error {
	req, err := http.NewRequestWithContext(ctx, method, k.base+path, nil)
	if err != nil {
		return err
	}
	req.Header.Set(k.header, "Bearer "+k.token)
	req.Header.Set("Accept", "application/json")
	resp, err := k.http.Do(req)
	if err != nil {
		return fmt.Errorf("reaching the idemcp manager's key API: %w", err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return fmt.Errorf("reading the manager's answer: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		var ae keyapi.Error
		if json.Unmarshal(body, &ae) == nil && ae.Message != "" {
			return &ExitError{Code: 1, Err: fmt.Errorf("%s (%d)", ae.Message, resp.StatusCode)}
		}
		return &ExitError{Code: 1, Err: fmt.Errorf("the manager's key API answered %s: %s", resp.Status, strings.TrimSpace(string(body)))}
	}
	if err := json.Unmarshal(body, out); err != nil {
		return fmt.Errorf("the manager's key API answered what is not JSON: %w", err)
	}
	return nil
}
