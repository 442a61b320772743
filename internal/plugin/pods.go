package plugin

import (
	"encoding/json"
	"strings"

	"github.com/blang/semver/v4"
	corev1 "k8s.io/api/core/v1"

	"github.com/idemcp/idemcp/webhook"
)

// statusAnnotation reads the webhook's idemcp.io/status annotation.
func statusAnnotation(p *corev1.Pod) (webhook.Status, bool) {
	var s webhook.Status
	v, ok := p.Annotations[webhook.AnnotationStatus]
	if !ok || json.Unmarshal([]byte(v), &s) != nil {
		return webhook.Status{}, false
	}
	return s, true
}

// sidecarContainer is the injected sidecar, a native sidecar or a plain
// container.
func sidecarContainer(p *corev1.Pod) *corev1.Container {
	for i := range p.Spec.InitContainers {
		if p.Spec.InitContainers[i].Name == webhook.ContainerName {
			return &p.Spec.InitContainers[i]
		}
	}
	for i := range p.Spec.Containers {
		if p.Spec.Containers[i].Name == webhook.ContainerName {
			return &p.Spec.Containers[i]
		}
	}
	return nil
}

// sidecarStatus is the kubelet's status of the injected sidecar.
func sidecarStatus(p *corev1.Pod) *corev1.ContainerStatus {
	for _, list := range [][]corev1.ContainerStatus{p.Status.InitContainerStatuses, p.Status.ContainerStatuses} {
		for i := range list {
			if list[i].Name == webhook.ContainerName {
				return &list[i]
			}
		}
	}
	return nil
}

// imageTag is the tag of an image reference ("" for a digest or none).
func imageTag(image string) string {
	if i := strings.Index(image, "@"); i >= 0 {
		image = image[:i]
	}
	slash := strings.LastIndex(image, "/")
	if i := strings.LastIndex(image, ":"); i > slash {
		return image[i+1:]
	}
	return ""
}

// compareImages says whether image a is older or newer than b, by their
// tags as versions, or only that it differs.
func compareImages(a, b string) string {
	va, errA := semver.ParseTolerant(imageTag(a))
	vb, errB := semver.ParseTolerant(imageTag(b))
	if errA != nil || errB != nil {
		return "different from"
	}
	switch va.Compare(vb) {
	case -1:
		return "older than"
	case 1:
		return "newer than"
	}
	return "different from"
}
