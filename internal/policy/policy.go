// Package policy compiles an IdempotencyPolicy spec into the rules a sidecar
// runs: defaults applied, every field checked, globs compiled once and the
// rule for each tool name resolved once.
package policy

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/canonical"
	"github.com/idemcp/idemcp/internal/suggest"
)

// Defaults of an empty spec, as the CRD schema also declares them.
const (
	DefaultTTL            = 24 * time.Hour
	DefaultRetryWindow    = 10 * time.Minute
	DefaultWaitTimeout    = 30 * time.Second
	DefaultLeaseDuration  = 30 * time.Second
	DefaultMaxResultBytes = 1 << 20
	DefaultPrincipal      = "Authorization"

	MinTTL = time.Second
	MaxTTL = 30 * 24 * time.Hour
)

// RedisKeyPrefix is the prefix of a policy's records in Redis. The webhook
// gives it to every sidecar it injects for the policy; a sidecar run by
// hand adds its upstream to it (see the sidecar's --redis-key-prefix).
func RedisKeyPrefix(namespace, name string) string {
	if namespace == "" {
		namespace = "default"
	}
	if name == "" {
		name = "default"
	}
	return "idemcp:" + namespace + "/" + name + ":"
}

// maxCachedTools bounds the per-name rule cache: tool names come from
// clients, so an unbounded cache would be a memory leak on demand.
const maxCachedTools = 4096

// Policy is a compiled, immutable IdempotencyPolicy spec. A sidecar swaps
// whole Policies atomically when the policy changes.
type Policy struct {
	// Name and Namespace of the IdempotencyPolicy, when known; they scope
	// the keys of a shared store.
	Name      string
	Namespace string

	Spec               v1alpha1.IdempotencyPolicySpec // with defaults applied
	TTL                time.Duration
	RetryWindow        time.Duration
	WaitTimeout        time.Duration
	LeaseDuration      time.Duration
	MaxResultBytes     int64
	OnStoreUnavailable v1alpha1.StoreUnavailableAction
	InFlight           v1alpha1.InFlightAction
	PrincipalHeader    string
	// Hash is a stable hash of the spec with defaults applied: two specs
	// that behave the same have the same hash.
	Hash string

	rules    []compiledRule
	fallback *Rule

	mu    sync.RWMutex
	cache map[string]*Rule
}

// Rule is what applies to one tool. TTL is how long a result is kept for
// an explicit key; RetryWindow, for a derived one (at most TTL).
type Rule struct {
	// Pattern is the name of the rule that matched, or "" for the defaults.
	Pattern         string
	Mode            v1alpha1.ToolMode
	TTL             time.Duration
	RetryWindow     time.Duration
	KeyScope        v1alpha1.KeyScope
	OnAbandoned     v1alpha1.AbandonedAction
	CacheToolErrors bool
	IgnoreArguments []canonical.Pointer
}

type compiledRule struct {
	literal string
	re      *regexp.Regexp
	rule    *Rule
}

func (c *compiledRule) match(name string) bool {
	if c.re == nil {
		return c.literal == name
	}
	return c.re.MatchString(name)
}

// RuleFor returns the rule for a tool: the first rule whose name matches,
// else the policy's defaults.
func (p *Policy) RuleFor(tool string) *Rule {
	p.mu.RLock()
	r, ok := p.cache[tool]
	p.mu.RUnlock()
	if ok {
		return r
	}
	r = p.fallback
	for i := range p.rules {
		if p.rules[i].match(tool) {
			r = p.rules[i].rule
			break
		}
	}
	p.mu.Lock()
	if len(p.cache) >= maxCachedTools {
		clear(p.cache)
	}
	p.cache[tool] = r
	p.mu.Unlock()
	return r
}

// Default is the policy of a sidecar given no policy: Memory store,
// Session scope, Auto mode, 24h TTL, 10m retry window.
func Default() *Policy {
	p, err := Compile(v1alpha1.IdempotencyPolicySpec{})
	if err != nil {
		panic(fmt.Sprintf("the empty policy does not compile: %v", err))
	}
	return p
}

