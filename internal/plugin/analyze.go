package plugin

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/endpointslice"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/webhook"
)

// Severity of a finding: an error makes analyze exit 1.
type Severity string

const (
	// SeverityError means pods run, or would run, without the exactly-once
	// guarantee, or are refused.
	SeverityError Severity = "Error"
	// SeverityWarning means a risk or a drift worth fixing.
	SeverityWarning Severity = "Warning"
)

// Codes of the analyze findings. They are stable: a code is never reused
// for another check. docs/plugin.md has one section each.
const (
	CodePodNotInjected      = "IDM001"
	CodePolicyNotFound      = "IDM002"
	CodeServiceBypass       = "IDM003"
	CodeSidecarVersion      = "IDM004"
	CodePolicyNotReady      = "IDM005"
	CodePolicyNotSynced     = "IDM006"
	CodeNamespaceNotOptedIn = "IDM007"
	CodeMemoryStoreReplicas = "IDM008"
	CodeToolsUnannotated    = "IDM009"
	CodeWebhookCertExpiry   = "IDM010"
	CodeManagerBelowPDB     = "IDM011"
	CodeWebhookNotInstalled = "IDM012"
	CodeManagerNotReady     = "IDM013"
	CodeProxyNotReady       = "IDM014"
)

// Codes lists every code, in order.
var Codes = []string{
	CodePodNotInjected, CodePolicyNotFound, CodeServiceBypass, CodeSidecarVersion, CodePolicyNotReady, CodePolicyNotSynced,
	CodeNamespaceNotOptedIn, CodeMemoryStoreReplicas, CodeToolsUnannotated, CodeWebhookCertExpiry, CodeManagerBelowPDB, CodeWebhookNotInstalled, CodeManagerNotReady,
	CodeProxyNotReady,
}

const (
	// certExpiryWarning is well inside the 30 days before the end at which
	// the manager (and cert-manager, by default) renews: a certificate
	// this close was not renewed.
	certExpiryWarning         = 14 * 24 * time.Hour
	maxNamesInMessage         = 5
	toolsTableMissingNoteText = "IDM009 (tools without annotations) was not checked: this manager publishes no tools table in the policy status (status.tools)"
)

// Finding is one misconfiguration.
type Finding struct {
	Code     string   `json:"code"`
	Severity Severity `json:"severity"`
	// Object is what it is about, as kubectl names it (kind/namespace/name).
	Object  string `json:"object"`
	Message string `json:"message"`
	Docs    string `json:"docs"`
}

// Report is what analyze found.
type Report struct {
	Findings []Finding `json:"findings"`
	// Notes say what was not checked, and why.
	Notes []string `json:"notes,omitempty"`
}

// Errors counts the findings of severity Error.
func (r *Report) Errors() int {
	n := 0
	for _, f := range r.Findings {
		if f.Severity == SeverityError {
			n++
		}
	}
	return n
}

func (r *Report) add(code string, sev Severity, object, format string, args ...any) {
	r.Findings = append(r.Findings, Finding{Code: code, Severity: sev, Object: object, Message: fmt.Sprintf(format, args...), Docs: DocsBase + "#" + strings.ToLower(code)})
}

func (r *Report) note(format string, args ...any) {
	r.Notes = append(r.Notes, fmt.Sprintf(format, args...))
}

