package policystream

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"encoding/base64"
	"fmt"
	"strings"
	"testing"
	"time"
)

// jwtWithExp is a token shaped like a JWT whose exp claim is exp; the
// ticket code reads the claim only (the API server checked the token).
func jwtWithExp(exp time.Time, id string) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"ES256"}`)) + "." + enc(fmt.Appendf(nil, `{"exp":%d,"jti":%q}`, exp.Unix(), id)) + "." + enc([]byte("sig"))
}

func testTicketKey(t *testing.T) []byte {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ticketKeyOf(&tls.Certificate{PrivateKey: k})
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func TestReviewTicket(t *testing.T) {
	now := time.Now()
	key, otherKey := testTicketKey(t), testTicketKey(t)
	token := jwtWithExp(now.Add(time.Hour), "a")
	claims := ticketClaims{Namespace: "shop", ServiceAccount: "mcp", Pod: "mcp-0", UID: "uid-0", Expires: now.Add(time.Hour).Unix()}
	ticket := issueTicket(key, token, claims)
	if ticket == "" {
		t.Fatal("no ticket for a token with an expiry")
	}

	st, err := openTicket(key, ticket, token, now)
	if err != nil {
		t.Fatalf("a fresh ticket with its token: %v", err)
	}
	if got, ok := claimsOf(st, token, now); !ok || got != claims {
		t.Fatalf("the ticket stands for %+v, want %+v", got, claims)
	}
	if !st.Authenticated || st.User.Username != "system:serviceaccount:shop:mcp" {
		t.Fatalf("the ticket's review is %+v", st)
	}

	// Each way a ticket is refused, with the error that says why.
	payload, mac, _ := strings.Cut(ticket, ".")
	forgedPayload, _, _ := strings.Cut(issueTicket(key, token, ticketClaims{Namespace: "shop", ServiceAccount: "mcp", Pod: "mcp-1", UID: "uid-1", Expires: claims.Expires}), ".")
	long := ticketClaims{Namespace: "shop", ServiceAccount: "mcp", Pod: "mcp-0", UID: "uid-0", Expires: now.Add(2 * time.Hour).Unix()}
	for _, tc := range []struct {
		name, ticket, token string
		key                 []byte
		at                  time.Time
		want                string
	}{
		{"another token", ticket, jwtWithExp(now.Add(time.Hour), "b"), key, now, "not for this token"},
		{"another key (the serving certificate changed)", ticket, token, otherKey, now, "not signed by this manager's key"},
		{"another pod's claims under this MAC", forgedPayload + "." + mac, token, key, now, "not for this token"},
		{"garbled", "not a ticket", token, key, now, "garbled"},
		{"garbled MAC", payload + ".%%%", token, key, now, "garbled"},
		{"expired", ticket, token, key, now.Add(time.Hour + time.Second), "expired"},
		{"outliving its token", issueTicket(key, token, long), token, key, now, "outlives its token"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := openTicket(tc.key, tc.ticket, tc.token, tc.at); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error saying %q", err, tc.want)
			}
		})
	}

	if got := issueTicket(key, token, ticketClaims{Namespace: "shop", ServiceAccount: "mcp", Pod: "mcp-0", UID: "uid-0"}); got != "" {
		t.Fatalf("a token without expiry got ticket %q, want none", got)
	}

	// A token that claims to last a thousand years gets a ticket that
	// lasts at most maxTicketLife: a stolen serving key mints no ticket
	// for longer than that.
	far := jwtWithExp(now.AddDate(1000, 0, 0), "c")
	c, ok := claimsOf(st, far, now)
	if !ok {
		t.Fatal("no claims for a token with an expiry")
	}
	if exp := time.Unix(c.Expires, 0); exp.After(now.Add(maxTicketLife)) {
		t.Fatalf("a ticket issued now lasts until %s, longer than %s", exp, maxTicketLife)
	}
	if _, err := openTicket(key, issueTicket(key, far, c), far, now.Add(maxTicketLife+time.Second)); err == nil || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("a ticket past maxTicketLife: got %v, want expired", err)
	}
}