// LoadFile reads an IdempotencyPolicy manifest (what users kubectl apply)
// and compiles its spec. Unknown fields are errors, so a typo is caught
// here rather than silently ignored (see Parse).
func LoadFile(path string) (*Policy, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading policy file: %w", err)
	}
	return Parse(data)
}

// Parse compiles an IdempotencyPolicy manifest given as YAML or JSON.
// Every problem is reported at once, each with its path in the manifest:
// unknown fields (with the field that was probably meant), fields of spec
// written without the spec: wrapper, and every invalid value of the spec.
func Parse(data []byte) (*Policy, error) {
	j, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return nil, fmt.Errorf("policy does not parse: %w", err)
	}
	j = bytes.TrimSpace(j)
	if len(j) == 0 || string(j) == "null" {
		return nil, errors.New("the policy is empty; write an IdempotencyPolicy manifest: apiVersion: " + v1alpha1.GroupVersion.String() + ", kind: IdempotencyPolicy and its settings under spec:, " + example)
	}
	if j[0] != '{' {
		return nil, fmt.Errorf("the policy is %s, not a mapping; write an IdempotencyPolicy manifest: apiVersion: %s, kind: IdempotencyPolicy and its settings under spec:, %s", jsonKind(j[0]), v1alpha1.GroupVersion, example)
	}
	var obj v1alpha1.IdempotencyPolicy
	strict, err := sigsjson.UnmarshalStrict(j, &obj)
	if err != nil {
		return nil, fmt.Errorf("policy does not parse: %w", typeError(err))
	}
	var errs, misplaced []string
	for _, se := range strict {
		var fe sigsjson.FieldError
		if !errors.As(se, &fe) {
			errs = append(errs, se.Error())
			continue
		}
		path := fe.FieldPath()
		if !strings.HasPrefix(se.Error(), "unknown field") {
			errs = append(errs, path+": is given twice")
			continue
		}
		if !strings.ContainsAny(path, ".[") && slices.Contains(fieldsAt(reflect.TypeFor[v1alpha1.IdempotencyPolicySpec](), ""), path) {
			misplaced = append(misplaced, path)
			continue
		}
		msg := path + ": unknown field"
		if s := suggest.Closest(lastName(path), fieldsAt(reflect.TypeFor[v1alpha1.IdempotencyPolicy](), parentPath(path))); s != "" {
			msg += fmt.Sprintf("; did you mean %q?", s)
		}
		errs = append(errs, msg)
	}
	if len(misplaced) > 0 {
		errs = append([]string{fmt.Sprintf("%s: fields of spec written at the top of the manifest; put them under spec: (apiVersion: %s, kind: IdempotencyPolicy, spec: {%s: ...})",
			strings.Join(misplaced, ", "), v1alpha1.GroupVersion, misplaced[0])}, errs...)
	}
	if obj.Kind != "" && obj.Kind != "IdempotencyPolicy" {
		errs = append(errs, fmt.Sprintf("kind: %q is not IdempotencyPolicy", obj.Kind))
	}
	if obj.APIVersion != "" && obj.APIVersion != v1alpha1.GroupVersion.String() {
		errs = append(errs, fmt.Sprintf("apiVersion: %q is not %s", obj.APIVersion, v1alpha1.GroupVersion))
	}
	p, err := Compile(obj.Spec)
	if err != nil {
		errs = append(errs, strings.Split(err.Error(), "\n")...)
	}
	if len(errs) > 0 {
		return nil, problems(errs)
	}
	p.Name, p.Namespace = obj.Name, obj.Namespace
	return p, nil
}

const example = `for example spec: {ttl: 24h, tools: [{name: "charge_*", mode: Deduplicate}]}; see config/samples`

// problems is every problem of a policy, one per line when there are
// several.
type problems []string

func (p problems) Error() string {
	if len(p) == 1 {
		return p[0]
	}
	return fmt.Sprintf("%d problems:\n  %s", len(p), strings.Join(p, "\n  "))
}

