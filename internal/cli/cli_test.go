package cli

import (
	"bytes"
	"errors"
	"flag"
	"strings"
	"testing"
	"time"
)

func newSet(t *testing.T) (*Set, *struct {
	d     time.Duration
	b     bool
	n     int64
	s     string
	store string
}) {
	t.Helper()
	v := &struct {
		d     time.Duration
		b     bool
		n     int64
		s     string
		store string
	}{}
	s := New("idemcp test", "Usage: idemcp test")
	s.DurationVar(&v.d, "shutdown-timeout", 30*time.Second, "how long")
	s.BoolVar(&v.b, "redis-tls", false, "TLS")
	s.Int64Var(&v.n, "max-body-bytes", 10, "largest body")
	s.StringVar(&v.s, "admin-listen", "127.0.0.1:9091", "admin address")
	s.Var(Choice(&v.store, "", "memory", "redis"), "store", "the store")
	s.BindEnv("IDEMCP_")
	return s, v
}

func TestEnvironment(t *testing.T) {
	t.Setenv("IDEMCP_SHUTDOWN_TIMEOUT", "5s")
	t.Setenv("IDEMCP_REDIS_TLS", "true")
	t.Setenv("IDEMCP_ADMIN_LISTEN", "")   // an empty string value turns it off
	t.Setenv("IDEMCP_MAX_BODY_BYTES", "") // an empty number is unset
	t.Setenv("IDEMCP_STORE", "Redis")
	s, v := newSet(t)
	if err := s.Parse([]string{"--shutdown-timeout=1m"}); err != nil {
		t.Fatal(err)
	}
	if v.d != time.Minute || !v.b || v.s != "" || v.n != 10 || v.store != "redis" {
		t.Errorf("values %+v; want the flag over the variable, the variables read, empty numbers ignored", *v)
	}
	if s.Source("shutdown-timeout") != "--shutdown-timeout" || s.Source("redis-tls") != "IDEMCP_REDIS_TLS" || s.Source("max-body-bytes") != "" {
		t.Errorf("sources %q %q %q", s.Source("shutdown-timeout"), s.Source("redis-tls"), s.Source("max-body-bytes"))
	}
}

func TestEveryBadVariableAtOnce(t *testing.T) {
	t.Setenv("IDEMCP_SHUTDOWN_TIMEOUT", "5")
	t.Setenv("IDEMCP_REDIS_TLS", "yes")
	t.Setenv("IDEMCP_MAX_BODY_BYTES", "1e9")
	t.Setenv("IDEMCP_STORE", "mongo")
	s, _ := newSet(t)
	err := s.Parse(nil)
	want := `IDEMCP_MAX_BODY_BYTES: "1e9" is not a whole number
IDEMCP_REDIS_TLS: "yes" is not a boolean; use true or false (or 1, 0, t, f)
IDEMCP_SHUTDOWN_TIMEOUT: "5" is not a duration, e.g. 30s
IDEMCP_STORE: "mongo" is not one of memory, redis`
	if err == nil || err.Error() != want {
		t.Errorf("error:\n%v\nwant:\n%s", err, want)
	}
}

func TestHelp(t *testing.T) {
	s, _ := newSet(t)
	var out bytes.Buffer
	s.HelpOutput = &out
	if err := s.Parse([]string{"-h"}); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("Parse(-h) = %v, want flag.ErrHelp", err)
	}
	for _, want := range []string{"Usage: idemcp test\n", "  --store memory|redis\n", `[default "127.0.0.1:9091"; env IDEMCP_ADMIN_LISTEN]`, "[default 30s; env IDEMCP_SHUTDOWN_TIMEOUT]"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("help does not contain %q:\n%s", want, out.String())
		}
	}
	// The flags still parse after help was printed.
	s2, _ := newSet(t)
	if err := s2.Parse([]string{"--redis-tls", "--store=memory"}); err != nil {
		t.Errorf("boolean flag without a value: %v", err)
	}
}

// TestLaterErrorsNameTheVariable: an error found after parsing, about a
// flag whose value came from the environment, names the variable to fix;
// one set on the command line still names the flag.
func TestLaterErrorsNameTheVariable(t *testing.T) {
	t.Setenv("IDEMCP_LISTEN", "nonsense")
	t.Setenv("IDEMCP_LISTEN_BACKLOG", "3")
	s := New("idemcp test", "")
	listen := s.String("listen", ":8081", "")
	s.Int("listen-backlog", 1, "")
	upstream := s.String("upstream", "", "")
	s.BindEnv("IDEMCP_")
	if err := s.Parse([]string{"--upstream", "ftp://x"}); err != nil {
		t.Fatal(err)
	}
	if *listen != "nonsense" || *upstream != "ftp://x" {
		t.Fatalf("listen %q upstream %q", *listen, *upstream)
	}
	cause := errors.New("--listen: listen tcp: address nonsense: missing port in address; --listen-backlog is fine")
	err := s.Attribute(cause)
	want := "IDEMCP_LISTEN (--listen): listen tcp: address nonsense: missing port in address; IDEMCP_LISTEN_BACKLOG (--listen-backlog) is fine"
	if err == nil || err.Error() != want {
		t.Fatalf("got %v\nwant %s", err, want)
	}
	if !errors.Is(err, cause) {
		t.Error("the attributed error does not wrap its cause")
	}
	if got := s.Attribute(errors.New(`--upstream: "ftp://x" is not an http:// URL`)).Error(); got != `--upstream: "ftp://x" is not an http:// URL` {
		t.Errorf("a command-line flag's error changed: %s", got)
	}
	if s.Attribute(nil) != nil {
		t.Error("Attribute(nil) is not nil")
	}
}

// TestAttributeByWholeVariableName: a message that names a longer variable
// (IDEMCP_POLICY_FILE) still gets the shorter one attributed (--policy from
// IDEMCP_POLICY), and in any order of the flags.
func TestAttributeByWholeVariableName(t *testing.T) {
	t.Setenv("IDEMCP_POLICY", "payments")
	t.Setenv("IDEMCP_POLICY_FILE", "/etc/p.yaml")
	s := New("idemcp test", "")
	s.String("policy", "", "")
	s.String("policy-file", "", "")
	s.BindEnv("IDEMCP_")
	if err := s.Parse(nil); err != nil {
		t.Fatal(err)
	}
	got := s.Attribute(errors.New("IDEMCP_POLICY_FILE (--policy-file): names no policy; --policy-file and --policy disagree")).Error()
	want := "IDEMCP_POLICY_FILE (--policy-file): names no policy; --policy-file and IDEMCP_POLICY (--policy) disagree"
	if got != want {
		t.Fatalf("got  %s\nwant %s", got, want)
	}
}
