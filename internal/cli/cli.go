// Package cli parses the flags of an idemcp command and the environment
// variables bound to them, with one kind of error for both: a bad value
// names the flag or the variable it came from and says what is accepted.
// Usage is printed only when asked for with --help.
package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/idemcp/idemcp/internal/suggest"
)

// Set is the flags of one command.
type Set struct {
	*flag.FlagSet
	// Command is what a user types, such as "idemcp sidecar".
	Command string
	// Intro is printed before the flags by --help.
	Intro string
	// HelpOutput is where --help prints (default: stdout).
	HelpOutput io.Writer

	envs    map[string][]string // flag name -> its environment variables, first wins
	envNote string
	failed  error // the last bad value given to a flag's Set
	source  map[string]string
}

// New returns an empty Set for command, printing nothing on its own.
func New(command, intro string) *Set {
	fs := flag.NewFlagSet(command, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return &Set{FlagSet: fs, Command: command, Intro: intro, envs: map[string][]string{}, source: map[string]string{}}
}

// EnvName is the environment variable bound to flag name under prefix:
// upper case, dashes as underscores (IDEMCP_ and shutdown-timeout give
// IDEMCP_SHUTDOWN_TIMEOUT).
func EnvName(prefix, name string) string {
	return prefix + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// BindEnv binds the named flags (every flag registered so far when none is
// named) to EnvName(prefix, flag). A variable is read only when its flag
// is not on the command line.
func (s *Set) BindEnv(prefix string, names ...string) {
	if len(names) == 0 {
		s.VisitAll(func(f *flag.Flag) { names = append(names, f.Name) })
		s.envNote = "Each flag can also be set as the environment variable " + prefix + "<FLAG> (upper case, - as _); a flag on the command line wins."
	}
	for _, n := range names {
		if s.Lookup(n) == nil {
			panic("cli: no flag " + n)
		}
		s.envs[n] = append([]string{EnvName(prefix, n)}, s.envs[n]...)
	}
}

// AlsoEnv makes flag name read env when none of its other variables is
// set, as --redis-url reads REDIS_URL.
func (s *Set) AlsoEnv(name, env string) {
	if s.Lookup(name) == nil {
		panic("cli: no flag " + name)
	}
	s.envs[name] = append(s.envs[name], env)
}

// Env returns the environment variables bound to flag name, first wins.
func (s *Set) Env(name string) []string { return s.envs[name] }

// Source says where flag name's value came from: "--name", the
// environment variable's name, or "" for its default.
func (s *Set) Source(name string) string { return s.source[name] }

// Attribute names the environment variable in a later error about a flag
// whose value came from one: "--listen: ..." becomes "IDEMCP_LISTEN
// (--listen): ...", so a user fixes the variable, not a flag they never
// passed. Errors about flags set on the command line or left at their
// default, and errors that name the variable already, are unchanged.
func (s *Set) Attribute(err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	out := msg
	for name, src := range s.source {
		if strings.HasPrefix(src, "-") || src == "" || namesVariable(msg, src) {
			continue
		}
		out = replaceFlag(out, "--"+name, src+" (--"+name+")")
	}
	if out == msg {
		return err
	}
	return &attributed{msg: out, err: err}
}

// namesVariable says whether msg names the variable env as a whole name,
// not as the start of a longer one (IDEMCP_POLICY in IDEMCP_POLICY_FILE).
func namesVariable(msg, env string) bool {
	for {
		i := strings.Index(msg, env)
		if i < 0 {
			return false
		}
		end := i + len(env)
		if end == len(msg) || !isVariableByte(msg[end]) {
			return true
		}
		msg = msg[end:]
	}
}

func isVariableByte(c byte) bool {
	return c == '_' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// replaceFlag replaces flag in msg where it stands as a whole name.
func replaceFlag(msg, flag, with string) string {
	var b strings.Builder
	for {
		i := strings.Index(msg, flag)
		if i < 0 {
			b.WriteString(msg)
			return b.String()
		}
		end := i + len(flag)
		b.WriteString(msg[:i])
		if end < len(msg) && (msg[end] == '-' || msg[end] == '_' || msg[end] >= 'a' && msg[end] <= 'z' || msg[end] >= '0' && msg[end] <= '9') {
			b.WriteString(flag) // a longer flag's name
		} else {
			b.WriteString(with)
		}
		msg = msg[end:]
	}
}

type attributed struct {
	msg string
	err error
}

func (e *attributed) Error() string { return e.msg }
func (e *attributed) Unwrap() error { return e.err }

// Parse reads args, then the environment for the flags args did not set.
// With -h or --help it prints the help and returns flag.ErrHelp.
func (s *Set) Parse(args []string) error {
	s.VisitAll(func(f *flag.Flag) {
		switch f.Value.(type) {
		case *checked, *checkedBool:
			return
		}
		c := &checked{Value: f.Value, flag: f, failed: &s.failed}
		if bf, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && bf.IsBoolFlag() {
			f.Value = &checkedBool{c}
		} else {
			f.Value = c
		}
	})
	s.failed = nil
	if err := s.FlagSet.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			out := s.HelpOutput
			if out == nil {
				out = os.Stdout
			}
			s.PrintHelp(out)
			return flag.ErrHelp
		}
		return s.commandLineError(err)
	}
	s.Visit(func(f *flag.Flag) { s.source[f.Name] = "--" + f.Name })
	var errs []error
	s.VisitAll(func(f *flag.Flag) {
		if s.source[f.Name] != "" {
			return
		}
		for _, env := range s.envs[f.Name] {
			v, ok := os.LookupEnv(env)
			// An empty variable is unset, except for a string flag, where
			// it is a value ("" turns --admin-listen off).
			if !ok || (v == "" && !isString(f)) {
				continue
			}
			s.failed = nil
			if err := f.Value.Set(v); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", env, s.reason(err)))
			}
			s.source[f.Name] = env
			break
		}
	})
	return errors.Join(errs...)
}

