package e2e_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
)

// readBody reads a request body and puts it back for the next handler.
func readBody(r *http.Request) []byte {
	b, _ := io.ReadAll(r.Body)
	r.Body = io.NopCloser(bytes.NewReader(b))
	return b
}

func isChargeCall(body []byte) bool {
	var m struct {
		Method string `json:"method"`
		Params struct {
			Name string `json:"name"`
		} `json:"params"`
	}
	return json.Unmarshal(body, &m) == nil && m.Method == "tools/call" && m.Params.Name == "charge_card"
}
