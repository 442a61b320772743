package plugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"
	admission "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrladmission "sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/webhook"
)

// Verdict is whether one pod is, or would be, injected, and why.
type Verdict struct {
	Namespace string `json:"namespace"`
	Pod       string `json:"pod"`
	// Injected: the pod carries the webhook's sidecar now.
	Injected bool `json:"injected"`
	// WouldInject: the webhook would inject a pod like it created now.
	WouldInject bool `json:"wouldInject"`
	// Refused: the webhook would refuse to create a pod like it, with
	// Refusal, the message the API server would show.
	Refused bool   `json:"refused,omitempty"`
	Refusal string `json:"refusal,omitempty"`
	// Reasons, in the order the API server and the webhook decide.
	Reasons []string `json:"reasons"`
}

func newCheckInjectCommand(g *globalFlags, newEnv envFunc) *cobra.Command {
	var selector string
	cmd := &cobra.Command{
		Use:   "check-inject (POD | -l SELECTOR) [-n NAMESPACE | -A] [-o json|yaml]",
		Short: "Say whether a pod is (or would be) injected with the idemcp sidecar, and every reason",
		Long: `check-inject says, for each pod, whether it carries the idemcp sidecar and,
if not, every reason, in the order they are decided: the webhook's
namespaceSelector and objectSelector (checked by the API server), then the
webhook itself. The webhook's part is the webhook's own code, run as a dry
run with the manager's flags, so this command and the webhook never
disagree.

A pod that exists was decided when it was created; "would be injected"
means a pod like it created now (kubectl rollout restart its workload, or
delete the pod) gets the sidecar.`,
		Example: `  kubectl idemcp check-inject mcp-7d9f8-abcde -n shop
  kubectl idemcp check-inject -l app=mcp -n shop
  kubectl idemcp check-inject -l idemcp.io/inject=true -A -o json`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if (len(args) == 1) == (selector != "") || len(args) > 1 {
				return &ExitError{Code: 2, Err: errors.New("check-inject takes one POD, or -l SELECTOR")}
			}
			if err := checkOutput(g.output, "", "json", "yaml"); err != nil {
				return err
			}
			e, err := newEnv(cmd)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			var pods []corev1.Pod
			if len(args) == 1 {
				var p corev1.Pod
				if err := e.Client.Get(ctx, client.ObjectKey{Namespace: e.Namespace, Name: args[0]}, &p); err != nil {
					return fmt.Errorf("reading pod %s/%s: %w", e.Namespace, args[0], err)
				}
				pods = append(pods, p)
			} else {
				sel, err := labels.Parse(selector)
				if err != nil {
					return &ExitError{Code: 2, Err: fmt.Errorf("-l %q: %w", selector, err)}
				}
				var list corev1.PodList
				opts := []client.ListOption{client.MatchingLabelsSelector{Selector: sel}}
				if !e.All {
					opts = append(opts, client.InNamespace(e.Namespace))
				}
				if err := e.Client.List(ctx, &list, opts...); err != nil {
					return fmt.Errorf("listing pods: %w", err)
				}
				if len(list.Items) == 0 {
					return fmt.Errorf("no pod matches %q", selector)
				}
				pods = list.Items
			}
			in := FindInstall(ctx, e)
			for _, n := range in.Notes {
				_, _ = fmt.Fprintf(e.ErrOut, "note: %s\n", n)
			}
			verdicts := make([]Verdict, 0, len(pods))
			for i := range pods {
				verdicts = append(verdicts, CheckInject(ctx, e.Client, in, &pods[i]))
			}
			if g.output != "" {
				return printStructured(e.Out, g.output, verdicts)
			}
			printVerdicts(e.Out, verdicts)
			return nil
		},
	}
	cmd.Flags().StringVarP(&selector, "selector", "l", "", "label selector of the pods to check (e.g. app=mcp)")
	addAllNamespaces(cmd.Flags(), g)
	addOutput(cmd.Flags(), g, "json|yaml")
	return cmd
}

func printVerdicts(w io.Writer, vs []Verdict) {
	for i, v := range vs {
		if i > 0 {
			_, _ = fmt.Fprintln(w)
		}
		state := "NOT INJECTED"
		switch {
		case v.Injected:
			state = "INJECTED"
		case v.WouldInject:
			state = "NOT INJECTED (a new pod like it would be)"
		case v.Refused:
			state = "NOT INJECTED (a new pod like it is refused)"
		}
		tw := tabwriter.NewWriter(w, 0, 4, 1, ' ', 0)
		_, _ = fmt.Fprintf(tw, "pod %s/%s:\t%s\n", v.Namespace, v.Pod, state)
		_ = tw.Flush()
		for _, r := range v.Reasons {
			_, _ = fmt.Fprintf(w, "  - %s\n", r)
		}
	}
}

