package e2e_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemcp/idemcp/internal/mcpmsg"
	"github.com/idemcp/idemcp/sidecar"
)

// everythingSession opens a 2025-11-25 session with server-everything at
// url/mcp and returns the headers its requests carry.
func everythingSession(t *testing.T, url string, auth string) http.Header {
	t.Helper()
	hdr := http.Header{"Authorization": {auth}, "Mcp-Protocol-Version": {"2025-11-25"}}
	resp, r := post(t, url+"/mcp", `{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{"tasks":{}},"clientInfo":{"name":"e2e","version":"1"}}}`, hdr)
	sess := resp.Header.Get("Mcp-Session-Id")
	if resp.StatusCode != http.StatusOK || r.Error != nil || sess == "" {
		t.Fatalf("initialize: HTTP %d, error %+v, session %q", resp.StatusCode, r.Error, sess)
	}
	hdr.Set("Mcp-Session-Id", sess)
	post(t, url+"/mcp", `{"jsonrpc":"2.0","method":"notifications/initialized"}`, hdr)
	return hdr
}

type taskReply struct {
	Task struct {
		TaskID string `json:"taskId"`
	} `json:"task"`
}

// A task-creating call's CreateTaskResult is replayed to its retry in the
// session that created it; from another session, where server-everything
// could not find the task, the retry is refused with -32016 and nothing
// runs again.
func TestTaskReplayStaysInItsSession(t *testing.T) {
	node, npm := lookupNode(t)
	ensureTSDeps(t, npm)
	legacyEnsureEverything(t, npm)
	upstream := startEverything(t, node, "streamableHttp")
	sc, err := sidecar.New(sidecar.Options{Upstream: upstream, LogLevel: "error"})
	if err != nil {
		t.Fatal(err)
	}
	proxy := httptest.NewServer(sc.Handler())
	t.Cleanup(proxy.Close)

	createTask := func(hdr http.Header, id int) (*http.Response, rpcReply) {
		h := hdr.Clone()
		h.Set("Idempotency-Key", "research-1")
		return post(t, proxy.URL+"/mcp", fmt.Sprintf(`{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"simulate-research-query","arguments":{"topic":"otters"},"task":{"ttl":60000}}}`, id), h)
	}
	a := everythingSession(t, proxy.URL, "Bearer alice")
	_, first := createTask(a, 1)
	var created taskReply
	if first.Error != nil || json.Unmarshal(first.Result, &created) != nil || created.Task.TaskID == "" {
		t.Fatalf("creating the task: error %+v, result %s", first.Error, first.Result)
	}
	resp, again := createTask(a, 2)
	var replay taskReply
	_ = json.Unmarshal(again.Result, &replay)
	if resp.Header.Get("Idempotent-Replayed") != "true" || replay.Task.TaskID != created.Task.TaskID {
		t.Fatalf("retry in the same session: replayed=%q task %q, want the replay of task %q", resp.Header.Get("Idempotent-Replayed"), replay.Task.TaskID, created.Task.TaskID)
	}
	get := fmt.Sprintf(`{"jsonrpc":"2.0","id":3,"method":"tasks/get","params":{"taskId":%q}}`, created.Task.TaskID)
	if _, r := post(t, proxy.URL+"/mcp", get, a); r.Error != nil {
		t.Errorf("tasks/get in the task's session: %+v", r.Error)
	}

	b := everythingSession(t, proxy.URL, "Bearer alice")
	// Control: the task cannot be read from another session.
	if _, r := post(t, proxy.URL+"/mcp", get, b); r.Error == nil {
		t.Errorf("tasks/get from another session succeeded (%s): server-everything keeps tasks per session, the premise of this test", r.Result)
	}
	_, other := createTask(b, 4)
	if other.Error == nil || other.Error.Code != mcpmsg.CodeTaskElsewhere || !strings.Contains(other.Error.Message, "session") {
		t.Fatalf("retry from another session: error %+v, result %s; want -32016", other.Error, other.Result)
	}
}