func jsonKind(first byte) string {
	switch first {
	case '[':
		return "a list"
	case '"':
		return "a string"
	default:
		return "a single value"
	}
}

var typeErr = regexp.MustCompile(`cannot unmarshal (\w+) into Go struct field \w+\.(\S+) of type (\S+)`)

// typeError says in the manifest's terms which field has a value of the
// wrong kind.
func typeError(err error) error {
	m := typeErr.FindStringSubmatch(err.Error())
	if m == nil {
		return err
	}
	want := "a " + m[3]
	switch {
	case strings.HasPrefix(m[3], "[]"):
		want = "a list"
	case strings.HasPrefix(m[3], "map[") || strings.HasPrefix(m[3], "v1alpha1.") || strings.HasPrefix(m[3], "*v1alpha1."):
		want = "a mapping"
	case m[3] == "bool":
		want = "true or false"
	case strings.HasPrefix(m[3], "int") || strings.HasPrefix(m[3], "uint"):
		want = "a whole number"
	}
	if strings.HasPrefix(m[3], "v1alpha1.") && !strings.Contains(m[3], "Spec") && !strings.Contains(m[3], "Config") {
		want = "a string" // the enums: ToolMode, KeyScope, ...
	}
	got := m[1]
	if got == "object" {
		got = "mapping" // YAML's word for it
	}
	return fmt.Errorf("%s: got %s %s, want %s", m[2], article(got), got, want)
}

func article(word string) string {
	if strings.ContainsRune("aeiou", rune(word[0])) {
		return "an"
	}
	return "a"
}

func parentPath(path string) string {
	if i := strings.LastIndex(path, "."); i >= 0 {
		return path[:i]
	}
	return ""
}

func lastName(path string) string {
	return path[strings.LastIndex(path, ".")+1:]
}

// fieldsAt lists the JSON names of the fields of the object at path (such
// as spec.tools[1]) in a value of type t, for "did you mean" hints.
func fieldsAt(t reflect.Type, path string) []string {
	for _, name := range strings.Split(path, ".") {
		if name == "" {
			continue
		}
		name, _, _ = strings.Cut(name, "[")
		t = fieldType(deref(t), name)
		if t == nil {
			return nil
		}
		for t = deref(t); t.Kind() == reflect.Slice || t.Kind() == reflect.Map; t = deref(t.Elem()) {
		}
	}
	var names []string
	collectFields(deref(t), &names)
	return names
}

func deref(t reflect.Type) reflect.Type {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t
}

func jsonName(f reflect.StructField) (name string, inline bool) {
	tag := f.Tag.Get("json")
	name, opts, _ := strings.Cut(tag, ",")
	if tag == "-" {
		return "", false
	}
	return name, f.Anonymous || strings.Contains(opts, "inline")
}

func fieldType(t reflect.Type, name string) reflect.Type {
	if t.Kind() != reflect.Struct {
		return nil
	}
	for i := range t.NumField() {
		f := t.Field(i)
		n, inline := jsonName(f)
		if n == name && n != "" {
			return f.Type
		}
		if inline && n == "" {
			if ft := fieldType(deref(f.Type), name); ft != nil {
				return ft
			}
		}
	}
	return nil
}

func collectFields(t reflect.Type, names *[]string) {
	if t.Kind() != reflect.Struct {
		return
	}
	for i := range t.NumField() {
		f := t.Field(i)
		n, inline := jsonName(f)
		switch {
		case inline && n == "":
			collectFields(deref(f.Type), names)
		case n != "":
			*names = append(*names, n)
		}
	}
}

