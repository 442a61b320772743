package policystream

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/policywire"
)

// Extra keys of a TokenReview of a token bound to a pod.
const (
	extraPodName = "authentication.kubernetes.io/pod-name"
	extraPodUID  = "authentication.kubernetes.io/pod-uid"
)

// refusal is an answer that carries no data: 401 or 403 and why, or 503
// and when to come back.
type refusal struct {
	code       int
	why        string
	retryAfter int // seconds, for a 503
}

func (r *refusal) Error() string { return r.why }

func unauthorized(format string, a ...any) error {
	return &refusal{code: http.StatusUnauthorized, why: fmt.Sprintf(format, a...)}
}

func forbidden(format string, a ...any) error {
	return &refusal{code: http.StatusForbidden, why: fmt.Sprintf(format, a...)}
}

// caller is a sidecar whose token the API server vouched for.
type caller struct {
	pod     string
	uid     string
	expires time.Time
	// ticket is the review ticket to hand back ("" for none).
	ticket string
}

// authorize admits a caller only if its token, reviewed by the API server
// for the audience idemcp, is bound to a pod that exists (same UID), lives
// in the policy's namespace and carries the idemcp.io/policy label naming
// the policy. A *refusal error says what to answer; any other error is the
// manager's own trouble (503).
func (s *Server) authorize(ctx context.Context, r *http.Request, namespace, name string) (*caller, error) {
	token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || token == "" {
		return nil, unauthorized("no Bearer token: send the pod's projected service account token (audience %s)", policywire.TokenAudience)
	}
	// The API server accepts a token up to a minute past its exp (clock
	// skew leeway); the stream, which would end at exp at once, does not.
	// Refusing on the unverified claim costs nobody but its bearer.
	if exp := tokenExpiry(token); !exp.IsZero() && !time.Now().Before(exp) {
		return nil, unauthorized("the token expired at %s: send the kubelet's current one", exp.UTC().Format(time.RFC3339))
	}
	st, ticketed := s.fromTicket(ctx, r, token)
	if !ticketed {
		var err error
		if st, err = s.review(ctx, token); err != nil {
			return nil, err
		}
	}
	if !st.Authenticated {
		return nil, unauthorized("the token is not valid for audience %s: %s", policywire.TokenAudience, st.Error)
	}
	if !slices.Contains(st.Audiences, policywire.TokenAudience) {
		return nil, unauthorized("the token is not for audience %s", policywire.TokenAudience)
	}
	podNames, podUIDs := st.User.Extra[extraPodName], st.User.Extra[extraPodUID]
	if len(podNames) != 1 || len(podUIDs) != 1 {
		return nil, forbidden("the token of %s is not bound to a pod", st.User.Username)
	}
	saNamespace, _, ok := serviceAccount(st.User.Username)
	if !ok {
		return nil, forbidden("%s is not a service account", st.User.Username)
	}
	if saNamespace != namespace {
		return nil, forbidden("pod %s/%s may not read policies of namespace %s", saNamespace, podNames[0], namespace)
	}
	var pod corev1.Pod
	key := client.ObjectKey{Namespace: saNamespace, Name: podNames[0]}
	err := s.pods.Get(ctx, key, &pod)
	if apierrors.IsNotFound(err) && !ticketed {
		// The cache may not have seen a pod that started a moment ago. A
		// ticket's pod was there when a replica issued it, and this one's
		// cache was synced before it served: asking the API server again
		// would give whoever replays an old ticket an unthrottled GET.
		err = s.apiReader.Get(ctx, key, &pod)
	}
	switch {
	case apierrors.IsNotFound(err):
		return nil, forbidden("pod %s does not exist", key)
	case err != nil:
		return nil, fmt.Errorf("reading pod %s: %w", key, err)
	}
	if string(pod.UID) != podUIDs[0] || pod.DeletionTimestamp != nil {
		return nil, forbidden("pod %s the token is bound to is gone", key)
	}
	if got := pod.Labels[v1alpha1.LabelPolicy]; got != name {
		return nil, forbidden("pod %s is labelled %s=%q, not %q", key, v1alpha1.LabelPolicy, got, name)
	}
	who := &caller{pod: pod.Name, uid: string(pod.UID), expires: tokenExpiry(token)}
	if c, ok := claimsOf(st, token, time.Now()); ok && s.ticketKey != nil {
		if k, err := s.ticketKey(); err == nil {
			who.ticket = issueTicket(k, token, c)
		}
	}
	return who, nil
}

