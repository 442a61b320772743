package policystream

import (
	"context"
	"errors"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// TestRefreshOutlivesTheFirstCaller: sidecars connecting together share
// one read of their policy; the first of them going away (its context
// cancelled) must not fail the read for the others.
func TestRefreshOutlivesTheFirstCaller(t *testing.T) {
	scheme := runtime.NewScheme()
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	key := types.NamespacedName{Namespace: "shop", Name: "payments"}
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	reader := interceptor.NewClient(
		fake.NewClientBuilder().WithScheme(scheme).WithObjects(&v1alpha1.IdempotencyPolicy{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name, Generation: 1}}).Build(),
		interceptor.Funcs{Get: func(ctx context.Context, c client.WithWatch, k client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
			started <- struct{}{}
			select {
			case <-release: // the API server answers after a while
			case <-ctx.Done():
				return ctx.Err()
			}
			return c.Get(ctx, k, obj, opts...)
		}})
	s := &Server{apiReader: reader, policies: map[types.NamespacedName]*policyState{}}

	first, cancelFirst := context.WithCancel(context.Background())
	firstErr := make(chan error, 1)
	go func() { firstErr <- s.refresh(first, key) }()
	<-started
	secondErr := make(chan error, 1)
	go func() { secondErr <- s.refresh(context.Background(), key) }()
	time.Sleep(50 * time.Millisecond) // the second caller joins the read
	cancelFirst()
	if err := <-firstErr; !errors.Is(err, context.Canceled) {
		t.Fatalf("the cancelled caller got %v, want context.Canceled", err)
	}
	close(release)
	if err := <-secondErr; err != nil {
		t.Fatalf("the caller that joined the read failed with the first caller's cancellation: %v", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if st := s.policies[key]; st == nil || st.snap == nil {
		t.Fatal("the shared read did not record the policy")
	}
}