func newAnalyzeCommand(g *globalFlags, newEnv envFunc) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "analyze [-n NAMESPACE | -A] [-o json|yaml|wide]",
		Short: "Find every idemcp misconfiguration the API server shows, each with a code and what to change",
		Long: `analyze reads the pods, Services, policies and namespaces of a namespace
(-n, default the current one) or of all (-A), and idemcp's own
installation (the manager's Deployment and PodDisruptionBudget, the webhook
configuration), and reports every misconfiguration it finds. Each finding
has a stable code (IDM001...), names the object and what to change, and
links to its section of docs/plugin.md.

Exit status: 0 when nothing of severity Error is found (warnings are
printed), 1 when something is, 2 for a bad command line.`,
		Example: `  kubectl idemcp analyze -n shop
  kubectl idemcp analyze -A -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(g.output, "", "json", "yaml", "wide"); err != nil {
				return err
			}
			e, err := newEnv(cmd)
			if err != nil {
				return err
			}
			r, err := Analyze(cmd.Context(), e)
			if err != nil {
				return err
			}
			switch g.output {
			case "json", "yaml":
				if err := printStructured(e.Out, g.output, r); err != nil {
					return err
				}
			default:
				printReport(e.Out, e.ErrOut, r, g.output == "wide")
			}
			if r.Errors() > 0 {
				return &ExitError{Code: 1}
			}
			return nil
		},
	}
	addAllNamespaces(cmd.Flags(), g)
	addOutput(cmd.Flags(), g, "json|yaml|wide")
	return cmd
}

func printReport(out, errOut io.Writer, r *Report, wide bool) {
	for _, n := range r.Notes {
		_, _ = fmt.Fprintf(errOut, "note: %s\n", n)
	}
	if len(r.Findings) == 0 {
		_, _ = fmt.Fprintln(out, "No problems found.")
		return
	}
	tw := newTable(out, wide, "CODE\tSEVERITY\tOBJECT\tMESSAGE", "\tDOCS")
	for _, f := range r.Findings {
		if wide {
			_, _ = fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", f.Code, f.Severity, f.Object, f.Message, f.Docs)
		} else {
			_, _ = fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", f.Code, f.Severity, f.Object, f.Message)
		}
	}
	_ = tw.Flush()
	if !wide {
		_, _ = fmt.Fprintf(out, "\nEach code is explained at %s#<code>, e.g. %s#%s (-o wide prints the links).\n", DocsBase, DocsBase, strings.ToLower(r.Findings[0].Code))
	}
}

// scope is what one analyze run reads.
type scope struct {
	e          *Env
	in         *Install
	pods       []corev1.Pod
	services   []corev1.Service
	policies   []v1alpha1.IdempotencyPolicy
	namespaces map[string]*corev1.Namespace
}

func (s *scope) listOpts(ns string) []client.ListOption {
	if s.e.All {
		return nil
	}
	return []client.ListOption{client.InNamespace(ns)}
}

// Analyze runs every check in the Env's namespace (or all).
func Analyze(ctx context.Context, e *Env) (*Report, error) {
	r := &Report{}
	s := &scope{e: e, in: FindInstall(ctx, e), namespaces: map[string]*corev1.Namespace{}}
	r.Notes = append(r.Notes, s.in.Notes...)
	var pods corev1.PodList
	if err := e.Client.List(ctx, &pods, s.listOpts(e.Namespace)...); err != nil {
		return nil, fmt.Errorf("listing pods: %w", err)
	}
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil && p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed {
			s.pods = append(s.pods, p)
		}
	}
	var svcs corev1.ServiceList
	if err := e.Client.List(ctx, &svcs, s.listOpts(e.Namespace)...); err != nil {
		return nil, fmt.Errorf("listing services: %w", err)
	}
	s.services = svcs.Items
	var pols v1alpha1.IdempotencyPolicyList
	if err := e.Client.List(ctx, &pols, s.listOpts(e.Namespace)...); err != nil {
		return nil, fmt.Errorf("listing IdempotencyPolicies (is idemcp's CRD installed?): %w", err)
	}
	s.policies = pols.Items
	if e.All {
		var nss corev1.NamespaceList
		if err := e.Client.List(ctx, &nss); err != nil {
			r.note("could not list namespaces (%v): IDM007 and the namespace checks of IDM001 were skipped", err)
		}
		for i := range nss.Items {
			s.namespaces[nss.Items[i].Name] = &nss.Items[i]
		}
	} else {
		var ns corev1.Namespace
		if err := e.Client.Get(ctx, client.ObjectKey{Name: e.Namespace}, &ns); err != nil {
			r.note("could not read namespace %s (%v): IDM007 was skipped", e.Namespace, err)
		} else {
			s.namespaces[ns.Name] = &ns
		}
	}

	s.checkWebhookInstalled(r)
	s.checkPods(ctx, r)
	s.checkServices(r)
	s.checkSidecarVersions(r)
	s.checkPolicies(r)
	s.checkNamespaces(r)
	s.checkMemoryReplicas(ctx, r)
	s.checkTools(ctx, r)
	s.checkWebhookCert(r)
	s.checkManagerPDB(ctx, r)
	s.checkProxies(ctx, r)
	sort.SliceStable(r.Findings, func(i, j int) bool { return r.Findings[i].Code < r.Findings[j].Code })
	if r.Findings == nil {
		r.Findings = []Finding{}
	}
	return r, nil
}

func podRef(p *corev1.Pod) string { return "pod/" + p.Namespace + "/" + p.Name }

func policyOf(p *corev1.Pod) string {
	if s, ok := statusAnnotation(p); ok && s.Policy != "" {
		return s.Policy
	}
	return p.Annotations[webhook.AnnotationPolicy]
}

func (s *scope) policy(ns, name string) *v1alpha1.IdempotencyPolicy {
	for i := range s.policies {
		if s.policies[i].Namespace == ns && s.policies[i].Name == name {
			return &s.policies[i]
		}
	}
	return nil
}

// IDM012
func (s *scope) checkWebhookInstalled(r *Report) {
	if s.in.Webhook != nil {
		return
	}
	r.add(CodeWebhookNotInstalled, SeverityError, "mutatingwebhookconfiguration/-", "no MutatingWebhookConfiguration has the webhook %s: no pod is injected; install idemcp (dist/install.yaml or the Helm chart)", WebhookName)
}

// IDM001 and IDM002
func (s *scope) checkPods(ctx context.Context, r *Report) {
	for i := range s.pods {
		p := &s.pods[i]
		if p.Labels[v1alpha1.LabelComponent] == "redis" {
			continue
		}
		name := policyOf(p)
		injected := webhook.Injected(p)
		optedIn, _ := webhook.OptedIn(p)
		if !injected && !optedIn {
			continue
		}
		// A pod the API server never sends to the webhook is IDM001 (its
		// namespace, its label); one the webhook refused or admitted with
		// its policy missing, IDM002.
		if name != "" && s.policy(p.Namespace, name) == nil && (injected || s.reachesWebhook(p)) {
			what := "asks for idemcp"
			if injected {
				what = "carries the idemcp sidecar"
			}
			r.add(CodePolicyNotFound, SeverityError, podRef(p), "the pod %s but its policy IdempotencyPolicy %s/%s does not exist: create it, or set the annotation %s to an existing policy (and restart the pod)", what, p.Namespace, name, webhook.AnnotationPolicy)
			continue
		}
		if injected {
			continue
		}
		v := CheckInject(ctx, s.e.Client, s.in, p)
		r.add(CodePodNotInjected, SeverityError, podRef(p), "the pod is labelled %s but runs without the idemcp sidecar: %s (kubectl idemcp check-inject %s -n %s explains)", webhook.LabelInject, strings.Join(v.Reasons, "; "), p.Name, p.Namespace)
	}
}

// reachesWebhook reports whether the API server calls the webhook for p,
// as far as the namespaces read show.
func (s *scope) reachesWebhook(p *corev1.Pod) bool {
	wh := s.in.Webhook
	if wh == nil {
		return false
	}
	ns := s.namespaces[p.Namespace]
	return (ns == nil || len(namespaceReasons(wh, ns)) == 0) && objectReason(wh, p) == ""
}

// IDM003: a Service whose port reaches an injected pod's MCP server
// directly, not the sidecar.
func (s *scope) checkServices(r *Report) {
	for i := range s.services {
		svc := &s.services[i]
		if len(svc.Spec.Selector) == 0 || svc.Spec.Type == corev1.ServiceTypeExternalName {
			continue
		}
		sel := labels.SelectorFromSet(svc.Spec.Selector)
		for _, sp := range svc.Spec.Ports {
			var bypassed []string
			var upstream, proxy int32
			for j := range s.pods {
				p := &s.pods[j]
				if p.Namespace != svc.Namespace || !sel.Matches(labels.Set(p.Labels)) || !webhook.Injected(p) {
					continue
				}
				st, _ := statusAnnotation(p)
				port := sp
				if port.TargetPort.Type == intstr.Int && port.TargetPort.IntVal == 0 {
					port.TargetPort = intstr.FromInt32(port.Port)
				}
				n, err := endpointslice.FindPort(p, &port)
				if err != nil || int32(n) != st.Upstream {
					continue
				}
				bypassed = append(bypassed, p.Name)
				upstream, proxy = st.Upstream, st.ProxyPort
			}
			if len(bypassed) == 0 {
				continue
			}
			target := sp.TargetPort.String()
			if sp.TargetPort.Type == intstr.Int && sp.TargetPort.IntVal == 0 {
				target = fmt.Sprint(sp.Port)
			}
			r.add(CodeServiceBypass, SeverityError, "service/"+svc.Namespace+"/"+svc.Name,
				"port %s (targetPort %s) reaches the MCP server's own port %d on %s, around the idemcp sidecar: its calls are not deduplicated; set targetPort: %s (the sidecar's port name) or %d",
				portName(sp), target, upstream, names(bypassed), webhook.PortNameMCP, proxy)
		}
	}
}

func portName(sp corev1.ServicePort) string {
	if sp.Name != "" {
		return sp.Name
	}
	return fmt.Sprint(sp.Port)
}

func names(ns []string) string {
	sort.Strings(ns)
	if len(ns) > maxNamesInMessage {
		return fmt.Sprintf("pods %s and %d more", strings.Join(ns[:maxNamesInMessage], ", "), len(ns)-maxNamesInMessage)
	}
	if len(ns) == 1 {
		return "pod " + ns[0]
	}
	return "pods " + strings.Join(ns, ", ")
}

// IDM004: a sidecar of another version than the manager injects now.
func (s *scope) checkSidecarVersions(r *Report) {
	if s.in.Manager == nil || s.in.SidecarImage == "" {
		return
	}
	for i := range s.pods {
		p := &s.pods[i]
		if !webhook.Injected(p) {
			continue
		}
		c := sidecarContainer(p)
		if c == nil || c.Image == s.in.SidecarImage {
			continue
		}
		r.add(CodeSidecarVersion, SeverityWarning, podRef(p),
			"the pod runs the sidecar image %s, %s the manager's %s (deployment/%s/%s): sidecar and manager are released together; restart the pod's workload (kubectl rollout restart) so the webhook injects the current sidecar",
			c.Image, compareImages(c.Image, s.in.SidecarImage), s.in.SidecarImage, s.in.Manager.Namespace, s.in.Manager.Name)
	}
}

// IDM005 and IDM006
func (s *scope) checkPolicies(r *Report) {
	for i := range s.policies {
		p := &s.policies[i]
		ref := "idempotencypolicy/" + p.Namespace + "/" + p.Name
		ready := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionReady)
		switch {
		case ready == nil:
			r.add(CodePolicyNotReady, SeverityError, ref, "the policy has no Ready condition: no idemcp controller has reconciled it; check that the idemcp manager runs (kubectl -n %s get pods)", s.in.Options.Namespace)
		case ready.Status != metav1.ConditionTrue:
			detail := ready.Message
			if sr := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionStoreReady); sr != nil && sr.Status != metav1.ConditionTrue && ready.Reason == v1alpha1.ReasonStoreNotReady {
				detail = sr.Reason + ": " + sr.Message
			}
			r.add(CodePolicyNotReady, SeverityError, ref, "the policy is not Ready (%s): %s", ready.Reason, detail)
		}
		if p.Status.ObservedGeneration != 0 && p.Status.ObservedGeneration < p.Generation {
			r.add(CodePolicyNotSynced, SeverityWarning, ref, "the policy's status describes generation %d, but its spec is at generation %d: the controller has not caught up; check the idemcp manager's logs", p.Status.ObservedGeneration, p.Generation)
		}
		if sc := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionSidecarsSynced); sc != nil && sc.Status == metav1.ConditionFalse {
			r.add(CodePolicyNotSynced, SeverityWarning, ref, "the sidecars are not synced (%s): %s", sc.Reason, sc.Message)
		} else if sc != nil && sc.Status == metav1.ConditionUnknown {
			r.add(CodePolicyNotSynced, SeverityWarning, ref, "whether the sidecars enforce this policy is not observed (%s): %s", sc.Reason, sc.Message)
		} else if sd := p.Status.Sidecars; sd != nil && sd.Injected > sd.Connected {
			r.add(CodePolicyNotSynced, SeverityWarning, ref, "%d of %d injected pods hold no policy stream and enforce the policy they last had; kubectl idemcp status %s -n %s shows each", sd.Injected-sd.Connected, sd.Injected, p.Name, p.Namespace)
		}
	}
}

// IDM007: a namespace enabled for injection with pods that never opted in.
func (s *scope) checkNamespaces(r *Report) {
	nsNames := make([]string, 0, len(s.namespaces))
	for n := range s.namespaces {
		nsNames = append(nsNames, n)
	}
	sort.Strings(nsNames)
	for _, n := range nsNames {
		ns := s.namespaces[n]
		if ns.Labels[webhook.LabelInjection] != "enabled" || n == s.in.Options.Namespace {
			continue
		}
		if s.in.Webhook != nil && len(namespaceReasons(s.in.Webhook, ns)) > 0 {
			// Excluded whatever its labels (kube-system): nothing to opt in.
			continue
		}
		var out []string
		for i := range s.pods {
			p := &s.pods[i]
			if _, labelled := p.Labels[webhook.LabelInject]; p.Namespace == n && !labelled && !webhook.Injected(p) {
				out = append(out, p.Name)
			}
		}
		if len(out) == 0 {
			continue
		}
		r.add(CodeNamespaceNotOptedIn, SeverityWarning, "namespace/"+n,
			"the namespace is labelled %s=enabled but %s never opted in (no label %s): a namespace label alone injects nothing; label the MCP server's pod template %s: \"true\", or label the others %s: \"false\" to say they stay out",
			webhook.LabelInjection, names(out), webhook.LabelInject, webhook.LabelInject, webhook.LabelInject)
	}
}

// IDM008: a Memory policy behind several replicas: a retry that reaches
// another replica runs again.
func (s *scope) checkMemoryReplicas(ctx context.Context, r *Report) {
	for i := range s.policies {
		p := &s.policies[i]
		if p.Spec.Store.Type != v1alpha1.StoreMemory && p.Spec.Store.Type != "" {
			continue
		}
		var pods []string
		for j := range s.pods {
			if s.pods[j].Namespace == p.Namespace && webhook.Injected(&s.pods[j]) && policyOf(&s.pods[j]) == p.Name {
				pods = append(pods, s.pods[j].Name)
			}
		}
		var wide []string
		several := func(kind, name string, t corev1.PodTemplateSpec, replicas *int32) {
			if optedIn, _ := webhook.OptedIn(&corev1.Pod{ObjectMeta: t.ObjectMeta}); optedIn && t.Annotations[webhook.AnnotationPolicy] == p.Name && replicas != nil && *replicas > 1 {
				wide = append(wide, fmt.Sprintf("%s/%s (%d replicas)", kind, name, *replicas))
			}
		}
		var deps appsv1.DeploymentList
		if err := s.e.Client.List(ctx, &deps, client.InNamespace(p.Namespace)); err == nil {
			for _, d := range deps.Items {
				several("deployment", d.Name, d.Spec.Template, d.Spec.Replicas)
			}
		}
		var sets appsv1.StatefulSetList
		if err := s.e.Client.List(ctx, &sets, client.InNamespace(p.Namespace)); err == nil {
			for _, d := range sets.Items {
				several("statefulset", d.Name, d.Spec.Template, d.Spec.Replicas)
			}
		}
		if len(pods) < 2 && len(wide) == 0 {
			continue
		}
		what := names(pods)
		if len(wide) > 0 {
			what = strings.Join(wide, ", ")
		}
		r.add(CodeMemoryStoreReplicas, SeverityWarning, "idempotencypolicy/"+p.Namespace+"/"+p.Name,
			"the policy's store is Memory, and %s use it: each replica keeps its own records, so a retry that reaches another replica runs again; use store type Redis (store.redis.managed: {}) or run one replica", what)
	}
}

// IDM009: tools the sidecars saw with no annotations (Auto deduplicates
// them all). Read from status.tools, which only a manager that publishes
// the tools table writes; without it the check is skipped with a note.
func (s *scope) checkTools(ctx context.Context, r *Report) {
	seen := false
	for i := range s.policies {
		p := &s.policies[i]
		u := &unstructured.Unstructured{}
		u.SetGroupVersionKind(v1alpha1.GroupVersion.WithKind("IdempotencyPolicy"))
		if err := s.e.Client.Get(ctx, client.ObjectKeyFromObject(p), u); err != nil {
			continue
		}
		tools, found, _ := unstructured.NestedSlice(u.Object, "status", "tools")
		if !found {
			continue
		}
		seen = true
		var bare []string
		for _, t := range tools {
			m, ok := t.(map[string]any)
			if !ok {
				continue
			}
			name, _ := m["name"].(string)
			for k, v := range m {
				if str, ok := v.(string); ok && k != "name" && normalize(str) == "noannotations" {
					bare = append(bare, name)
					break
				}
			}
		}
		if len(bare) == 0 {
			continue
		}
		sort.Strings(bare)
		r.add(CodeToolsUnannotated, SeverityWarning, "idempotencypolicy/"+p.Namespace+"/"+p.Name,
			"the MCP server's tools %s carry no annotations, so defaultMode Auto deduplicates them all, reads included (a read then replays a stale answer): add tools rules with mode: Passthrough for the reads (e.g. name: \"get_*\")",
			strings.Join(bare, ", "))
	}
	if !seen && len(s.policies) > 0 {
		r.note(toolsTableMissingNoteText)
	}
}

func normalize(s string) string {
	return strings.NewReplacer(" ", "", "_", "", "-", "").Replace(strings.ToLower(s))
}

// IDM010: the webhook's CA or serving certificate ends soon. A webhook
// whose certificate expired makes the API server refuse every opted-in pod
// (failurePolicy: Fail).
func (s *scope) checkWebhookCert(r *Report) {
	if s.in.Webhook == nil {
		return
	}
	now := time.Now()
	if s.e.Now != nil {
		now = s.e.Now()
	}
	check := func(object, what string, pemData []byte) {
		cert := latestCert(pemData)
		if cert == nil {
			return
		}
		left := cert.NotAfter.Sub(now)
		switch {
		case left <= 0:
			r.add(CodeWebhookCertExpiry, SeverityError, object, "the webhook's %s expired at %s: the API server refuses every opted-in pod; check the manager's logs (it renews its certificates) or cert-manager's Certificate", what, cert.NotAfter.UTC().Format(time.RFC3339))
		case left < certExpiryWarning:
			r.add(CodeWebhookCertExpiry, SeverityWarning, object, "the webhook's %s expires in %s (%s) and has not been renewed: once it expires the API server refuses every opted-in pod; check the manager's logs (it renews its certificates) or cert-manager's Certificate", what, humanDuration(left), cert.NotAfter.UTC().Format(time.RFC3339))
		}
	}
	// Only the CA: the serving certificate's Secret also holds its private
	// key, which a read-only check has no business fetching. The manager
	// renews both on one schedule, so a CA that was not renewed says the
	// same.
	check("mutatingwebhookconfiguration/"+s.in.WebhookConfig, "CA (caBundle)", s.in.Webhook.ClientConfig.CABundle)
}

// latestCert is the certificate of the bundle that ends last: a bundle in
// rotation holds the old CA and its successor.
func latestCert(data []byte) *x509.Certificate {
	var best *x509.Certificate
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			return best
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err == nil && (best == nil || c.NotAfter.After(best.NotAfter)) {
			best = c
		}
	}
}

// IDM011: the manager has fewer ready replicas than its
// PodDisruptionBudget wants, so a drain is blocked, or the webhook is one
// failure away from refusing every opted-in pod.
func (s *scope) checkManagerPDB(ctx context.Context, r *Report) {
	d := s.in.Manager
	if d == nil {
		return
	}
	pdb, err := s.in.pdb(ctx, s.e.Client)
	if err != nil {
		r.note("could not read the manager's PodDisruptionBudget (%v): IDM011 was skipped", err)
		return
	}
	if pdb == nil {
		if d.Status.ReadyReplicas == 0 {
			r.add(CodeManagerNotReady, SeverityError, "deployment/"+d.Namespace+"/"+d.Name,
				"the idemcp manager has no ready replica: the API server refuses every opted-in pod (failurePolicy: Fail) and no policy is reconciled; see why its pods are not ready (kubectl -n %s describe pods -l app.kubernetes.io/name=idemcp,app.kubernetes.io/component=manager)", d.Namespace)
		}
		return
	}
	want := pdb.Status.DesiredHealthy
	if pdb.Status.ObservedGeneration == 0 {
		// No disruption controller wrote the status (yet): from the spec.
		want = desiredHealthy(pdb.Spec.MinAvailable, pdb.Spec.MaxUnavailable, d.Spec.Replicas)
	}
	if d.Status.ReadyReplicas >= want {
		return
	}
	r.add(CodeManagerBelowPDB, SeverityError, "deployment/"+d.Namespace+"/"+d.Name,
		"the idemcp manager has %d ready replicas and its PodDisruptionBudget %s wants %d healthy: node drains are blocked and one more failure leaves no webhook, so opted-in pods are refused; see why its pods are not ready (kubectl -n %s describe pods -l app.kubernetes.io/name=idemcp,app.kubernetes.io/component=manager)",
		d.Status.ReadyReplicas, pdb.Name, want, d.Namespace)
}

func desiredHealthy(minAvailable, maxUnavailable *intstr.IntOrString, replicas *int32) int32 {
	n := int32(1)
	if replicas != nil {
		n = *replicas
	}
	switch {
	case minAvailable != nil:
		v, err := intstr.GetScaledValueFromIntOrPercent(minAvailable, int(n), true)
		if err == nil {
			return int32(v)
		}
	case maxUnavailable != nil:
		v, err := intstr.GetScaledValueFromIntOrPercent(maxUnavailable, int(n), true)
		if err == nil {
			return max(n-int32(v), 0)
		}
	}
	return 0
}

// humanDuration is d in days, or in hours under two days.
func humanDuration(d time.Duration) string {
	if d >= 48*time.Hour {
		return fmt.Sprintf("%d days", int(d.Hours()/24+0.5))
	}
	return fmt.Sprintf("%d hours", int(d.Hours()+0.5))
}
