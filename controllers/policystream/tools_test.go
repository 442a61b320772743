package policystream

import (
	"fmt"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/policywire"
)

// TestToolsStatusBoundedAndWarnedFirst: a server with more tools than
// the status holds lists those Auto deduplicates for want of annotations
// first and counts the rest; sidecars that disagree on a tool (one has
// listed it, one has not) show the majority, Deduplicate on a tie.
func TestToolsStatusBoundedAndWarnedFirst(t *testing.T) {
	var many []policywire.Tool
	for i := range 100 {
		many = append(many, policywire.Tool{Name: fmt.Sprintf("read_%03d", i), Mode: "Passthrough", Reason: "readOnlyHint"})
	}
	many = append(many, policywire.Tool{Name: "zz_set", Mode: "Deduplicate", Reason: "noAnnotations"})
	tools, omitted, c := ToolsStatus([]toolReport{{workload: "deployment/redis-mcp", tools: many}})
	if len(tools) != MaxStatusTools || omitted != 101-MaxStatusTools || tools[0].Name != "zz_set" {
		t.Fatalf("%d tools listed, %d omitted, first %q; want %d, %d, the unannotated zz_set first", len(tools), omitted, tools[0].Name, MaxStatusTools, 101-MaxStatusTools)
	}
	if c.Status != metav1.ConditionFalse || c.Reason != v1alpha1.ReasonToolsUnannotated || !strings.Contains(c.Message, "deployment/redis-mcp") || !strings.Contains(c.Message, `{name: "zz_set", mode: Passthrough}`) {
		t.Fatalf("condition %+v, want False/ToolsUnannotated naming the workload and the rule", c)
	}

	listed := policywire.Tool{Name: "get", Mode: "Passthrough", Reason: "readOnlyHint"}
	unknown := policywire.Tool{Name: "get", Mode: "Deduplicate", Reason: "unknown"}
	tools, _, _ = ToolsStatus([]toolReport{{workload: "a", tools: []policywire.Tool{listed}}, {workload: "a", tools: []policywire.Tool{unknown}}})
	if len(tools) != 1 || tools[0].Mode != v1alpha1.ModeDeduplicate || tools[0].Sidecars != 2 {
		t.Fatalf("a tie: %+v, want Deduplicate reported by 2 sidecars", tools)
	}
	tools, _, c = ToolsStatus([]toolReport{{workload: "a", tools: []policywire.Tool{listed}}, {workload: "a", tools: []policywire.Tool{listed}}, {workload: "a", tools: []policywire.Tool{unknown}}})
	if tools[0].Mode != v1alpha1.ModePassthrough || c.Status != metav1.ConditionTrue {
		t.Fatalf("two sidecars of three listed it: %+v, %+v; want Passthrough and ToolsAnnotated True", tools, c)
	}
	if _, _, c = ToolsStatus(nil); c.Status != metav1.ConditionUnknown || c.Reason != v1alpha1.ReasonNoToolsReported {
		t.Fatalf("no reports: %+v, want Unknown/NoToolsReported", c)
	}
}
