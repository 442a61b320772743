// Package policy compiles an IdempotencyPolicy spec into the rules a sidecar
// runs: defaults applied, every field checked, globs compiled once and the
// rule for each tool name resolved once.
package policy

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"regexp"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/sidecar/canonical"
)

// Defaults of an empty spec, as the CRD schema also declares them.
const (
	DefaultTTL            = 24 * time.Hour
	DefaultWaitTimeout    = 30 * time.Second
	DefaultLeaseDuration  = 30 * time.Second
	DefaultMaxResultBytes = 1 << 20
	DefaultPrincipal      = "Authorization"

	MinTTL = time.Second
	MaxTTL = 30 * 24 * time.Hour
)

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

// Rule is what applies to one tool.
type Rule struct {
	// Pattern is the name of the rule that matched, or "" for the defaults.
	Pattern         string
	Mode            v1alpha1.ToolMode
	TTL             time.Duration
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
// Session scope, Auto mode, 24h TTL.
func Default() *Policy {
	p, err := Compile(v1alpha1.IdempotencyPolicySpec{})
	if err != nil {
		panic(fmt.Sprintf("the empty policy does not compile: %v", err))
	}
	return p
}

// LoadFile reads an IdempotencyPolicy manifest (what users kubectl apply)
// and compiles its spec. Unknown fields are errors, so a typo is caught
// here rather than silently ignored.
func LoadFile(path string) (*Policy, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading policy file: %w", err)
	}
	return Parse(data)
}

// Parse compiles an IdempotencyPolicy manifest given as YAML or JSON.
func Parse(data []byte) (*Policy, error) {
	var obj v1alpha1.IdempotencyPolicy
	if err := yaml.UnmarshalStrict(data, &obj); err != nil {
		return nil, fmt.Errorf("policy does not parse: %w", err)
	}
	if obj.Kind != "" && obj.Kind != "IdempotencyPolicy" {
		return nil, fmt.Errorf("kind: %q is not IdempotencyPolicy", obj.Kind)
	}
	if obj.APIVersion != "" && obj.APIVersion != v1alpha1.GroupVersion.String() {
		return nil, fmt.Errorf("apiVersion: %q is not %s", obj.APIVersion, v1alpha1.GroupVersion)
	}
	p, err := Compile(obj.Spec)
	if err != nil {
		return nil, err
	}
	p.Name, p.Namespace = obj.Name, obj.Namespace
	return p, nil
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
		KeyScope:    spec.KeyScope,
		OnAbandoned: spec.OnAbandoned,
	}
	for _, tr := range spec.Tools {
		r := &Rule{
			Pattern:         tr.Name,
			Mode:            tr.Mode,
			TTL:             p.TTL,
			KeyScope:        spec.KeyScope,
			OnAbandoned:     spec.OnAbandoned,
			CacheToolErrors: tr.CacheToolErrors,
		}
		if tr.TTL != nil {
			r.TTL = tr.TTL.Duration
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
	oneOf("store.type", string(s.Store.Type), "Memory", "Redis")
	switch s.Store.Type {
	case v1alpha1.StoreMemory:
		if s.Store.Redis != nil {
			bad("store.redis", "type Memory takes no store.redis; set type: Redis or remove store.redis")
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
