package webhook

import (
	"fmt"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	resourcehelper "k8s.io/component-helpers/resource"

	"github.com/idemcp/idemcp/internal/cli"
)

// Pod annotations that set the sidecar's resources; the manager's
// --sidecar-* flags give the defaults.
const (
	AnnotationProxyCPURequest    = "idemcp.io/proxy-cpu-request"
	AnnotationProxyCPULimit      = "idemcp.io/proxy-cpu-limit"
	AnnotationProxyMemoryRequest = "idemcp.io/proxy-memory-request"
	AnnotationProxyMemoryLimit   = "idemcp.io/proxy-memory-limit"
)

// EnvMemoryStoreMaxBytes bounds the sidecar's memory store in bytes.
const EnvMemoryStoreMaxBytes = "IDEMCP_MEMORY_STORE_MAX_BYTES"

type resourceKnob struct {
	annotation string
	flag       string
	name       corev1.ResourceName
	limit      bool
}

var resourceKnobs = []resourceKnob{
	{AnnotationProxyCPURequest, "--sidecar-cpu-request", corev1.ResourceCPU, false},
	{AnnotationProxyCPULimit, "--sidecar-cpu-limit", corev1.ResourceCPU, true},
	{AnnotationProxyMemoryRequest, "--sidecar-memory-request", corev1.ResourceMemory, false},
	{AnnotationProxyMemoryLimit, "--sidecar-memory-limit", corev1.ResourceMemory, true},
}

// knobFor names the annotation (and flag) that sets a request or limit.
func knobFor(name corev1.ResourceName, limit bool) string {
	for _, k := range resourceKnobs {
		if k.name == name && k.limit == limit {
			return fmt.Sprintf("the pod annotation %s (or the manager's %s)", k.annotation, k.flag)
		}
	}
	return fmt.Sprintf("nothing: the idemcp sidecar sets no %s", name)
}

// sidecarResources are the sidecar's requests and limits for pod: the
// manager's defaults, the pod's annotations over them, then
//   - in a pod with pod-level resources, no container-level value for a
//     resource the pod level declares, unless annotated: the sidecar shares
//     the pod's budget like the pod's own containers;
//   - in a Guaranteed pod, requests equal to limits, so it stays Guaranteed.
func sidecarResources(pod *corev1.Pod, cfg Config) (corev1.ResourceRequirements, error) {
	r := corev1.ResourceRequirements{Requests: corev1.ResourceList{}, Limits: corev1.ResourceList{}}
	for k, v := range cfg.Resources.Requests {
		r.Requests[k] = v.DeepCopy()
	}
	for k, v := range cfg.Resources.Limits {
		r.Limits[k] = v.DeepCopy()
	}
	annotated := map[corev1.ResourceName]bool{}
	requestAnnotated := map[corev1.ResourceName]bool{}
	for _, k := range resourceKnobs {
		v, ok := pod.Annotations[k.annotation]
		if !ok {
			continue
		}
		q, err := resource.ParseQuantity(strings.TrimSpace(v))
		if err != nil || q.Sign() <= 0 {
			example := "100m"
			if k.name == corev1.ResourceMemory {
				example = "128Mi"
			}
			return r, refuse(DenyBadAnnotation, "annotation %s is %q: give a quantity more than 0, such as %s", k.annotation, v, example)
		}
		annotated[k.name] = true
		if k.limit {
			r.Limits[k.name] = q
		} else {
			r.Requests[k.name] = q
			requestAnnotated[k.name] = true
		}
	}
	guaranteed := isGuaranteed(pod)
	for _, name := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if podLevelDeclares(pod, name) && !annotated[name] {
			delete(r.Requests, name)
			delete(r.Limits, name)
			continue
		}
		lim, hasLim := r.Limits[name]
		req, hasReq := r.Requests[name]
		if guaranteed {
			switch {
			case hasLim && !requestAnnotated[name]:
				r.Requests[name] = lim.DeepCopy()
			case hasReq && !hasLim:
				r.Limits[name] = req.DeepCopy()
			}
			lim, hasLim = r.Limits[name]
			req, hasReq = r.Requests[name]
		}
		if hasLim && hasReq && req.Cmp(lim) > 0 {
			return r, refuse(DenyResources, "the sidecar's %s request %s is more than its limit %s: set %s and %s so that the request is at most the limit",
				name, req.String(), lim.String(), knobAnnotation(name, false), knobAnnotation(name, true))
		}
	}
	return r, nil
}

