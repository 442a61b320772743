package policy

import (
	"strings"
	"testing"
)

// FuzzParse: no policy file panics the compiler; one it accepts has a
// rule for every tool name and recompiles to the same hash, so a sidecar
// and the manager that compile the same spec agree on what was applied.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"spec: {}",
		"",
		"spec:\n  defaultMode: Deduplicate\n  tools:\n  - name: charge_*\n    mode: Passthrough\n  - name: \"?x\"\n    ttl: 1h\n    ignoreArguments: [/requestedAt, /a~1b]\n",
		"spec: {ttl: -1s}",
		"spec: {store: {type: Redis}}",
		"apiVersion: idemcp.io/v1alpha1\nkind: IdempotencyPolicy\nmetadata: {name: p}\nspec: {keyScope: Principal, principalHeader: Authorization}",
		"spec: {tools: [{name: '[', mode: Auto}]}",
		"spec: {maxResultBytes: 1Ei}",
		"{\"spec\":{\"waitTimeout\":\"1ms\",\"leaseDuration\":\"999999h\"}}",
		"spec: {tools: [{name: a, ignoreArguments: ['no-slash']}]}",
	} {
		f.Add(s, "charge_card")
	}
	f.Fuzz(func(t *testing.T, doc, tool string) {
		p, err := Parse([]byte(doc))
		if err != nil {
			if strings.TrimSpace(err.Error()) == "" {
				t.Fatalf("policy %q refused with an empty message", doc)
			}
			return
		}
		if p.RuleFor(tool) == nil {
			t.Fatalf("policy %q has no rule for tool %q", doc, tool)
		}
		again, err := Compile(p.Spec)
		if err != nil {
			t.Fatalf("policy %q compiled, but its defaulted spec does not: %v", doc, err)
		}
		if again.Hash != p.Hash {
			t.Fatalf("policy %q: hash %s, recompiled %s", doc, p.Hash, again.Hash)
		}
	})
}
