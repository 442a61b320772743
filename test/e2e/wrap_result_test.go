package e2e_test

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// rawStdioServer answers each tools/call with $RESULT as its result and
// counts the calls in $COUNT_FILE: a non-conforming stdio server.
const rawStdioServer = `
const fs = require("fs");
require("readline").createInterface({input: process.stdin}).on("line", (line) => {
  const m = JSON.parse(line);
  if (m.id === undefined) return;
  let result = "{}";
  if (m.method === "tools/call") { fs.appendFileSync(process.env.COUNT_FILE, "x"); result = process.env.RESULT; }
  process.stdout.write('{"jsonrpc":"2.0","id":' + JSON.stringify(m.id) + ',"result":' + result + '}\n');
});
`

// idemcp wrap survives any result a stdio server sends (it used to crash
// on a null result or a null _meta), stores it and replays it.
func TestWrapAnyResult(t *testing.T) {
	t.Parallel()
	node, _ := lookupNode(t)
	bins := buildWrapBins(t)
	for _, tt := range []struct{ result, replay string }{
		{`null`, `null`},
		{`5`, `5`},
		{`{"_meta":null}`, `{"_meta":{"idemcp.io/replayed":true}}`},
	} {
		t.Run(tt.result, func(t *testing.T) {
			countFile := filepath.Join(t.TempDir(), "count")
			cmd := exec.Command(bins.idemcp, "wrap", "--", node, "-e", rawStdioServer)
			cmd.Env = append(os.Environ(), "RESULT="+tt.result, "COUNT_FILE="+countFile)
			stdin, _ := cmd.StdinPipe()
			stdout, _ := cmd.StdoutPipe()
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			lines := make(chan string, 8)
			go func() {
				sc := bufio.NewScanner(stdout)
				for sc.Scan() {
					lines <- sc.Text()
				}
				close(lines)
			}()
			next := func() string {
				select {
				case l, ok := <-lines:
					if !ok {
						t.Fatal("idemcp wrap ended its output: did it crash?")
					}
					return l
				case <-time.After(10 * time.Second):
					t.Fatal("no answer within 10s")
				}
				return ""
			}
			for i := 1; i <= 3; i++ {
				_, _ = fmt.Fprintf(stdin, `{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"charge_card","arguments":{"amount":5}}}`+"\n", i)
				want := tt.result
				if i > 1 {
					want = tt.replay
				}
				if got, w := next(), fmt.Sprintf(`"result":%s}`, want); !strings.HasSuffix(got, w) || !strings.Contains(got, fmt.Sprintf(`"id":%d`, i)) {
					t.Errorf("call %d: %s, want id %d and a line ending %s", i, got, i, w)
				}
			}
			_ = stdin.Close()
			if err := cmd.Wait(); err != nil {
				t.Errorf("idemcp wrap exited with %v", err)
			}
			if b, _ := os.ReadFile(countFile); len(b) != 1 {
				t.Errorf("the tool ran %d times, want 1", len(b))
			}
		})
	}
}