// CheckInject decides for pod what the API server's selectors and the
// webhook decide, with the webhook's own code.
func CheckInject(ctx context.Context, c client.Reader, in *Install, pod *corev1.Pod) Verdict {
	v := Verdict{Namespace: pod.Namespace, Pod: pod.Name}
	if webhook.Injected(pod) {
		v.Injected = true
		s, _ := statusAnnotation(pod)
		v.Reasons = append(v.Reasons, fmt.Sprintf("already injected: the webhook put its sidecar %s in this pod (policy %s at hash %s, image %s, MCP server on port %d); it leaves an injected pod as it is", webhook.ContainerName, s.Policy, s.PolicyHash, s.Image, s.Upstream))
		return v
	}
	blocked := false
	if in.Webhook == nil {
		blocked = true
		v.Reasons = append(v.Reasons, fmt.Sprintf("idemcp's webhook is not installed: no MutatingWebhookConfiguration has the webhook %s, so the API server calls nobody; install idemcp (dist/install.yaml or the Helm chart)", WebhookName))
	}
	wh := in.Webhook
	if wh == nil {
		wh = defaultWebhook(in.Options.Namespace)
	}
	var ns corev1.Namespace
	nsErr := c.Get(ctx, client.ObjectKey{Name: pod.Namespace}, &ns)
	if nsErr != nil {
		v.Reasons = append(v.Reasons, fmt.Sprintf("could not read namespace %s (%v): its labels were not checked", pod.Namespace, nsErr))
	} else if reasons := namespaceReasons(wh, &ns); len(reasons) > 0 {
		blocked = true
		v.Reasons = append(v.Reasons, reasons...)
	}
	if reason := objectReason(wh, pod); reason != "" {
		v.Reasons = append(v.Reasons, reason)
		// The webhook would only say "not opted in" again.
		return v
	}

	// The webhook's own decision, as a dry run: no Events, no metrics.
	ctx = ctrladmission.NewContextWithRequest(ctx, ctrladmission.Request{AdmissionRequest: admission.AdmissionRequest{
		Namespace: pod.Namespace, DryRun: ptr.To(true), Operation: admission.Create,
	}})
	trial := pod.DeepCopy()
	var unchecked []string
	skipped, err := in.injector(c, func(what string) { unchecked = append(unchecked, "not checked: "+what) }).Decide(ctx, trial)
	var refusal *webhook.Refusal
	switch {
	case errors.As(err, &refusal) && blocked:
		// The API server does not call the webhook: the pod is created,
		// without the sidecar.
		v.Reasons = append(v.Reasons, "once that is fixed, the webhook refuses a pod like this one: "+refusal.Message)
	case errors.As(err, &refusal):
		v.Refused, v.Refusal = true, refusal.Message
		v.Reasons = append(v.Reasons, "the webhook refuses a pod like this one, so it is not created (its ReplicaSet retries): "+refusal.Message)
	case apierrors.IsForbidden(err):
		v.Reasons = append(v.Reasons, fmt.Sprintf("could not run the webhook's decision with your permissions: %v", err))
	case err != nil && blocked:
		v.Reasons = append(v.Reasons, "once that is fixed, the webhook refuses a pod like this one: "+err.Error())
	case err != nil:
		v.Refused, v.Refusal = true, err.Error()
		v.Reasons = append(v.Reasons, "the webhook refuses a pod like this one, so it is not created: "+err.Error())
	case skipped == webhook.SkipManagerNamespace:
		if !blocked {
			v.Reasons = append(v.Reasons, fmt.Sprintf("namespace %s is the idemcp manager's own: the webhook never injects there", pod.Namespace))
		}
		blocked = true
	case skipped == webhook.SkipNotOptedIn:
		blocked = true
		v.Reasons = append(v.Reasons, notLabelled(pod))
	case skipped == webhook.SkipHostNetwork:
		blocked = true
		v.Reasons = append(v.Reasons, "the pod uses hostNetwork: the sidecar's ports would be the node's, so the webhook admits it without the sidecar; run the MCP server without hostNetwork: true")
	case skipped == webhook.SkipPolicyMissing:
		blocked = true
		v.Reasons = append(v.Reasons, "the manager runs with --webhook-missing-policy=admit, so the pod starts without the sidecar: "+policyProblem(ctx, c, pod))
	case skipped == webhook.SkipAlreadyInjected:
		blocked = true
		v.Reasons = append(v.Reasons, "the webhook sees this pod as already injected")
	case skipped == "":
		v.WouldInject = !blocked
		p := pod.Annotations[webhook.AnnotationPolicy]
		if blocked {
			v.Reasons = append(v.Reasons, fmt.Sprintf("once that is fixed, the webhook injects it (policy %s)", p))
		} else {
			st, _ := statusAnnotation(trial)
			v.Reasons = append(v.Reasons, fmt.Sprintf("the webhook injects a pod like this one (policy %s, sidecar image %s, upstream port %d): this one was created without the sidecar (before it opted in, or while the webhook was not called); restart its workload (kubectl rollout restart) or delete the pod to get it", p, st.Image, st.Upstream))
		}
	}
	if !blocked && !v.WouldInject && len(v.Reasons) == 0 {
		v.Reasons = append(v.Reasons, "the webhook leaves this pod alone: "+skipped)
	}
	v.Reasons = append(v.Reasons, unchecked...)
	return v
}

