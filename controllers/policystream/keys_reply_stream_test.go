package policystream

import (
	"testing"

	"github.com/idemcp/idemcp/internal/policywire"
)

// A keys request sent to shop/mcp-0 is answered only on shop/mcp-0's
// stream: a sidecar of another namespace whose pod has the same name
// (mcp-0 of a StatefulSet) sending a reply with that id is not taken for
// shop/mcp-0's keys.
func TestKeysReplyFromSameNamedPodInAnotherNamespaceIsIgnored(t *testing.T) {
	var k keyAnswers
	asked := &stream{pod: "mcp-0", uid: "uid-shop"}
	other := &stream{pod: "mcp-0", uid: "uid-attacker"}
	ch := k.expect(asked, "1a-keys")
	k.deliver(other, &policywire.KeysReply{ID: "1a-keys"})
	select {
	case <-ch:
		t.Fatal("a reply from another namespace's pod of the same name was accepted")
	default:
	}
	// The stream asked still gets its answer.
	want := &policywire.KeysReply{ID: "1a-keys"}
	k.deliver(asked, want)
	select {
	case got := <-ch:
		if got != want {
			t.Fatalf("got reply %+v, want %+v", got, want)
		}
	default:
		t.Fatal("the reply from the stream asked was not delivered")
	}
}

// Keys request ids are random, not a counter a sidecar can read off its
// snapshots' nonces and guess.
func TestKeysRequestIDsAreNotGuessable(t *testing.T) {
	a, err := newKeysID()
	if err != nil {
		t.Fatal(err)
	}
	b, err := newKeysID()
	if err != nil {
		t.Fatal(err)
	}
	if a == b {
		t.Fatalf("two request ids are the same: %q", a)
	}
	if len(a) < 32+len("-keys") {
		t.Fatalf("request id %q is too short to be unguessable", a)
	}
}