// fromTicket returns the review that r's review ticket stands for, if it
// has a valid one for token. A ticket refused is logged and counted; the
// caller then reviews the token.
func (s *Server) fromTicket(ctx context.Context, r *http.Request, token string) (authnv1.TokenReviewStatus, bool) {
	t := r.Header.Get(policywire.ReviewTicketHeader)
	if t == "" || s.ticketKey == nil {
		return authnv1.TokenReviewStatus{}, false
	}
	key, err := s.ticketKey()
	if err == nil {
		var st authnv1.TokenReviewStatus
		if st, err = openTicket(key, t, token, time.Now()); err == nil {
			tokenReviews.WithLabelValues(reviewTicket).Inc()
			return st, true
		}
	}
	tokenReviews.WithLabelValues(reviewTicketRefused).Inc()
	log.FromContext(ctx).V(1).Info("Refused a review ticket, reviewing the token instead", "reason", err.Error(), "remote", r.RemoteAddr, "path", r.URL.Path)
	return authnv1.TokenReviewStatus{}, false
}

// serviceAccount splits system:serviceaccount:NAMESPACE:NAME.
func serviceAccount(user string) (namespace, name string, ok bool) {
	rest, ok := strings.CutPrefix(user, "system:serviceaccount:")
	if !ok {
		return "", "", false
	}
	namespace, name, ok = strings.Cut(rest, ":")
	return namespace, name, ok && namespace != "" && name != ""
}

// tokenExpiry reads the exp claim of a token the API server has just
// accepted, so the stream ends when the token does and the sidecar comes
// back with the kubelet's fresh one. Zero when there is none.
func tokenExpiry(token string) time.Time {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return time.Time{}
	}
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return time.Time{}
	}
	var claims struct {
		Exp int64 `json:"exp"`
	}
	if json.Unmarshal(payload, &claims) != nil || claims.Exp == 0 {
		return time.Time{}
	}
	return time.Unix(claims.Exp, 0)
}

func refusalOf(err error) (*refusal, bool) {
	var r *refusal
	ok := errors.As(err, &r)
	return r, ok
}

// Results of the TokenReviews behind the policy stream, for the metric.
const (
	reviewCached  = "cached"
	reviewCreated = "reviewed"
	reviewLimited = "limited"
	// reviewTicket: a review ticket stood for the review.
	reviewTicket = "ticket"
	// reviewTicketRefused: a review ticket was refused (forged, expired,
	// for another token, or signed with a serving key since replaced).
	reviewTicketRefused = "ticket_refused"
)

var tokenReviews = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "idemcp_policy_stream_token_reviews_total",
	Help: "Tokens presented to the policy stream, by how they were checked: reviewed (a TokenReview), cached (the result of an earlier one), limited (refused with 503: too many TokenReviews at once), ticket (a review ticket from a manager replica stood for the review), ticket_refused (a review ticket was refused; the token was reviewed instead).",
}, []string{"result"})

func init() { metrics.Registry.MustRegister(tokenReviews) }

// reviewCache remembers TokenReview results by the token's hash: a
// sidecar that reconnects (and a caller that retries a refused token)
// costs no TokenReview for a while. An accepted token is remembered for
// the TTL but never past its own expiry; a refused one for a few seconds.
// The pod checks that follow a review are made every time.
type reviewCache struct {
	mu      sync.Mutex
	max     int
	entries map[[sha256.Size]byte]cachedReview
}

