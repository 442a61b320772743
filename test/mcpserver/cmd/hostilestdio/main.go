// Command hostilestdio is a stdio MCP server that answers tools/call the
// way no SDK would, for tests of `idemcp wrap` against misbehaving
// servers. It is hand-written on purpose: an SDK server cannot misbehave.
//
// Environment:
//   - HOSTILE_MODE: how tools/call is answered:
//     "idtype" with the id in the other type (the number 1 for "1", the
//     string "1" for 1); "batch" inside a one-element batch array; "dupid"
//     with the id member twice; "pair" as it should, but holding each
//     first answer until the second call came, then answering both in
//     reverse order (so that two calls are in flight at once).
//   - COUNT_FILE: every tools/call appends a line with the tool's name.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
)

func main() {
	mode := os.Getenv("HOSTILE_MODE")
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(nil, 16<<20)
	out := bufio.NewWriter(os.Stdout)
	n := 0
	var held string
	for in.Scan() {
		var m struct {
			ID     json.RawMessage `json:"id"`
			Method string          `json:"method"`
		}
		if json.Unmarshal(in.Bytes(), &m) != nil || len(m.ID) == 0 {
			continue
		}
		var line string
		switch m.Method {
		case "initialize":
			line = fmt.Sprintf(`{"jsonrpc":"2.0","id":%s,"result":{"protocolVersion":"2025-11-25","capabilities":{"tools":{}},"serverInfo":{"name":"hostile","version":"1"}}}`, m.ID)
		case "tools/list":
			line = fmt.Sprintf(`{"jsonrpc":"2.0","id":%s,"result":{"tools":[{"name":"charge_card","inputSchema":{"type":"object"}}]}}`, m.ID)
		case "tools/call":
			n++
			record()
			var call struct {
				Params struct {
					Arguments json.RawMessage `json:"arguments"`
				} `json:"params"`
			}
			_ = json.Unmarshal(in.Bytes(), &call)
			result := fmt.Sprintf(`"result":{"content":[{"type":"text","text":"charge #%d for %s"}]}`, n, strconv.Quote(string(call.Params.Arguments))[1:len(strconv.Quote(string(call.Params.Arguments)))-1])
			switch mode {
			case "idtype":
				line = fmt.Sprintf(`{"jsonrpc":"2.0","id":%s,%s}`, otherType(m.ID), result)
			case "batch":
				line = fmt.Sprintf(`[{"jsonrpc":"2.0","id":%s,%s}]`, m.ID, result)
			case "dupid":
				line = fmt.Sprintf(`{"jsonrpc":"2.0","id":%s,"id":%s,%s}`, m.ID, m.ID, result)
			case "pair":
				line = fmt.Sprintf(`{"jsonrpc":"2.0","id":%s,%s}`, m.ID, result)
				if held == "" {
					held = line
					continue
				}
				line, held = line+"\n"+held, ""
			default:
				line = fmt.Sprintf(`{"jsonrpc":"2.0","id":%s,%s}`, m.ID, result)
			}
		default:
			line = fmt.Sprintf(`{"jsonrpc":"2.0","id":%s,"result":{}}`, m.ID)
		}
		_, _ = out.WriteString(line + "\n")
		_ = out.Flush()
	}
}

func otherType(id json.RawMessage) string {
	var s string
	if json.Unmarshal(id, &s) == nil {
		if _, err := strconv.ParseFloat(s, 64); err == nil {
			return s
		}
		return string(id)
	}
	return strconv.Quote(string(id))
}

func record() {
	path := os.Getenv("COUNT_FILE")
	if path == "" {
		return
	}
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return
	}
	_, _ = f.WriteString("charge_card\n")
	_ = f.Close()
}
