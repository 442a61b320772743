package policystream

import (
	"crypto/sha256"
	"reflect"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
)

// TestReviewCacheKeepsWhatAuthorizeReads: a cached review gives back the
// fields authorize checks as the API server gave them, a token not bound
// to a pod stays unbound, and nothing else is kept.
func TestReviewCacheKeepsWhatAuthorizeReads(t *testing.T) {
	now := time.Now()
	for name, tc := range map[string]struct{ in, want authnv1.TokenReviewStatus }{
		"bound to a pod": {
			in: authnv1.TokenReviewStatus{Authenticated: true, Audiences: []string{"idemcp"}, User: authnv1.UserInfo{
				Username: "system:serviceaccount:ns:mcp", UID: "u", Groups: []string{"system:serviceaccounts", "system:authenticated"},
				Extra: map[string]authnv1.ExtraValue{extraPodName: {"mcp-0"}, extraPodUID: {"uid-0"}, "authentication.kubernetes.io/credential-id": {"JTI=x"}}}},
			want: authnv1.TokenReviewStatus{Authenticated: true, Audiences: []string{"idemcp"}, User: authnv1.UserInfo{
				Username: "system:serviceaccount:ns:mcp", Extra: map[string]authnv1.ExtraValue{extraPodName: {"mcp-0"}, extraPodUID: {"uid-0"}}}},
		},
		"two pod names": {
			in: authnv1.TokenReviewStatus{Authenticated: true, User: authnv1.UserInfo{Username: "system:serviceaccount:ns:mcp",
				Extra: map[string]authnv1.ExtraValue{extraPodName: {"a", "b"}}}},
			want: authnv1.TokenReviewStatus{Authenticated: true, User: authnv1.UserInfo{Username: "system:serviceaccount:ns:mcp",
				Extra: map[string]authnv1.ExtraValue{extraPodName: {"a", "b"}}}},
		},
		"not bound": {
			in:   authnv1.TokenReviewStatus{Authenticated: true, User: authnv1.UserInfo{Username: "system:serviceaccount:ns:mcp", Groups: []string{"g"}}},
			want: authnv1.TokenReviewStatus{Authenticated: true, User: authnv1.UserInfo{Username: "system:serviceaccount:ns:mcp"}},
		},
		"refused": {
			in:   authnv1.TokenReviewStatus{Error: "token expired"},
			want: authnv1.TokenReviewStatus{Error: "token expired"},
		},
	} {
		t.Run(name, func(t *testing.T) {
			c := &reviewCache{max: 4, entries: map[[sha256.Size]byte]cachedReview{}}
			key := sha256.Sum256([]byte(name))
			c.put(key, tc.in, now.Add(time.Minute), now)
			got, ok := c.get(key, now)
			if !ok {
				t.Fatal("not cached")
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("cached review\n got %+v\nwant %+v", got, tc.want)
			}
		})
	}
}