func knobAnnotation(name corev1.ResourceName, limit bool) string {
	for _, k := range resourceKnobs {
		if k.name == name && k.limit == limit {
			return k.annotation
		}
	}
	return ""
}

func podLevelDeclares(pod *corev1.Pod, name corev1.ResourceName) bool {
	if pod.Spec.Resources == nil {
		return false
	}
	_, req := pod.Spec.Resources.Requests[name]
	_, lim := pod.Spec.Resources.Limits[name]
	return req || lim
}

// isGuaranteed reports whether every container of a pod without pod-level
// resources has CPU and memory limits with requests equal to them: the
// Guaranteed QoS class, which the sidecar must not take away.
func isGuaranteed(pod *corev1.Pod) bool {
	if pod.Spec.Resources != nil {
		return false
	}
	cs := allContainers(pod)
	if len(cs) == 0 {
		return false
	}
	for _, c := range cs {
		for _, name := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			lim, ok := c.Resources.Limits[name]
			if !ok || lim.IsZero() {
				return false
			}
			if req, ok := c.Resources.Requests[name]; ok && req.Cmp(lim) != 0 {
				return false
			}
		}
	}
	return true
}

// memoryEnv bounds the sidecar's memory use by its memory limit: the Go
// runtime collects before the kernel kills (cli.SoftMemoryLimit, 80% of
// the limit, as the manager gives itself), and the memory store holds at
// most half of it, so stored results cannot OOM-kill the sidecar and lose
// its claims.
func memoryEnv(pod *corev1.Pod, res corev1.ResourceRequirements, cfg Config) []corev1.EnvVar {
	var env []corev1.EnvVar
	budget := int64(0)
	if lim, ok := res.Limits[corev1.ResourceMemory]; ok && !lim.IsZero() {
		env = append(env, corev1.EnvVar{Name: "GOMEMLIMIT", Value: strconv.FormatInt(cli.SoftMemoryLimit(lim.Value()), 10)})
		budget = lim.Value()
	} else if lim, ok := cfg.Resources.Limits[corev1.ResourceMemory]; ok && !lim.IsZero() {
		// Sharing a pod-level budget: the default limit still bounds the store.
		budget = lim.Value()
	}
	if pod.Spec.Resources != nil {
		if lim, ok := pod.Spec.Resources.Limits[corev1.ResourceMemory]; ok && (budget == 0 || lim.Value() < budget) && res.Limits.Memory().IsZero() {
			budget = lim.Value()
		}
	}
	if budget > 0 {
		env = append(env, corev1.EnvVar{Name: EnvMemoryStoreMaxBytes, Value: strconv.FormatInt(budget/2, 10)})
	}
	return env
}

// checkPodLevelResources refuses an injected pod whose pod-level resources
// the containers' requests or the sidecar's limits exceed, naming the
// annotation to change: the API server would refuse it with a message about
// a container the user never wrote.
func checkPodLevelResources(pod *corev1.Pod) error {
	if pod.Spec.Resources == nil {
		return nil
	}
	sum := resourcehelper.PodRequests(pod, resourcehelper.PodResourcesOptions{SkipPodLevelResources: true})
	sidecar := injectedContainer(pod)
	for name, podReq := range pod.Spec.Resources.Requests {
		if _, ours := sidecar.Resources.Requests[name]; !ours {
			continue
		}
		if got, ok := sum[name]; ok && got.Cmp(podReq) > 0 {
			return refuse(DenyResources, "with the sidecar the containers request %s %s, more than the pod-level request %s: raise spec.resources.requests.%s, or lower %s",
				got.String(), name, podReq.String(), name, knobFor(name, false))
		}
	}
	for name, podLim := range pod.Spec.Resources.Limits {
		if lim, ok := sidecar.Resources.Limits[name]; ok && lim.Cmp(podLim) > 0 {
			return refuse(DenyResources, "the sidecar's %s limit %s is more than the pod-level limit %s: lower %s", name, lim.String(), podLim.String(), knobFor(name, true))
		}
	}
	return nil
}

