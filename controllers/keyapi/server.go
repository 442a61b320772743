package keyapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/controllers/policystream"
	"github.com/idemcp/idemcp/internal/claim"
	"github.com/idemcp/idemcp/internal/store"
)

// +kubebuilder:rbac:groups=authentication.k8s.io,resources=tokenreviews,verbs=create
// +kubebuilder:rbac:groups=authorization.k8s.io,resources=subjectaccessreviews,verbs=create
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// Server is the key API. Mount it with Routes.
type Server struct {
	// Client creates TokenReviews and SubjectAccessReviews.
	Client client.Client
	// APIReader reads policies and Secrets (uncached).
	APIReader client.Reader
	Recorder  events.EventRecorder
	// Stream reaches the sidecars of Memory stores; nil: those are not
	// reachable.
	Stream *policystream.Server
	// Timeout bounds one request's store or sidecar work (default 10s).
	Timeout time.Duration
}

// Routes adds the API's handlers to mux.
func (s *Server) Routes(mux *http.ServeMux) {
	base := PathPrefix + "{namespace}/idempotencypolicies/{name}/keys"
	mux.HandleFunc("GET "+base, s.handle(opList))
	mux.HandleFunc("GET "+base+"/{key}", s.handle(opShow))
	mux.HandleFunc("GET "+base+"/{key}/result", s.handle(opResult))
	mux.HandleFunc("POST "+base+"/{key}/release", s.handle(opRelease))
	mux.HandleFunc("POST "+base+"/{key}/forget", s.handle(opForget))
}

type op struct {
	name, verb, subresource string
}

var (
	opList    = op{"list", "list", SubresourceKeys}
	opShow    = op{"show", "get", SubresourceKeys}
	opResult  = op{"result", "get", SubresourceResults}
	opRelease = op{"release", "delete", SubresourceKeys}
	opForget  = op{"forget", "delete", SubresourceKeys}
)

// httpError is a refusal with its status.
type httpError struct {
	code int
	msg  string
}

func (e *httpError) Error() string { return e.msg }

func refuse(code int, format string, args ...any) error {
	return &httpError{code: code, msg: fmt.Sprintf(format, args...)}
}

func (s *Server) handle(o op) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		timeout := s.Timeout
		if timeout <= 0 {
			timeout = 10 * time.Second
		}
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		ns, name, key := r.PathValue("namespace"), r.PathValue("name"), r.PathValue("key")
		logger := log.FromContext(ctx).WithName("keys").WithValues("policy", klog.KRef(ns, name), "op", o.name)
		ctx = log.IntoContext(ctx, logger)
		v, err := s.serve(ctx, o, r, ns, name, key)
		if err != nil {
			var he *httpError
			if !errors.As(err, &he) {
				logger.Error(err, "Serving a key request failed")
				he = &httpError{code: http.StatusServiceUnavailable, msg: err.Error()}
			}
			if he.code == http.StatusServiceUnavailable {
				w.Header().Set("Retry-After", "1")
			}
			writeJSON(w, he.code, Error{Message: he.msg})
			return
		}
		writeJSON(w, http.StatusOK, v)
	}
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func (s *Server) serve(ctx context.Context, o op, r *http.Request, ns, name, key string) (any, error) {
	user, err := s.authenticate(ctx, r)
	if err != nil {
		return nil, err
	}
	if err := s.authorize(ctx, user, o, ns, name); err != nil {
		return nil, err
	}
	var p v1alpha1.IdempotencyPolicy
	if err := s.APIReader.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &p); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, refuse(http.StatusNotFound, "IdempotencyPolicy %s/%s not found (kubectl get idpol -n %s lists them)", ns, name, ns)
		}
		return nil, fmt.Errorf("reading IdempotencyPolicy %s/%s: %w", ns, name, err)
	}
	b, err := s.backend(ctx, &p)
	if err != nil {
		return nil, err
	}
	defer b.close()
	if o == opList {
		recs, notes, err := b.list(ctx)
		if err != nil {
			return nil, err
		}
		sortRecords(recs)
		return List{Namespace: ns, Policy: name, Store: string(p.Spec.Store.Type), Records: recs, Notes: notes}, nil
	}
	full, err := resolve(ctx, b, key)
	if err != nil {
		return nil, err
	}
	switch o {
	case opShow:
		rec, _, err := b.lookup(ctx, full, false)
		return rec, err
	case opResult:
		rec, resp, err := b.lookup(ctx, full, true)
		if err != nil {
			return nil, err
		}
		if !rec.Completed() {
			return nil, refuse(http.StatusConflict, "key %s is %s: it has no result yet", Short(full), rec.State)
		}
		log.FromContext(ctx).Info("Showed a stored result", "user", user.Username, "key", Short(full), "tool", rec.Tool)
		// The record holds the call's tracing trailer after the response
		// (a sidecar strips it too; one of an earlier release does not).
		return Result{Record: rec, Response: string(claim.StripTrace(resp))}, nil
	}
	d, verb := store.DropClaim, "released"
	if o == opForget {
		d, verb = store.DropResult, "forgot"
	}
	recs, notes, err := b.drop(ctx, full, d)
	if err != nil {
		return nil, err
	}
	tool, pods := recs[0].Tool, holders(recs)
	reason, action, what := "KeyReleased", "Release", "the next retry runs the tool"
	if o == opForget {
		reason, action, what = "KeyForgotten", "Forget", "the next identical call runs the tool"
	}
	where := ""
	if pods != "" {
		where = " in the sidecar of " + pods
	}
	// The Event is the audit trail a namespace's users can read: who,
	// which key, which tool.
	s.Recorder.Eventf(&p, nil, corev1.EventTypeNormal, reason, action, "%s %s key %s (tool %q)%s with kubectl idemcp keys: %s",
		user.Username, verb, Short(full), tool, where, what)
	log.FromContext(ctx).Info("Dropped a stored key", "user", user.Username, "key", full, "tool", tool, "holders", pods)
	return Change{Op: o.name, Records: recs, Notes: notes}, nil
}

