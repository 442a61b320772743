package plugin

import (
	"context"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
)

// IDM014: an IdempotentProxy that is not Ready, with the condition at
// fault (its policy or a Secret missing, its upstream unreachable, its
// replicas not ready, its pods behind the policy).
func (s *scope) checkProxies(ctx context.Context, r *Report) {
	var list v1alpha1.IdempotentProxyList
	if err := s.e.Client.List(ctx, &list, s.listOpts(s.e.Namespace)...); err != nil {
		r.note("could not list IdempotentProxies (%v): IDM014 was skipped", err)
		return
	}
	for i := range list.Items {
		px := &list.Items[i]
		ref := "idempotentproxy/" + px.Namespace + "/" + px.Name
		ready := meta.FindStatusCondition(px.Status.Conditions, v1alpha1.ConditionReady)
		switch {
		case ready == nil:
			r.add(CodeProxyNotReady, SeverityError, ref, "the proxy has no Ready condition: no idemcp controller has reconciled it; check that the idemcp manager runs (kubectl -n %s get pods)", s.in.Options.Namespace)
		case ready.Status == metav1.ConditionFalse:
			r.add(CodeProxyNotReady, SeverityError, ref, "the proxy is not Ready (%s): %s", ready.Reason, ready.Message)
		case ready.Status == metav1.ConditionUnknown:
			r.add(CodeProxyNotReady, SeverityWarning, ref, "whether the proxy's pods enforce its policy is not observed (%s): %s", ready.Reason, ready.Message)
		}
	}
}
