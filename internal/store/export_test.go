package store

import "strings"

// Dump is everything the memory store holds, as text: each record's key,
// fingerprint, owner, tenant and response.
func (m *Memory) Dump() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var b strings.Builder
	for k, e := range m.entries {
		for _, s := range []string{k, e.fingerprint, e.owner, e.tenant, string(e.response)} {
			b.WriteString(s)
			b.WriteByte('\n')
		}
	}
	return b.String()
}