// applyLimitRanges gives the sidecar what the LimitRanger admission plugin
// gives any container that lacks a value (it ran before this webhook, so
// it never saw the sidecar), then checks the sidecar and the pod against
// the namespace's LimitRanges as that plugin will, and refuses with the
// annotation to set instead of the plugin's message about a container the
// user never wrote.
func applyLimitRanges(pod *corev1.Pod, ranges []corev1.LimitRange) error {
	c := injectedContainer(pod)
	if c == nil {
		return nil
	}
	if c.Resources.Requests == nil {
		c.Resources.Requests = corev1.ResourceList{}
	}
	if c.Resources.Limits == nil {
		c.Resources.Limits = corev1.ResourceList{}
	}
	for _, lr := range ranges {
		for _, item := range lr.Spec.Limits {
			if item.Type != corev1.LimitTypeContainer {
				continue
			}
			for k, v := range item.Default {
				if _, ok := c.Resources.Limits[k]; !ok {
					c.Resources.Limits[k] = v.DeepCopy()
				}
			}
			for k, v := range item.DefaultRequest {
				if _, ok := c.Resources.Requests[k]; !ok {
					c.Resources.Requests[k] = v.DeepCopy()
				}
			}
		}
	}
	var podReqs, podLims corev1.ResourceList
	for _, lr := range ranges {
		for _, item := range lr.Spec.Limits {
			var reqs, lims corev1.ResourceList
			what := "the idemcp sidecar"
			switch item.Type {
			case corev1.LimitTypeContainer:
				reqs, lims = c.Resources.Requests, c.Resources.Limits
			case corev1.LimitTypePod:
				if podReqs == nil {
					podReqs = resourcehelper.PodRequests(pod, resourcehelper.PodResourcesOptions{})
					podLims = resourcehelper.PodLimits(pod, resourcehelper.PodResourcesOptions{})
				}
				reqs, lims, what = podReqs, podLims, "the pod with the idemcp sidecar"
			default:
				continue
			}
			fail := func(name corev1.ResourceName, limit bool, format string, args ...any) error {
				return refuse(DenyResources, "LimitRange %s/%s: %s: set %s", lr.Namespace, lr.Name, fmt.Sprintf(format, args...), knobFor(name, limit))
			}
			for name, min := range item.Min {
				req, hasReq := reqs[name]
				if !hasReq || req.Cmp(min) < 0 {
					return fail(name, false, "the minimum %s request per %s is %s, and %s requests %s", name, item.Type, min.String(), what, quantityOrNone(req, hasReq))
				}
				if lim, ok := lims[name]; ok && lim.Cmp(min) < 0 {
					return fail(name, true, "the minimum %s per %s is %s, and %s is limited to %s", name, item.Type, min.String(), what, lim.String())
				}
			}
			for name, max := range item.Max {
				lim, hasLim := lims[name]
				if !hasLim || lim.Cmp(max) > 0 {
					return fail(name, true, "the maximum %s limit per %s is %s, and %s is limited to %s", name, item.Type, max.String(), what, quantityOrNone(lim, hasLim))
				}
				if req, ok := reqs[name]; ok && req.Cmp(max) > 0 {
					return fail(name, false, "the maximum %s per %s is %s, and %s requests %s", name, item.Type, max.String(), what, req.String())
				}
			}
			for name, ratio := range item.MaxLimitRequestRatio {
				req, hasReq := reqs[name]
				lim, hasLim := lims[name]
				if !hasReq || req.IsZero() || !hasLim || lim.IsZero() {
					return fail(name, !hasLim || lim.IsZero(), "the maximum %s limit to request ratio per %s is %s, and %s lacks a %s request or limit", name, item.Type, ratio.String(), what, name)
				}
				if float64(lim.MilliValue())/float64(req.MilliValue()) > float64(ratio.MilliValue())/1000 {
					return fail(name, false, "the maximum %s limit to request ratio per %s is %s, and %s has %s/%s", name, item.Type, ratio.String(), what, lim.String(), req.String())
				}
			}
		}
	}
	return nil
}

func quantityOrNone(q resource.Quantity, ok bool) string {
	if !ok {
		return "none"
	}
	return q.String()
}
