// Package metricsdoc checks docs/metrics.md against the metrics a process
// registers, for the tests of the packages that register them.
package metricsdoc

import (
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
)

// Names returns the name of every metric registered with reg, label
// vectors with no series yet included. Gather cannot give them (a vector
// without children collects nothing) and the Registry has no other way to
// list what it holds, so this reads its index of names; a client_golang
// that renames the index fails here, loudly.
func Names(reg *prometheus.Registry) ([]string, error) {
	v := reflect.ValueOf(reg).Elem().FieldByName("dimHashesByName")
	if !v.IsValid() || v.Kind() != reflect.Map || v.Type().Key().Kind() != reflect.String {
		return nil, errors.New("prometheus.Registry has no dimHashesByName map any more: update metricsdoc.Names for this client_golang")
	}
	v = reflect.NewAt(v.Type(), unsafe.Pointer(v.UnsafeAddr())).Elem()
	names := make([]string, 0, v.Len())
	for _, k := range v.MapKeys() {
		names = append(names, k.String())
	}
	sort.Strings(names)
	return names, nil
}

// Documented returns the metric names in the first column of the tables
// under the level-2 heading section of a metrics page (such as
// "## Sidecar"). A name ending in * stands for a family (go_*).
func Documented(page []byte, section string) []string {
	var names []string
	in := false
	for _, line := range strings.Split(string(page), "\n") {
		if strings.HasPrefix(line, "## ") {
			in = strings.TrimSpace(strings.TrimPrefix(line, "## ")) == section
			continue
		}
		if !in || !strings.HasPrefix(line, "| `") {
			continue
		}
		cell := strings.SplitN(line[1:], "|", 2)[0]
		for _, m := range metricName.FindAllStringSubmatch(cell, -1) {
			names = append(names, m[1])
		}
	}
	return names
}

var metricName = regexp.MustCompile("`([a-z_:][a-z0-9_:]*\\*?)`")

// Compare returns what differs between the registered names and the
// documented ones: a registered metric no row names (exactly, or by a
// family row such as go_*), a documented metric not registered, and a
// family row no registered metric falls in.
func Compare(registered, documented []string) []string {
	exact := map[string]bool{}
	var families []string
	for _, d := range documented {
		if f, ok := strings.CutSuffix(d, "*"); ok {
			families = append(families, f)
		} else {
			exact[d] = true
		}
	}
	reg := map[string]bool{}
	used := map[string]bool{}
	var problems []string
	for _, r := range registered {
		reg[r] = true
		if exact[r] {
			continue
		}
		found := false
		for _, f := range families {
			if strings.HasPrefix(r, f) {
				used[f], found = true, true
			}
		}
		if !found {
			problems = append(problems, fmt.Sprintf("%s is registered but has no row in docs/metrics.md", r))
		}
	}
	for d := range exact {
		if !reg[d] {
			problems = append(problems, fmt.Sprintf("%s has a row in docs/metrics.md but is not registered", d))
		}
	}
	for _, f := range families {
		if !used[f] {
			problems = append(problems, fmt.Sprintf("%s* has a row in docs/metrics.md but no registered metric starts with %s", f, f))
		}
	}
	sort.Strings(problems)
	return problems
}
