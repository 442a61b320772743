package httpproxy

import (
	"encoding/json"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/sidecar/idscan"
)

// idScanner tells which call a response too large to hold answers.
type idScanner struct{ idscan.Scanner }

// responseID returns the id of the response scanned: a complete object
// with exactly one valid "id" and no "method".
func (s *idScanner) responseID() (json.RawMessage, bool) {
	if !s.Complete() || s.Method() || s.IDs() != 1 {
		return nil, false
	}
	id := s.ID()
	if id == nil {
		return nil, false
	}
	if _, err := mcpmsg.Parse(append(append([]byte(`{"jsonrpc":"2.0","result":{},"id":`), id...), '}')); err != nil {
		return nil, false
	}
	return id, true
}