func (s *Set) reason(err error) error {
	if s.failed != nil {
		return s.failed
	}
	return err
}

// commandLineError turns the flag package's messages into one line that
// names the flag and where the flags are listed.
func (s *Set) commandLineError(err error) error {
	hint := "run " + s.Command + " --help for the flags"
	msg := err.Error()
	switch {
	case s.failed != nil:
		var fe *flagError
		if errors.As(s.failed, &fe) {
			return fmt.Errorf("--%s: %w; %s", fe.flag, s.failed, hint)
		}
	case strings.HasPrefix(msg, "flag provided but not defined: "):
		name := strings.TrimLeft(strings.TrimPrefix(msg, "flag provided but not defined: "), "-")
		var names []string
		s.VisitAll(func(f *flag.Flag) { names = append(names, f.Name) })
		if c := suggest.Closest(name, names); c != "" {
			return fmt.Errorf("unknown flag --%s; did you mean --%s? %s", name, c, hint)
		}
		return fmt.Errorf("unknown flag --%s; %s", name, hint)
	case strings.HasPrefix(msg, "flag needs an argument: "):
		name := strings.TrimLeft(strings.TrimPrefix(msg, "flag needs an argument: "), "-")
		return fmt.Errorf("--%s needs a value; %s", name, hint)
	}
	return fmt.Errorf("%s; %s", msg, hint)
}

// flagError is a bad value for a flag, in words.
type flagError struct {
	flag string
	msg  string
}

func (e *flagError) Error() string { return e.msg }

// checked puts every bad value into words a user can act on, whatever the
// flag's type, on the command line and in the environment alike.
type checked struct {
	flag.Value
	flag   *flag.Flag
	failed *error
}

func (c *checked) Set(v string) error {
	err := c.Value.Set(v)
	if err == nil {
		return nil
	}
	fe := &flagError{flag: c.flag.Name, msg: describe(c.Value, v, err)}
	*c.failed = fe
	return fe
}

