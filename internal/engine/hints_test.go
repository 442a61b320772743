package engine

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/idemcp/idemcp/internal/store"
)

// listing is a tools/list result with the annotations real servers send:
// the filesystem server's write_file (idempotentHint), its read_file
// (readOnlyHint), the memory server's create_entities (neither true), and
// the Redis server's tools (no annotations at all).
const listing = `{"tools":[
	{"name":"write_file","annotations":{"readOnlyHint":false,"idempotentHint":true,"destructiveHint":true}},
	{"name":"read_file","annotations":{"readOnlyHint":true}},
	{"name":"delete_entities","annotations":{"idempotentHint":true}},
	{"name":"create_entities","annotations":{"readOnlyHint":false,"idempotentHint":false}},
	{"name":"toggle","annotations":{"readOnlyHint":false}},
	{"name":"get"},
	{"name":"set","annotations":{"title":"Set a key"}},
	{"name":"charge","annotations":{"readOnlyHint":true}}]}`

// TestAutoHonoursAnnotations: under Auto, readOnlyHint: true and
// idempotentHint: true pass through, everything else is deduplicated;
// rules win, and defaultMode: Deduplicate ignores hints. Each call is
// counted by the reason for its mode.
func TestAutoHonoursAnnotations(t *testing.T) {
	tests := []struct {
		policy, tool string
		dedup        bool
		reason       string
	}{
		{"spec: {}", "write_file", false, ByIdempotentHint},
		{"spec: {}", "read_file", false, ByReadOnlyHint},
		{"spec: {}", "delete_entities", false, ByIdempotentHint},
		{"spec: {}", "create_entities", true, ByIdempotentHint},
		{"spec: {}", "toggle", true, ByReadOnlyHint},
		{"spec: {}", "get", true, ByNoAnnotations},
		{"spec: {}", "set", true, ByNoAnnotations},
		{"spec: {}", "never_listed", true, ByUnknown},
		{"spec: {tools: [{name: charge, mode: Deduplicate}]}", "charge", true, ByRule},
		{"spec: {tools: [{name: get, mode: Passthrough}]}", "get", false, ByRule},
		{"spec: {tools: [{name: write_file, mode: Auto}]}", "write_file", false, ByIdempotentHint},
		{"spec: {defaultMode: Deduplicate}", "write_file", true, ByRule},
		{"spec: {defaultMode: Deduplicate}", "read_file", true, ByRule},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%s %s", tt.policy, tt.tool), func(t *testing.T) {
			e := New(Options{Policy: mustPolicy(t, tt.policy), Store: store.NewMemory(0)})
			e.Hints().ObserveListResult(json.RawMessage(listing))
			tc, _ := ParseToolCall(json.RawMessage(fmt.Sprintf(`{"name":%q,"arguments":{}}`, tt.tool)))
			p, err := e.Plan(tc, alice)
			if err != nil {
				t.Fatal(err)
			}
			if (p != nil) != tt.dedup {
				t.Errorf("deduplicated = %v, want %v", p != nil, tt.dedup)
			}
			if got := e.Deduplicates(tt.tool); got != tt.dedup {
				t.Errorf("Deduplicates = %v, want %v", got, tt.dedup)
			}
			mode := map[bool]string{true: "deduplicate", false: "passthrough"}[tt.dedup]
			// Plan counts every call; Deduplicates only those it passes
			// through, which never reach Plan.
			want := 1.0
			if !tt.dedup {
				want = 2
			}
			if n := counter(e.Metrics().Classified.WithLabelValues(tt.reason, mode)); n != want {
				t.Errorf("idemcp_tool_calls_classified_total{reason=%q,mode=%q} = %v, want %v", tt.reason, mode, n, want)
			}
		})
	}
}

// TestReportAnnotations: the tools Auto deduplicates for lack of any
// annotation are logged with the rule that would pass them through, once
// per change of the list; tools a rule already decides are left out.
func TestReportAnnotations(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	e := New(Options{Policy: mustPolicy(t, "spec: {retryWindow: 2s, tools: [{name: set, mode: Deduplicate}]}"), Store: store.NewMemory(0), Logger: log})
	e.Hints().ObserveListResult(json.RawMessage(listing))
	e.ReportAnnotations()
	out := buf.String()
	for _, want := range []string{"no annotations", `tools=[get]`, `retryWindow=2s`, `{name: \"get\", mode: Passthrough}`} {
		if !strings.Contains(out, want) {
			t.Errorf("log %q does not contain %q", out, want)
		}
	}
	if strings.Contains(out, `\"set\"`) {
		t.Errorf("log names set, which a rule decides: %s", out)
	}
	buf.Reset()
	e.ReportAnnotations()
	if buf.Len() != 0 {
		t.Errorf("a listing with no change logged again: %s", buf.String())
	}
	e.Hints().ObserveListResult(json.RawMessage(`{"tools":[{"name":"list"}]}`))
	e.ReportAnnotations()
	if out := buf.String(); !strings.Contains(out, `tools="[get list]"`) {
		t.Errorf("after the list changed, log %q does not name get and list", out)
	}
}

// TestConflictingDuplicateToolsAreDeduplicated: a listing that names one
// tool twice with different annotations says nothing reliable of it: the
// tool is deduplicated as unknown, whichever entry comes last. Identical
// duplicates keep their hint.
func TestConflictingDuplicateToolsAreDeduplicated(t *testing.T) {
	for _, listing := range []string{
		`{"tools":[{"name":"delete","annotations":{"readOnlyHint":false}},{"name":"delete","annotations":{"idempotentHint":true}}]}`,
		`{"tools":[{"name":"delete","annotations":{"idempotentHint":true}},{"name":"delete","annotations":{"readOnlyHint":false}}]}`,
		`{"tools":[{"name":"delete","annotations":{"readOnlyHint":true}},{"name":"delete"}]}`,
		`{"tools":[{"name":"delete"},{"name":"delete","annotations":{"readOnlyHint":true}}]}`,
	} {
		e := New(Options{Policy: mustPolicy(t, "spec: {}"), Store: store.NewMemory(0)})
		e.Hints().ObserveListResult(json.RawMessage(listing))
		if !e.Deduplicates("delete") {
			t.Errorf("%s: delete is passed through", listing)
		}
		tc, _ := ParseToolCall(json.RawMessage(`{"name":"delete","arguments":{}}`))
		if p, err := e.Plan(tc, alice); err != nil || p == nil {
			t.Errorf("%s: a call to delete is not deduplicated (%v)", listing, err)
		}
		if n := counter(e.Metrics().Classified.WithLabelValues(ByUnknown, "deduplicate")); n != 1 {
			t.Errorf("%s: counted as unknown %v times, want 1", listing, n)
		}
	}
	e := New(Options{Policy: mustPolicy(t, "spec: {}"), Store: store.NewMemory(0)})
	e.Hints().ObserveListResult(json.RawMessage(`{"tools":[{"name":"look","annotations":{"readOnlyHint":true}},{"name":"look","annotations":{"readOnlyHint":true}}]}`))
	if e.Deduplicates("look") {
		t.Error("a tool listed twice alike, read-only, is deduplicated")
	}
}
