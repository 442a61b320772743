package policystream

import (
	"fmt"
	"slices"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/idemcp/idemcp/api/v1alpha1"
	"github.com/idemcp/idemcp/internal/bounded"
	"github.com/idemcp/idemcp/internal/policywire"
)

// MaxStatusTools bounds status.tools (the CRD's MaxItems): the rest are
// counted in status.toolsOmitted.
const MaxStatusTools = 64

// maxToolName is the longest tool name status.tools takes (the CRD's
// MaxLength, the MCP spec's bound); a longer one is counted as omitted.
const maxToolName = 128

// toolReport is one sidecar's tool decisions, with the workload of its
// pod (as kubectl rollout restart names it).
type toolReport struct {
	workload string
	tools    []policywire.Tool
	omitted  int
}

// ToolsStatus computes status.tools, status.toolsOmitted and the
// ToolsAnnotated condition from the sidecars' reports: a pure function,
// so every reason is tested without a cluster. Where sidecars disagree
// on a tool (one listed it, another has not yet), the mode most of them
// gave wins, and Deduplicate on a tie; the tools Auto deduplicates for
// want of annotations come first.
func ToolsStatus(reports []toolReport) ([]v1alpha1.ToolStatus, int32, metav1.Condition) {
	type votes struct {
		count     map[[2]string]int // (mode, reason) -> sidecars
		sidecars  int32
		workloads []string
	}
	byName := map[string]*votes{}
	omitted := 0
	reported := false
	for _, r := range reports {
		omitted = max(omitted, r.omitted)
		for _, t := range r.tools {
			reported = true
			if len(t.Name) > maxToolName || t.Name == "" {
				omitted++
				continue
			}
			v := byName[t.Name]
			if v == nil {
				v = &votes{count: map[[2]string]int{}}
				byName[t.Name] = v
			}
			v.count[[2]string{t.Mode, t.Reason}]++
			v.sidecars++
			if !slices.Contains(v.workloads, r.workload) {
				v.workloads = append(v.workloads, r.workload)
			}
		}
	}
	var tools []v1alpha1.ToolStatus
	warned := map[string][]string{} // tool -> workloads, for the message
	for name, v := range byName {
		var best [2]string
		n := -1
		for k, c := range v.count {
			if c > n || c == n && better(k, best) {
				best, n = k, c
			}
		}
		tools = append(tools, v1alpha1.ToolStatus{Name: name, Mode: v1alpha1.ToolMode(best[0]), Reason: best[1], Sidecars: v.sidecars})
		if best[0] == string(v1alpha1.ModeDeduplicate) && (best[1] == "noAnnotations" || best[1] == "unknown") {
			warned[name] = v.workloads
		}
	}
	slices.SortFunc(tools, func(a, b v1alpha1.ToolStatus) int {
		_, wa := warned[a.Name]
		_, wb := warned[b.Name]
		if wa != wb {
			if wa {
				return -1
			}
			return 1
		}
		return strings.Compare(a.Name, b.Name)
	})
	if len(tools) > MaxStatusTools {
		omitted += len(tools) - MaxStatusTools
		tools = tools[:MaxStatusTools]
	}

	c := metav1.Condition{Type: v1alpha1.ConditionToolsAnnotated}
	switch {
	case !reported:
		c.Status, c.Reason = metav1.ConditionUnknown, v1alpha1.ReasonNoToolsReported
		c.Message = "no connected sidecar has reported a tool yet: the MCP server has not been listed, or no sidecar runs"
	case len(warned) == 0:
		c.Status, c.Reason = metav1.ConditionTrue, v1alpha1.ReasonToolsAnnotated
		c.Message = fmt.Sprintf("each of the %d tools the sidecars have seen is decided by a rule or by the MCP server's annotations", len(byName))
	default:
		c.Status, c.Reason = metav1.ConditionFalse, v1alpha1.ReasonToolsUnannotated
		c.Message = unannotatedMessage(warned)
	}
	c.Message = bounded.Message(c.Message)
	return tools, int32(omitted), c
}

// better breaks a tie between two decisions: Deduplicate first (erring on
// the side that runs nothing twice), then by reason, for a stable status.
func better(a, b [2]string) bool {
	if a[0] != b[0] {
		return a[0] == string(v1alpha1.ModeDeduplicate)
	}
	return a[1] < b[1]
}

// unannotatedMessage names the tools Auto deduplicates for want of the
// server's word, the workloads that serve them, and the rule that would
// pass them through.
func unannotatedMessage(warned map[string][]string) string {
	var none, workloads []string
	for name, ws := range warned {
		for _, w := range ws {
			if !slices.Contains(workloads, w) {
				workloads = append(workloads, w)
			}
		}
		none = append(none, name)
	}
	slices.Sort(none)
	slices.Sort(workloads)
	return fmt.Sprintf("defaultMode Auto deduplicates %s of %s only because the MCP server gives them no annotations (readOnlyHint, idempotentHint) or no listing named them, reads included: "+
		"an identical read within retryWindow is replayed, and a change made meanwhile is not seen. Pass those that only read, or are safe to repeat, through with a rule: %s",
		bounded.Count(len(none), "tool", "tools", none), bounded.List(workloads), passthroughRule(none))
}

// passthroughRule is the policy snippet that would pass tools through,
// for the operator to trim to the tools that only read.
func passthroughRule(tools []string) string {
	var b strings.Builder
	b.WriteString("tools: [")
	for i, t := range tools {
		if i == bounded.Names {
			fmt.Fprintf(&b, ", ... %d more", len(tools)-bounded.Names)
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "{name: %q, mode: Passthrough}", t)
	}
	b.WriteString("]")
	return b.String()
}