// cachedReview is what authorize reads of a review: the groups and the
// other extra keys the API server adds (credential id, node) are not
// kept, nor the map of them, which took as much again in every entry.
type cachedReview struct {
	authenticated   bool
	err, username   string
	audiences       []string
	podName, podUID authnv1.ExtraValue // as the review had them: authorize wants exactly one
	until           time.Time
}

func cachedOf(st authnv1.TokenReviewStatus, until time.Time) cachedReview {
	return cachedReview{authenticated: st.Authenticated, err: st.Error, username: st.User.Username, audiences: st.Audiences,
		podName: st.User.Extra[extraPodName], podUID: st.User.Extra[extraPodUID], until: until}
}

func (e cachedReview) status() authnv1.TokenReviewStatus {
	st := authnv1.TokenReviewStatus{Authenticated: e.authenticated, Error: e.err, Audiences: e.audiences,
		User: authnv1.UserInfo{Username: e.username}}
	if e.podName != nil || e.podUID != nil {
		st.User.Extra = map[string]authnv1.ExtraValue{}
		if e.podName != nil {
			st.User.Extra[extraPodName] = e.podName
		}
		if e.podUID != nil {
			st.User.Extra[extraPodUID] = e.podUID
		}
	}
	return st
}

// refusedReviewTTL is how long a refused token's review is remembered.
const refusedReviewTTL = 5 * time.Second

func (c *reviewCache) get(key [sha256.Size]byte, now time.Time) (authnv1.TokenReviewStatus, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.entries[key]
	if !ok || !now.Before(e.until) {
		return authnv1.TokenReviewStatus{}, false
	}
	return e.status(), true
}

func (c *reviewCache) put(key [sha256.Size]byte, st authnv1.TokenReviewStatus, until, now time.Time) {
	if !now.Before(until) || c.max <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.entries) >= c.max {
		for k, e := range c.entries {
			if !now.Before(e.until) {
				delete(c.entries, k)
			}
		}
		// Still full: drop one at random (map order); bounded memory
		// matters more than one more TokenReview.
		for k := range c.entries {
			if len(c.entries) < c.max {
				break
			}
			delete(c.entries, k)
		}
	}
	c.entries[key] = cachedOf(st, until)
}

// review returns the API server's TokenReview of token for the audience
// idemcp, from the cache if it is there; new reviews are rate-limited, and
// a caller that would wait too long is told to come back (503).
func (s *Server) review(ctx context.Context, token string) (authnv1.TokenReviewStatus, error) {
	key := sha256.Sum256([]byte(token))
	now := time.Now()
	if st, ok := s.reviews.get(key, now); ok {
		tokenReviews.WithLabelValues(reviewCached).Inc()
		return st, nil
	}
	wait, cancel := context.WithTimeout(ctx, s.opts.TokenReviewWait)
	defer cancel()
	if err := s.reviewLimit.Wait(wait); err != nil {
		tokenReviews.WithLabelValues(reviewLimited).Inc()
		return authnv1.TokenReviewStatus{}, &refusal{code: http.StatusServiceUnavailable, retryAfter: 2,
			why: fmt.Sprintf("the manager is checking too many tokens now (at most %g TokenReviews a second); retry", float64(s.reviewLimit.Limit()))}
	}
	review := &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: token, Audiences: []string{policywire.TokenAudience}}}
	if err := s.client.Create(ctx, review); err != nil {
		return authnv1.TokenReviewStatus{}, fmt.Errorf("reviewing the caller's token: %w", err)
	}
	tokenReviews.WithLabelValues(reviewCreated).Inc()
	until := now.Add(refusedReviewTTL)
	if review.Status.Authenticated {
		until = now.Add(s.opts.TokenReviewTTL)
		if exp := tokenExpiry(token); !exp.IsZero() && exp.Before(until) {
			until = exp
		}
	}
	s.reviews.put(key, review.Status, until, now)
	return review.Status, nil
}
