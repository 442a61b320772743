package policystream

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	toolscache "k8s.io/client-go/tools/cache"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// TestStaleEventOfAReplacedPodKeepsTheNewStream: a StatefulSet pod is
// replaced by one of the same name; the new pod's sidecar connects (its
// pod read from the API server) before the informer hands over the old
// pod's last events. Those events are about the old pod: the new pod's
// stream must go on, while events about the new pod still end it.
func TestStaleEventOfAReplacedPodKeepsTheNewStream(t *testing.T) {
	key := types.NamespacedName{Namespace: "shop", Name: "payments"}
	s := &Server{policies: map[types.NamespacedName]*policyState{}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := &stream{pod: "mcp-0", uid: "new", notify: make(chan struct{}, 1), cancel: cancel}
	s.state(key).streams[c] = struct{}{}

	pod := func(uid string, terminating bool) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "mcp-0", UID: types.UID(uid),
			Labels: map[string]string{v1alpha1.LabelPolicy: "payments"}}}
		if terminating {
			now := metav1.Now()
			p.DeletionTimestamp = &now
		}
		return p
	}
	s.podChanged(pod("old", true), false) // the old pod's graceful deletion
	s.podChanged(pod("old", true), true)  // and its removal
	s.podChanged(toolscache.DeletedFinalStateUnknown{Key: "shop/mcp-0", Obj: pod("old", false)}, true)
	s.podChanged(pod("new", false), false) // a resync of the new pod
	other := pod("new", false)
	other.Namespace = "elsewhere"
	s.podChanged(other, true)
	if ctx.Err() != nil {
		t.Fatal("the new pod's healthy stream was ended by an event about the pod it replaced")
	}
	s.podChanged(pod("new", true), true)
	if ctx.Err() == nil {
		t.Fatal("the new pod's stream outlived the new pod's deletion")
	}
}