func (c *checked) Get() any {
	if g, ok := c.Value.(flag.Getter); ok {
		return g.Get()
	}
	return c.String()
}

type checkedBool struct{ *checked }

func (checkedBool) IsBoolFlag() bool { return true }

func describe(v flag.Value, got string, err error) string {
	g, _ := v.(flag.Getter)
	var typed any
	if g != nil {
		typed = g.Get()
	}
	switch typed.(type) {
	case bool:
		return fmt.Sprintf("%q is not a boolean; use true or false (or 1, 0, t, f)", got)
	case time.Duration:
		return fmt.Sprintf("%q is not a duration, e.g. 30s", got)
	case int, int64:
		if errors.Is(err, strconv.ErrRange) {
			return fmt.Sprintf("%q is out of range", got)
		}
		return fmt.Sprintf("%q is not a whole number", got)
	case uint, uint64:
		return fmt.Sprintf("%q is not a whole number from 0 up", got)
	case float64:
		return fmt.Sprintf("%q is not a number", got)
	}
	// Choice and flag.Func values say it themselves.
	return err.Error()
}

// unwrap returns the flag's own Value under checked.
func unwrap(v flag.Value) flag.Value {
	switch c := v.(type) {
	case *checked:
		return c.Value
	case *checkedBool:
		return c.Value
	}
	return v
}

func isString(f *flag.Flag) bool {
	v := unwrap(f.Value)
	if g, ok := v.(flag.Getter); ok {
		_, s := g.Get().(string)
		return s
	}
	return false
}

// Choice is a string flag that takes one of allowed, in any letter case;
// the value kept is the allowed spelling.
func Choice(p *string, def string, allowed ...string) flag.Value {
	*p = def
	return &choice{p: p, allowed: allowed}
}

type choice struct {
	p       *string
	allowed []string
}

func (c *choice) String() string {
	if c.p == nil {
		return ""
	}
	return *c.p
}

func (c *choice) Get() any { return *c.p }

func (c *choice) Set(v string) error {
	for _, a := range c.allowed {
		if strings.EqualFold(v, a) {
			*c.p = a
			return nil
		}
	}
	return fmt.Errorf("%q is not one of %s", v, strings.Join(c.allowed, ", "))
}

// PrintHelp writes the command's intro and every flag, with its default
// and the environment variables it reads.
func (s *Set) PrintHelp(w io.Writer) {
	if s.Intro != "" {
		_, _ = fmt.Fprint(w, strings.TrimRight(s.Intro, "\n")+"\n\n")
	}
	_, _ = fmt.Fprintln(w, "Flags:")
	var flags []*flag.Flag
	s.VisitAll(func(f *flag.Flag) { flags = append(flags, f) })
	sort.Slice(flags, func(i, j int) bool { return flags[i].Name < flags[j].Name })
	for _, f := range flags {
		own := *f
		own.Value = unwrap(f.Value)
		kind, usage := flag.UnquoteUsage(&own)
		if c, ok := own.Value.(*choice); ok {
			kind = strings.Join(c.allowed, "|")
		}
		line := "  --" + f.Name
		if kind != "" {
			line += " " + kind
		}
		var notes []string
		if d := f.DefValue; d != "" && d != "false" && d != "0" && d != "0s" && !strings.Contains(usage, "(default") {
			if isString(f) {
				d = strconv.Quote(d)
			}
			notes = append(notes, "default "+d)
		}
		if envs := s.envs[f.Name]; len(envs) > 0 {
			notes = append(notes, "env "+strings.Join(envs, ", "))
		}
		if len(notes) > 0 {
			usage += " [" + strings.Join(notes, "; ") + "]"
		}
		_, _ = fmt.Fprintf(w, "%s\n        %s\n", line, usage)
	}
	if s.envNote != "" {
		_, _ = fmt.Fprintf(w, "\n%s\n", s.envNote)
	}
}