func notLabelled(pod *corev1.Pod) string {
	if val, ok := pod.Labels[webhook.LabelInject]; ok {
		return fmt.Sprintf("the pod is labelled %s: %q, which opts it out; set the label to \"true\" in the pod template to opt it in", webhook.LabelInject, val)
	}
	return fmt.Sprintf("the pod is not labelled %s: \"true\": add that label to the pod template (the webhook runs when a pod is created, so labelling a running pod does not inject it)", webhook.LabelInject)
}

// namespaceReasons says why ns does not match the webhook's
// namespaceSelector, requirement by requirement.
func namespaceReasons(wh *admissionregistrationv1.MutatingWebhook, ns *corev1.Namespace) []string {
	if wh.NamespaceSelector == nil {
		return nil
	}
	sel, err := metav1.LabelSelectorAsSelector(wh.NamespaceSelector)
	if err != nil {
		return []string{fmt.Sprintf("the webhook's namespaceSelector does not parse (%v): no pod is injected", err)}
	}
	set := labels.Set(ns.Labels)
	if sel.Matches(set) {
		return nil
	}
	reqs, _ := sel.Requirements()
	for _, r := range reqs {
		if !r.Matches(set) && r.Key() == corev1.LabelMetadataName && r.Operator() == selection.NotIn {
			// No label helps: say only this.
			return []string{fmt.Sprintf("namespace %s is excluded: the webhook never injects in %s (kube-system and the manager's own namespace), whatever their labels; run the MCP server in another namespace", ns.Name, strings.Join(r.ValuesUnsorted(), ", "))}
		}
	}
	var out []string
	for _, r := range reqs {
		if r.Matches(set) {
			continue
		}
		switch {
		case r.Key() == webhook.LabelInjection:
			out = append(out, fmt.Sprintf("namespace %s is not enabled for injection: it lacks the label %s=enabled; run kubectl label namespace %s %s=enabled", ns.Name, webhook.LabelInjection, ns.Name, webhook.LabelInjection))
		default:
			out = append(out, fmt.Sprintf("namespace %s does not match the webhook's namespaceSelector (%s)", ns.Name, r.String()))
		}
	}
	return out
}

// objectReason says why pod does not match the webhook's objectSelector.
func objectReason(wh *admissionregistrationv1.MutatingWebhook, pod *corev1.Pod) string {
	if wh.ObjectSelector == nil {
		return ""
	}
	sel, err := metav1.LabelSelectorAsSelector(wh.ObjectSelector)
	if err != nil || sel.Matches(labels.Set(pod.Labels)) {
		return ""
	}
	return notLabelled(pod)
}

// policyProblem says what is wrong with the policy pod names.
func policyProblem(ctx context.Context, c client.Reader, pod *corev1.Pod) string {
	name := pod.Annotations[webhook.AnnotationPolicy]
	if name == "" {
		return fmt.Sprintf("the pod names no policy: add the annotation %s: <name of an IdempotencyPolicy in %s>", webhook.AnnotationPolicy, pod.Namespace)
	}
	var p v1alpha1.IdempotencyPolicy
	err := c.Get(ctx, client.ObjectKey{Namespace: pod.Namespace, Name: name}, &p)
	if err == nil && p.DeletionTimestamp != nil {
		return fmt.Sprintf("IdempotencyPolicy %s/%s is being deleted; name another policy or recreate it once its deletion is done", pod.Namespace, name)
	}
	return fmt.Sprintf("IdempotencyPolicy %s/%s not found: create it, or set the pod's %s annotation to an existing policy", pod.Namespace, name, webhook.AnnotationPolicy)
}