// Compile applies defaults to a spec, validates it and compiles its rules.
// Errors name the field, as kubectl apply would.
func Compile(spec v1alpha1.IdempotencyPolicySpec) (*Policy, error) {
	spec = *spec.DeepCopy()
	applyDefaults(&spec)
	if err := validate(&spec); err != nil {
		return nil, err
	}
	p := &Policy{
		Spec:               spec,
		TTL:                spec.TTL.Duration,
		RetryWindow:        retryWindow(spec.RetryWindow, spec.TTL.Duration),
		WaitTimeout:        spec.WaitTimeout.Duration,
		LeaseDuration:      spec.LeaseDuration.Duration,
		MaxResultBytes:     spec.MaxResultBytes.Value(),
		OnStoreUnavailable: spec.OnStoreUnavailable,
		InFlight:           spec.InFlight,
		PrincipalHeader:    http.CanonicalHeaderKey(spec.PrincipalHeader),
		cache:              make(map[string]*Rule),
	}
	p.fallback = &Rule{
		Mode:        spec.DefaultMode,
		TTL:         p.TTL,
		RetryWindow: p.RetryWindow,
		KeyScope:    spec.KeyScope,
		OnAbandoned: spec.OnAbandoned,
	}
	for _, tr := range spec.Tools {
		r := &Rule{
			Pattern:         tr.Name,
			Mode:            tr.Mode,
			TTL:             p.TTL,
			RetryWindow:     p.RetryWindow,
			KeyScope:        spec.KeyScope,
			OnAbandoned:     spec.OnAbandoned,
			CacheToolErrors: tr.CacheToolErrors,
		}
		if tr.TTL != nil {
			r.TTL = tr.TTL.Duration
		}
		// An inherited window (spec.retryWindow, or 10m) is capped at the
		// rule's own ttl.
		r.RetryWindow = retryWindow(spec.RetryWindow, r.TTL)
		if tr.RetryWindow != nil {
			r.RetryWindow = tr.RetryWindow.Duration
		}
		if tr.KeyScope != "" {
			r.KeyScope = tr.KeyScope
		}
		if tr.OnAbandoned != "" {
			r.OnAbandoned = tr.OnAbandoned
		}
		for _, s := range tr.IgnoreArguments {
			ptr, _ := canonical.ParsePointer(s) // validated above
			r.IgnoreArguments = append(r.IgnoreArguments, ptr)
		}
		cr := compiledRule{literal: tr.Name, rule: r}
		if strings.ContainsAny(tr.Name, "*?") {
			cr.re = globRegexp(tr.Name)
		}
		p.rules = append(p.rules, cr)
	}
	canon, err := json.Marshal(spec)
	if err != nil {
		return nil, fmt.Errorf("hashing policy: %w", err)
	}
	sum := sha256.Sum256(canon)
	p.Hash = hex.EncodeToString(sum[:8])
	return p, nil
}

func globRegexp(glob string) *regexp.Regexp {
	var b strings.Builder
	b.WriteString("^")
	for _, r := range glob {
		switch r {
		case '*':
			b.WriteString(".*")
		case '?':
			b.WriteString(".")
		default:
			b.WriteString(regexp.QuoteMeta(string(r)))
		}
	}
	b.WriteString("$")
	return regexp.MustCompile(b.String())
}

func applyDefaults(s *v1alpha1.IdempotencyPolicySpec) {
	if s.TTL == nil {
		s.TTL = &metav1.Duration{Duration: DefaultTTL}
	}
	if s.Store.Type == "" {
		s.Store.Type = v1alpha1.StoreMemory
	}
	if s.OnStoreUnavailable == "" {
		s.OnStoreUnavailable = v1alpha1.FailClosed
	}
	if s.KeyScope == "" {
		s.KeyScope = v1alpha1.ScopeSession
	}
	if s.PrincipalHeader == "" {
		s.PrincipalHeader = DefaultPrincipal
	}
	if s.InFlight == "" {
		s.InFlight = v1alpha1.InFlightWait
	}
	if s.WaitTimeout == nil {
		s.WaitTimeout = &metav1.Duration{Duration: DefaultWaitTimeout}
	}
	if s.LeaseDuration == nil {
		s.LeaseDuration = &metav1.Duration{Duration: DefaultLeaseDuration}
	}
	if s.OnAbandoned == "" {
		s.OnAbandoned = v1alpha1.AbandonedRetry
	}
	if s.MaxResultBytes == nil {
		q := resource.MustParse("1Mi")
		s.MaxResultBytes = &q
	}
	if s.DefaultMode == "" {
		s.DefaultMode = v1alpha1.ModeAuto
	}
	for i := range s.Tools {
		if s.Tools[i].Mode == "" {
			s.Tools[i].Mode = v1alpha1.ModeDeduplicate
		}
	}
}

