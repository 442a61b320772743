// Package security_test checks the promises idemcp makes about what an
// attacker, another tenant or an operator can learn or do: least-privilege
// RBAC, principal isolation, nothing secret at rest or in logs and metrics,
// listeners only where configured.
package security_test

import (
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"
)

// grant is one (API group, resource, resource name) a role may touch.
type grant struct{ group, resource, name string }

func (g grant) String() string {
	s := g.group + "/" + g.resource
	if g.group == "" {
		s = "core/" + g.resource
	}
	if g.name != "" {
		s += "[" + g.name + "]"
	}
	return s
}

// The manager's ClusterRole, reviewed: exactly these verbs on exactly
// these resources. A new permission must be added here on purpose, with
// the reason it is needed.
var managerRole = map[grant][]string{
	// Pods are read (sidecars per policy, the pod a token is bound to),
	// never written by this role; the webhook reads LimitRanges.
	{"", "pods", ""}:        {"get", "list", "watch"},
	{"", "limitranges", ""}: {"get", "list", "watch"},
	// A namespace's UID, read (as metadata) to make it a second owner of a
	// policy's managed Redis, so that no deletion of the policy, however
	// propagated, removes the store while pods still use it.
	{"", "namespaces", ""}: {"get"},
	// A managed Redis's volume claim is read, never written.
	{"", "persistentvolumeclaims", ""}: {"get"},
	// Redis passwords and the webhook's certificate: created, read and
	// patched, never updated or deleted.
	{"", "secrets", ""}: {"create", "get", "list", "patch", "watch"},
	// Its own serving certificate only.
	{"", "secrets", "idemcp-webhook-server-cert"}: {"update"},
	{"", "services", ""}:                          {"create", "delete", "get", "list", "patch", "update", "watch"},
	// Its own webhook configuration only (the CA bundle).
	{"admissionregistration.k8s.io", "mutatingwebhookconfigurations", "idemcp-mutating-webhook-configuration"}: {"get", "patch", "update"},
	// Deployments: an IdempotentProxy's data plane (created, updated,
	// owned); the Deployments of an older managed Redis are deleted.
	{"apps", "deployments", ""}: {"create", "delete", "get", "list", "patch", "update", "watch"},
	// An IdempotentProxy's CA bundle may be a ConfigMap key, read one at a
	// time (never listed or cached).
	{"", "configmaps", ""}:       {"get"},
	{"apps", "replicasets", ""}:  {"get"},
	{"apps", "statefulsets", ""}: {"create", "delete", "get", "list", "patch", "update", "watch"},
	// The policy stream authenticates sidecars by their projected tokens.
	{"authentication.k8s.io", "tokenreviews", ""}:        {"create"},
	{"authorization.k8s.io", "subjectaccessreviews", ""}: {"create"},
	{"batch", "jobs", ""}:                                {"get"},
	{"events.k8s.io", "events", ""}:                      {"create", "patch"},
	// Policies are the users': read, finalized and given status; never
	// created, updated or deleted.
	{"idemcp.io", "idempotencypolicies", ""}:            {"get", "list", "patch", "watch"},
	{"idemcp.io", "idempotencypolicies/finalizers", ""}: {"update"},
	{"idemcp.io", "idempotencypolicies/status", ""}:     {"get", "patch", "update"},
	// Proxies too: read and given status, never written otherwise.
	{"idemcp.io", "idempotentproxies", ""}:        {"get", "list", "watch"},
	{"idemcp.io", "idempotentproxies/status", ""}: {"get", "patch", "update"},
	// blockOwnerDeletion on a proxy's Deployment, Service and PDB.
	{"idemcp.io", "idempotentproxies/finalizers", ""}: {"update"},
	{"networking.k8s.io", "networkpolicies", ""}:      {"create", "delete", "get", "list", "patch", "update", "watch"},
	{"policy", "poddisruptionbudgets", ""}:            {"create", "delete", "get", "list", "patch", "update", "watch"},
}

// The leader-election Role, in the manager's namespace only.
var leaderElectionRole = map[grant][]string{
	{"coordination.k8s.io", "leases", ""}: {"create", "delete", "get", "list", "patch", "update", "watch"},
	{"events.k8s.io", "events", ""}:       {"create", "patch"},
	// Leader election's own Events are core/v1.
	{"", "events", ""}: {"create", "patch"},
	// The leader labels its own pod for the policy stream's Service.
	{"", "pods", ""}: {"patch"},
}

// TestManagerRBACIsLeastPrivilege reads the generated role (make
// manifests) and fails on any wildcard, any verb or resource not in the
// reviewed list, and any reviewed grant that went missing.
func TestManagerRBACIsLeastPrivilege(t *testing.T) {
	for _, tt := range []struct {
		file, kind string
		want       map[grant][]string
	}{
		{"role.yaml", "ClusterRole", managerRole},
		{"leader_election_role.yaml", "Role", leaderElectionRole},
	} {
		t.Run(tt.file, func(t *testing.T) {
			b, err := os.ReadFile(filepath.Join("..", "..", "config", "rbac", tt.file))
			if err != nil {
				t.Fatal(err)
			}
			var role rbacv1.ClusterRole // a Role's fields are a subset
			if err := yaml.UnmarshalStrict(b, &role); err != nil {
				t.Fatalf("%s: %v", tt.file, err)
			}
			if role.Kind != tt.kind {
				t.Fatalf("%s is a %s, want a %s", tt.file, role.Kind, tt.kind)
			}
			got := map[grant][]string{}
			for i, r := range role.Rules {
				if len(r.NonResourceURLs) > 0 {
					t.Errorf("rule %d grants non-resource URLs %v", i, r.NonResourceURLs)
				}
				for _, list := range [][]string{r.APIGroups, r.Resources, r.Verbs, r.ResourceNames} {
					for _, v := range list {
						if strings.Contains(v, "*") {
							t.Errorf("rule %d has a wildcard %q: %+v", i, v, r)
						}
					}
				}
				names := r.ResourceNames
				if len(names) == 0 {
					names = []string{""}
				}
				for _, g := range r.APIGroups {
					for _, res := range r.Resources {
						for _, n := range names {
							k := grant{g, res, n}
							got[k] = append(got[k], r.Verbs...)
						}
					}
				}
			}
			for k, verbs := range got {
				sort.Strings(verbs)
				verbs = slices.Compact(verbs)
				want, ok := tt.want[k]
				if !ok {
					t.Errorf("%s grants %v on %s, which the reviewed role does not have at all", tt.file, verbs, k)
					continue
				}
				want = slices.Sorted(slices.Values(want))
				if !slices.Equal(verbs, want) {
					t.Errorf("%s grants %v on %s, want exactly %v", tt.file, verbs, k, want)
				}
			}
			for k, want := range tt.want {
				if _, ok := got[k]; !ok {
					t.Errorf("%s no longer grants %v on %s: update the reviewed list", tt.file, want, k)
				}
			}
		})
	}
}
