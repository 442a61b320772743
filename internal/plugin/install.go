package plugin

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/idemcp/idemcp/cmd/manager"
	"github.com/idemcp/idemcp/webhook"
)

// WebhookName is the name of idemcp's Pod webhook in its
// MutatingWebhookConfiguration.
const WebhookName = "inject.idemcp.io"

// managerLabels are the labels of the manager's Deployment and pods.
var managerLabels = client.MatchingLabels{"app.kubernetes.io/name": "idemcp", "app.kubernetes.io/component": "manager"}

// Install is what the plugin found of idemcp's own installation.
type Install struct {
	// Manager is the manager's Deployment, nil when none was found.
	Manager *appsv1.Deployment
	// Options are the manager's flags, read from its container's args.
	Options manager.Options
	// SidecarImage is the image the webhook injects.
	SidecarImage string
	// Webhook is the Pod webhook as the API server calls it, nil when no
	// MutatingWebhookConfiguration has it; WebhookConfig names its
	// configuration.
	Webhook       *admissionv1.MutatingWebhook
	WebhookConfig string
	// Notes say what could not be read (permissions) and so was not checked.
	Notes []string
}

// FindInstall reads the manager's Deployment and the webhook configuration.
func FindInstall(ctx context.Context, e *Env) *Install {
	in := &Install{}
	var deps appsv1.DeploymentList
	opts := []client.ListOption{managerLabels}
	if e.ManagerNamespace != "" {
		opts = append(opts, client.InNamespace(e.ManagerNamespace))
	}
	err := e.Client.List(ctx, &deps, opts...)
	if apierrors.IsForbidden(err) && e.ManagerNamespace == "" {
		// Not allowed to list every namespace: the default install's.
		err = e.Client.List(ctx, &deps, managerLabels, client.InNamespace("idemcp-system"))
	}
	switch {
	case err != nil:
		in.Notes = append(in.Notes, fmt.Sprintf("could not read the idemcp manager's Deployment (%v): the checks that need its flags assume the defaults", err))
	case len(deps.Items) == 0:
		in.Notes = append(in.Notes, "found no idemcp manager Deployment (labels app.kubernetes.io/name=idemcp, app.kubernetes.io/component=manager): the checks that need its flags assume the defaults; set --manager-namespace if it is elsewhere")
	default:
		in.Manager = &deps.Items[0]
	}
	in.Options = managerOptions(in.Manager)
	in.SidecarImage = in.Options.Sidecar.Image

	var whs admissionv1.MutatingWebhookConfigurationList
	if err := e.Client.List(ctx, &whs); err != nil {
		in.Notes = append(in.Notes, fmt.Sprintf("could not read the MutatingWebhookConfigurations (%v): namespaces and pods are matched against the default selectors", err))
		in.Webhook = defaultWebhook(in.Options.Namespace)
		return in
	}
	for i := range whs.Items {
		for j := range whs.Items[i].Webhooks {
			if whs.Items[i].Webhooks[j].Name == WebhookName {
				in.Webhook, in.WebhookConfig = &whs.Items[i].Webhooks[j], whs.Items[i].Name
				return in
			}
		}
	}
	return in
}

// managerOptions parses the manager container's args with the manager's
// own flag set, so the plugin reads every flag as the manager does.
func managerOptions(d *appsv1.Deployment) manager.Options {
	var o manager.Options
	fs := manager.NewFlagSet(&o)
	o.Namespace = "idemcp-system"
	o.MissingPolicy = string(webhook.MissingPolicyDeny)
	if d == nil {
		return o
	}
	o.Namespace = d.Namespace
	for _, c := range d.Spec.Template.Spec.Containers {
		if c.Name != "manager" {
			continue
		}
		args := append(append([]string{}, c.Command...), c.Args...)
		for len(args) > 0 && (args[0] == "manager" || args[0] == "/idemcp" || args[0] == "idemcp") {
			args = args[1:]
		}
		fs.SetOutput(io.Discard)
		_ = fs.FlagSet.Parse(args)
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if !set["namespace"] {
			o.Namespace = d.Namespace
		}
		if o.Sidecar.Image == "" {
			for _, env := range c.Env {
				if env.Name == "IDEMCP_SIDECAR_IMAGE" && env.Value != "" {
					o.Sidecar.Image = env.Value
				}
			}
		}
		if o.Sidecar.Image == "" {
			o.Sidecar.Image = c.Image
		}
	}
	return o
}

// defaultWebhook is the webhook as config/webhook installs it, for when
// the plugin may not read the real one.
func defaultWebhook(managerNS string) *admissionv1.MutatingWebhook {
	return &admissionv1.MutatingWebhook{
		Name: WebhookName,
		NamespaceSelector: &metav1.LabelSelector{
			MatchLabels: map[string]string{webhook.LabelInjection: "enabled"},
			MatchExpressions: []metav1.LabelSelectorRequirement{{
				Key: corev1.LabelMetadataName, Operator: metav1.LabelSelectorOpNotIn, Values: []string{"kube-system", managerNS},
			}},
		},
		ObjectSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
			{Key: webhook.LabelInject, Operator: metav1.LabelSelectorOpExists},
			{Key: webhook.LabelInject, Operator: metav1.LabelSelectorOpNotIn, Values: []string{"false", "False", "FALSE", "f", "F", "0"}},
		}},
	}
}

// injector is the webhook's own decision, configured as the manager's
// flags configure it, except that it reads Secrets as metadata only (the
// plugin never fetches a Secret's data) and reports what it could not
// check to unchecked instead of failing.
func (in *Install) injector(c client.Reader, unchecked func(string)) *webhook.Injector {
	return &webhook.Injector{
		Client:              c,
		Config:              in.Options.Sidecar,
		ManagerNamespace:    in.Options.Namespace,
		MissingPolicy:       webhook.MissingPolicy(in.Options.MissingPolicy),
		SecretsMetadataOnly: true,
		Unchecked:           unchecked,
	}
}

// pdb is the manager's PodDisruptionBudget, nil when there is none.
func (in *Install) pdb(ctx context.Context, c client.Reader) (*policyv1.PodDisruptionBudget, error) {
	if in.Manager == nil {
		return nil, nil
	}
	var pdbs policyv1.PodDisruptionBudgetList
	if err := c.List(ctx, &pdbs, client.InNamespace(in.Manager.Namespace)); err != nil {
		return nil, err
	}
	podLabels := labels.Set(in.Manager.Spec.Template.Labels)
	for i := range pdbs.Items {
		sel, err := metav1.LabelSelectorAsSelector(pdbs.Items[i].Spec.Selector)
		if err == nil && !sel.Empty() && sel.Matches(podLabels) {
			return &pdbs.Items[i], nil
		}
	}
	return nil, nil
}

// proxyReadyz reads a sidecar's /readyz on its admin port through the API
// server (pods/proxy), which says the policy hash it enforces and whether
// its store answers.
func (e *Env) proxyReadyz(ctx context.Context, namespace, pod string, port int32) (string, error) {
	if e.clientset == nil {
		cs, err := kubernetes.NewForConfig(e.Config)
		if err != nil {
			return "", err
		}
		e.clientset = cs
	}
	cs := e.clientset
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	body, err := cs.CoreV1().Pods(namespace).ProxyGet("http", pod, strconv.Itoa(int(port)), "/readyz", nil).DoRaw(ctx)
	if err != nil {
		return "", err
	}
	return string(body), nil
}