// Completed reports whether r is a stored result.
func (r Record) Completed() bool { return r.State == string(store.StateCompleted) }

func holders(recs []Record) string {
	var h []string
	for _, r := range recs {
		if r.Holder != "" {
			h = append(h, r.Holder)
		}
	}
	return strings.Join(h, ", ")
}

func sortRecords(recs []Record) {
	sort.SliceStable(recs, func(i, j int) bool {
		if !recs[i].Claimed.Equal(recs[j].Claimed) {
			return recs[i].Claimed.After(recs[j].Claimed)
		}
		if recs[i].Key != recs[j].Key {
			return recs[i].Key < recs[j].Key
		}
		return recs[i].Holder < recs[j].Holder
	})
}

// resolve names the one key that starts with prefix.
func resolve(ctx context.Context, b backend, prefix string) (string, error) {
	prefix = strings.ToLower(prefix)
	if len(prefix) < MinKeyPrefix || strings.Trim(prefix, "0123456789abcdef") != "" {
		return "", refuse(http.StatusBadRequest, "KEY %q: want the key hash that kubectl idemcp keys list shows, at least %d hex digits", prefix, MinKeyPrefix)
	}
	recs, _, err := b.list(ctx)
	if err != nil {
		return "", err
	}
	found := map[string]bool{}
	for _, r := range recs {
		if strings.HasPrefix(r.Key, prefix) {
			found[r.Key] = true
		}
	}
	switch len(found) {
	case 0:
		return "", refuse(http.StatusNotFound, "no stored key starts with %s (it may have expired, or been released; kubectl idemcp keys list shows the keys)", prefix)
	case 1:
		for k := range found {
			return k, nil
		}
	}
	var keys []string
	for k := range found {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return "", refuse(http.StatusConflict, "%d keys start with %s: %s; give more of the hash", len(found), prefix, strings.Join(keys, ", "))
}

// user is who the API server says the token belongs to.
type user = authnv1.UserInfo

func (s *Server) authenticate(ctx context.Context, r *http.Request) (user, error) {
	h := r.Header.Get(TokenHeader)
	if h == "" {
		h = r.Header.Get("Authorization")
	}
	token, ok := strings.CutPrefix(h, "Bearer ")
	if !ok || strings.TrimSpace(token) == "" {
		return user{}, refuse(http.StatusUnauthorized, "no bearer token: the key API takes a token the API server accepts (kubectl idemcp keys sends your kubeconfig's); a kubeconfig user with a client certificate has none, use one with a token (OIDC, exec plugin or --token)")
	}
	// The API server's own audiences: a user's token, not a sidecar's
	// (audience idemcp), which may only read its policy.
	tr := &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: strings.TrimSpace(token)}}
	if err := s.Client.Create(ctx, tr); err != nil {
		return user{}, fmt.Errorf("reviewing the caller's token: %w", err)
	}
	if !tr.Status.Authenticated {
		return user{}, refuse(http.StatusUnauthorized, "the API server does not accept this token: %s", orText(tr.Status.Error, "not authenticated"))
	}
	return tr.Status.User, nil
}

func orText(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

func (s *Server) authorize(ctx context.Context, u user, o op, ns, name string) error {
	extra := map[string]authzv1.ExtraValue{}
	for k, v := range u.Extra {
		extra[k] = authzv1.ExtraValue(v)
	}
	sar := &authzv1.SubjectAccessReview{Spec: authzv1.SubjectAccessReviewSpec{
		User: u.Username, Groups: u.Groups, UID: u.UID, Extra: extra,
		ResourceAttributes: &authzv1.ResourceAttributes{
			Namespace: ns, Verb: o.verb, Group: v1alpha1.GroupVersion.Group, Version: v1alpha1.GroupVersion.Version,
			Resource: "idempotencypolicies", Subresource: o.subresource, Name: name,
		},
	}}
	if err := s.Client.Create(ctx, sar); err != nil {
		return fmt.Errorf("checking %s's permission: %w", u.Username, err)
	}
	if !sar.Status.Allowed {
		role := "the idemcp viewer role (view)"
		switch {
		case o.subresource == SubresourceResults:
			role = "the idemcp editor role (edit), since a result may hold what only the caller should read"
		case o.verb == "delete":
			role = "the idemcp editor role (edit)"
		}
		return refuse(http.StatusForbidden, "%s may not %s idempotencypolicies/%s of %s in namespace %s (RBAC verb %q on the subresource): ask for a role that grants it, such as %s",
			u.Username, o.verb, o.subresource, name, ns, o.verb, role)
	}
	return nil
}