var toolName = regexp.MustCompile(`^[A-Za-z0-9_./*?-]+$`)

var headerName = regexp.MustCompile(`^[A-Za-z0-9!#$%&'*+.^_|~-]+$`)

func validate(s *v1alpha1.IdempotencyPolicySpec) error {
	var errs []error
	bad := func(field string, format string, args ...any) {
		errs = append(errs, fmt.Errorf("spec.%s: %s", field, fmt.Sprintf(format, args...)))
	}
	oneOf := func(field, got string, allowed ...string) {
		for _, a := range allowed {
			if got == a {
				return
			}
		}
		bad(field, "%q is not one of %s", got, strings.Join(allowed, ", "))
	}
	ttl := func(field string, d time.Duration) {
		if d < MinTTL || d > MaxTTL {
			bad(field, "%s is outside 1s..720h (30d)", d)
		}
	}
	ttl("ttl", s.TTL.Duration)
	if s.RetryWindow != nil {
		ttl("retryWindow", s.RetryWindow.Duration)
		if s.RetryWindow.Duration > s.TTL.Duration {
			bad("retryWindow", "%s is longer than spec.ttl (%s): a derived key cannot be kept longer than an explicit one; shorten retryWindow or lengthen ttl", s.RetryWindow.Duration, s.TTL.Duration)
		}
	}
	oneOf("store.type", string(s.Store.Type), "Memory", "Redis", "Postgres")
	if s.Store.Postgres != nil && s.Store.Type != v1alpha1.StorePostgres {
		bad("store.postgres", "goes only with type Postgres; set type: Postgres or remove store.postgres")
	}
	switch s.Store.Type {
	case v1alpha1.StoreMemory:
		if s.Store.Redis != nil {
			bad("store.redis", "type Memory takes no store.redis; set type: Redis or remove store.redis")
		}
	case v1alpha1.StorePostgres:
		// The URL holds a password, so it never is in the policy: a sidecar
		// gets it from a Secret (store.postgres.urlSecretRef, which the
		// CRD requires) or from --postgres-url.
		if s.Store.Redis != nil {
			bad("store.redis", "type Postgres takes no store.redis; remove store.redis")
		}
		if pg := s.Store.Postgres; pg != nil && (pg.URLSecretRef.Name == "" || pg.URLSecretRef.Key == "") {
			bad("store.postgres.urlSecretRef", "needs the name and key of the Secret holding the connection string")
		}
	case v1alpha1.StoreRedis:
		r := s.Store.Redis
		if r == nil || (r.Managed == nil) == (r.External == nil) {
			bad("store.redis", "type Redis needs exactly one of store.redis.managed or store.redis.external")
		} else if r.External != nil {
			if len(r.External.Addresses) == 0 {
				bad("store.redis.external.addresses", "needs at least one host:port")
			}
			for i, a := range r.External.Addresses {
				if _, port, err := net.SplitHostPort(a); err != nil || port == "" {
					bad(fmt.Sprintf("store.redis.external.addresses[%d]", i), "%q is not host:port, such as redis.shop.svc:6379", a)
				}
			}
			if n := r.External.MinReplicas; n < 0 || n > 16 {
				bad("store.redis.external.minReplicas", "%d is outside 0..16", n)
			}
			if t := r.External.MinReplicasTimeout; t != nil {
				if r.External.MinReplicas <= 0 {
					bad("store.redis.external.minReplicasTimeout", "bounds the wait for minReplicas: set minReplicas above 0, or remove minReplicasTimeout")
				} else if t.Duration < 10*time.Millisecond || t.Duration > 30*time.Second {
					bad("store.redis.external.minReplicasTimeout", "%s is outside 10ms..30s", t.Duration)
				}
			}
		}
	}
	oneOf("onStoreUnavailable", string(s.OnStoreUnavailable), "FailClosed", "FailOpen")
	oneOf("keyScope", string(s.KeyScope), "Session", "Principal", "Global")
	if !headerName.MatchString(s.PrincipalHeader) {
		bad("principalHeader", "%q is not an HTTP header name", s.PrincipalHeader)
	}
	oneOf("inFlight", string(s.InFlight), "Wait", "Reject")
	if d := s.WaitTimeout.Duration; d < 0 || d > time.Hour {
		bad("waitTimeout", "%s is outside 0s..1h", d)
	}
	if d := s.LeaseDuration.Duration; d < time.Second || d > time.Hour {
		bad("leaseDuration", "%s is outside 1s..1h", d)
	}
	oneOf("onAbandoned", string(s.OnAbandoned), "Retry", "Error")
	if s.MaxResultBytes.Sign() <= 0 || s.MaxResultBytes.Cmp(resource.MustParse("64Mi")) > 0 {
		bad("maxResultBytes", "%s must be more than 0 and at most 64Mi, such as 1Mi", s.MaxResultBytes.String())
	}
	oneOf("defaultMode", string(s.DefaultMode), "Auto", "Deduplicate", "Passthrough")
	seen := map[string]int{}
	for i, t := range s.Tools {
		f := fmt.Sprintf("tools[%d]", i)
		if t.Name == "" {
			bad(f+".name", "is empty; give a tool name or a glob such as charge_*")
		} else if !toolName.MatchString(t.Name) {
			bad(f+".name", "%q must be a tool name or a glob of letters, digits, _ - . / and the wildcards * and ?", t.Name)
		} else if j, dup := seen[t.Name]; dup {
			bad(f+".name", "%q is already the name of tools[%d]; rule names must be unique", t.Name, j)
		}
		seen[t.Name] = i
		oneOf(f+".mode", string(t.Mode), "Auto", "Deduplicate", "Passthrough")
		if t.TTL != nil {
			ttl(f+".ttl", t.TTL.Duration)
		}
		if t.RetryWindow != nil {
			ttl(f+".retryWindow", t.RetryWindow.Duration)
		}
		if t.RetryWindow != nil {
			d, from := s.TTL.Duration, "from spec.ttl"
			if t.TTL != nil {
				d, from = t.TTL.Duration, "its own"
			}
			if t.RetryWindow.Duration > d {
				bad(f+".retryWindow", "%s is longer than the rule's ttl (%s, %s); give the rule a retryWindow of at most its ttl", t.RetryWindow.Duration, d, from)
			}
		}
		if t.KeyScope != "" {
			oneOf(f+".keyScope", string(t.KeyScope), "Session", "Principal", "Global")
		}
		if t.OnAbandoned != "" {
			oneOf(f+".onAbandoned", string(t.OnAbandoned), "Retry", "Error")
		}
		for j, ptr := range t.IgnoreArguments {
			if _, err := canonical.ParsePointer(ptr); err != nil {
				bad(fmt.Sprintf("%s.ignoreArguments[%d]", f, j), "%v", err)
			}
		}
	}
	return errors.Join(errs...)
}

// retryWindow is spec.retryWindow, or by default DefaultRetryWindow, capped
// at ttl: a policy or rule with a short ttl needs no window of its own (an
// explicit spec.retryWindow is at most spec.ttl, validated).
func retryWindow(w *metav1.Duration, ttl time.Duration) time.Duration {
	if w != nil {
		return min(w.Duration, ttl)
	}
	return min(DefaultRetryWindow, ttl)
}

// LongestTTL is the longest time a result of this policy is kept: its TTL
// or a tool rule's, whichever is longer.
func (p *Policy) LongestTTL() time.Duration {
	d := p.TTL
	for _, r := range p.rules {
		d = max(d, r.rule.TTL)
	}
	if p.fallback != nil {
		d = max(d, p.fallback.TTL)
	}
	return d
}
