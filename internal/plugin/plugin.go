// Package plugin is kubectl-idemcp, the kubectl plugin that explains what
// idemcp does in a cluster: analyze (misconfigurations, each with a code),
// check-inject (why a pod is or is not injected, as the webhook decides),
// status (each sidecar of a policy) and keys (a policy's stored keys,
// through the manager's key API). It reads what the API server, the
// manager and the sidecars already publish, with the user's own
// kubeconfig and permissions; only keys release and forget change
// anything, as RBAC allows.
package plugin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/internal/version"
)

// DocsBase is where the analyze codes' sections are: each finding links to
// DocsBase + "#" + its code in lower case.
const DocsBase = "https://github.com/idemcp/idemcp/blob/main/docs/plugin.md"

// ExitError ends the command with Code, after its output was written.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string {
	if e.Err == nil {
		return fmt.Sprintf("exit status %d", e.Code)
	}
	return e.Err.Error()
}

func (e *ExitError) Unwrap() error { return e.Err }

// Env is what every subcommand reads the cluster with.
type Env struct {
	Client client.Client
	Config *rest.Config
	// Namespace is -n, or the kubeconfig context's namespace; All is -A.
	Namespace string
	All       bool
	// ManagerNamespace is --manager-namespace: "" finds the manager by
	// its labels in every namespace.
	ManagerNamespace string
	Out, ErrOut      io.Writer
	Now              func() time.Time
	// Probe reads a sidecar's /readyz through the API server's pod proxy;
	// tests replace it (envtest has no kubelet).
	Probe func(ctx context.Context, namespace, pod string, port int32) (string, error)

	clientset kubernetes.Interface
}

type globalFlags struct {
	kubeconfig string
	overrides  clientcmd.ConfigOverrides
	all        bool
	managerNS  string
	output     string
	managerURL string
	managerCA  string
}

// NewCommand returns kubectl-idemcp.
func NewCommand(out, errOut io.Writer) *cobra.Command {
	g := &globalFlags{}
	root := &cobra.Command{
		Use:   "idemcp",
		Short: "Explain idemcp in a cluster: what is misconfigured, why a pod is not injected, how each sidecar is, what its store holds",
		Long: `kubectl idemcp explains idemcp in a cluster, with your kubeconfig and
your permissions. Only keys release and keys forget change anything.

  analyze       every misconfiguration found, each with a code and a link
  check-inject  whether a pod is (or would be) injected, and every reason
  status        each sidecar of a policy: ready, policy applied, store, version
  keys          a policy's stored keys: list, show, release, forget`,
		SilenceUsage:      true,
		SilenceErrors:     true,
		Annotations:       map[string]string{cobra.CommandDisplayNameAnnotation: "kubectl idemcp"},
		CompletionOptions: cobra.CompletionOptions{HiddenDefaultCmd: true},
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &ExitError{Code: 2, Err: err} })
	root.SetOut(out)
	root.SetErr(errOut)
	fs := root.PersistentFlags()
	fs.StringVar(&g.kubeconfig, "kubeconfig", "", "path to the kubeconfig file to use")
	// kubectl's own names: -n/--namespace, --context, --cluster, --user,
	// --server, --token and the rest.
	clientcmd.BindOverrideFlags(&g.overrides, fs, clientcmd.RecommendedConfigOverrideFlags(""))
	fs.StringVar(&g.managerURL, "manager-url", "", "reach the idemcp manager's key API at this https:// URL (keys), such as https://localhost:9444 through kubectl port-forward, instead of through the API server's service proxy")
	fs.StringVar(&g.managerCA, "manager-ca", "", "PEM file of the CA that --manager-url's certificate verifies against (default: the caBundle of the inject.idemcp.io webhook)")
	fs.StringVar(&g.managerNS, "manager-namespace", "", "namespace of the idemcp manager (default: found by its labels, app.kubernetes.io/name=idemcp, app.kubernetes.io/component=manager)")

	var env envFunc = func(*cobra.Command) (*Env, error) {
		return g.env(out, errOut)
	}
	root.AddCommand(newAnalyzeCommand(g, env), newCheckInjectCommand(g, env), newStatusCommand(g, env), newKeysCommand(g, env), &cobra.Command{
		Use:   "version",
		Short: "Print the plugin's version",
		Args:  cobra.NoArgs,
		Run:   func(cmd *cobra.Command, _ []string) { _, _ = fmt.Fprintln(cmd.OutOrStdout(), version.Get()) },
	})
	return root
}

func addAllNamespaces(fs *pflag.FlagSet, g *globalFlags) {
	fs.BoolVarP(&g.all, "all-namespaces", "A", false, "look in every namespace (not only the current one)")
}

func addOutput(fs *pflag.FlagSet, g *globalFlags, formats string) {
	fs.StringVarP(&g.output, "output", "o", "", "output format: "+formats)
}

func (g *globalFlags) env(out, errOut io.Writer) (*Env, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = g.kubeconfig
	cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &g.overrides)
	cfg, err := cc.ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("reading the kubeconfig: %w", err)
	}
	ns, _, err := cc.Namespace()
	if err != nil {
		return nil, fmt.Errorf("reading the namespace of the kubeconfig context: %w", err)
	}
	cfg.UserAgent = "kubectl-idemcp/" + version.Get().Version
	c, err := client.New(cfg, client.Options{Scheme: manager.NewScheme()})
	if err != nil {
		return nil, fmt.Errorf("connecting to the cluster: %w", err)
	}
	e := &Env{Client: c, Config: cfg, Namespace: ns, All: g.all, ManagerNamespace: g.managerNS, Out: out, ErrOut: errOut, Now: time.Now}
	e.Probe = e.proxyReadyz
	return e, nil
}

func checkOutput(format string, allowed ...string) error {
	for _, a := range allowed {
		if format == a {
			return nil
		}
	}
	return &ExitError{Code: 2, Err: fmt.Errorf("--output %q is not one of %s", format, strings.Join(allowed[1:], ", "))}
}

// printStructured writes v as JSON or YAML.
func printStructured(w io.Writer, format string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	if format == "yaml" {
		if b, err = yaml.JSONToYAML(b); err != nil {
			return err
		}
		_, err = w.Write(b)
		return err
	}
	_, err = fmt.Fprintf(w, "%s\n", b)
	return err
}

// Main runs kubectl-idemcp with args and returns its exit code: 0, 1 when
// analyze found an error or a command failed, 2 for a bad command line.
func Main(args []string, out, errOut io.Writer) int {
	cmd := NewCommand(out, errOut)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(context.Background())
	if err == nil {
		return 0
	}
	var exit *ExitError
	if errors.As(err, &exit) {
		if exit.Err != nil {
			_, _ = fmt.Fprintf(errOut, "error: %v\n", exit.Err)
		}
		return exit.Code
	}
	_, _ = fmt.Fprintf(errOut, "error: %v\n", err)
	if strings.HasPrefix(err.Error(), "unknown command") {
		return 2
	}
	return 1
}

type envFunc func(*cobra.Command) (*Env, error)
