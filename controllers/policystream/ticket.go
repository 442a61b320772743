package policystream

import (
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	authnv1 "k8s.io/api/authentication/v1"

	"github.com/idemcp/idemcp/internal/policywire"
)

// A review ticket is what the manager hands a sidecar after a TokenReview
// accepted its token: the review's result, signed with a key every manager
// replica derives from the serving key they share. A successor presented
// the same token and a valid ticket takes the review from the ticket, so a
// failover costs no TokenReview per sidecar (10,000 of them took 100s at
// 100 a second). The pod checks are made as for a review: the pod must
// still exist with the ticket's UID.
//
// The ticket is bound to the token (its MAC covers the token's hash), so
// it is worth nothing without it, and it ends when the token does. It
// grants no more than the stream it came with: one held until the token
// expires. Like that stream, it does not notice a service account deleted
// meanwhile; the pod's deletion it does.

// ticketClaims is what a ticket vouches for.
type ticketClaims struct {
	Namespace      string `json:"ns"`
	ServiceAccount string `json:"sa"`
	Pod            string `json:"pod"`
	UID            string `json:"uid"`
	Expires        int64  `json:"exp"` // unix seconds, the token's own exp
}

// ticketInfo names the HKDF output, so the key is used for nothing else.
const ticketInfo = "idemcp policy stream review ticket v1"

// ticketKeyOf derives the ticket key from the serving certificate's
// private key, which every replica loads from the same Secret.
func ticketKeyOf(cert *tls.Certificate) ([]byte, error) {
	if cert == nil || cert.PrivateKey == nil {
		return nil, errors.New("no serving key")
	}
	der, err := x509.MarshalPKCS8PrivateKey(cert.PrivateKey)
	if err != nil {
		return nil, fmt.Errorf("reading the serving key: %w", err)
	}
	return hkdf.Key(sha256.New, der, nil, ticketInfo, 32)
}

// ticketKeys returns the ticket key of the serving certificate current,
// derived again only when the certificate changes.
func ticketKeys(current func(*tls.ClientHelloInfo) (*tls.Certificate, error)) func() ([]byte, error) {
	type derived struct {
		cert *tls.Certificate
		key  []byte
	}
	var last atomic.Pointer[derived]
	return func() ([]byte, error) {
		cert, err := current(nil)
		if err != nil {
			return nil, err
		}
		if d := last.Load(); d != nil && d.cert == cert {
			return d.key, nil
		}
		key, err := ticketKeyOf(cert)
		if err != nil {
			return nil, err
		}
		last.Store(&derived{cert: cert, key: key})
		return key, nil
	}
}

func ticketMAC(key []byte, payload, token string) []byte {
	m := hmac.New(sha256.New, key)
	tokenSum := sha256.Sum256([]byte(token))
	m.Write(tokenSum[:])
	m.Write([]byte(payload))
	return m.Sum(nil)
}

// issueTicket returns the ticket for token with claims c; "" when the
// token has no expiry (a ticket never outlives its token).
func issueTicket(key []byte, token string, c ticketClaims) string {
	if c.Expires == 0 {
		return ""
	}
	b, err := json.Marshal(c)
	if err != nil {
		return ""
	}
	payload := base64.RawURLEncoding.EncodeToString(b)
	return payload + "." + base64.RawURLEncoding.EncodeToString(ticketMAC(key, payload, token))
}

// openTicket checks ticket against token and returns the review it
// stands for. Its errors say why it is refused; the caller then reviews
// the token.
func openTicket(key []byte, ticket, token string, now time.Time) (authnv1.TokenReviewStatus, error) {
	payload, mac, ok := strings.Cut(ticket, ".")
	if !ok {
		return authnv1.TokenReviewStatus{}, errors.New("the review ticket is garbled")
	}
	sig, err := base64.RawURLEncoding.DecodeString(mac)
	if err != nil {
		return authnv1.TokenReviewStatus{}, errors.New("the review ticket is garbled")
	}
	if !hmac.Equal(sig, ticketMAC(key, payload, token)) {
		return authnv1.TokenReviewStatus{}, errors.New("the review ticket is not for this token, or not signed by this manager's key (the serving certificate changed?)")
	}
	b, err := base64.RawURLEncoding.DecodeString(payload)
	if err != nil {
		return authnv1.TokenReviewStatus{}, errors.New("the review ticket is garbled")
	}
	var c ticketClaims
	if err := json.Unmarshal(b, &c); err != nil || c.Namespace == "" || c.ServiceAccount == "" || c.Pod == "" || c.UID == "" {
		return authnv1.TokenReviewStatus{}, errors.New("the review ticket is garbled")
	}
	exp := time.Unix(c.Expires, 0)
	if tokenExp := tokenExpiry(token); tokenExp.IsZero() || exp.After(tokenExp) {
		return authnv1.TokenReviewStatus{}, errors.New("the review ticket outlives its token")
	}
	if !now.Before(exp) {
		return authnv1.TokenReviewStatus{}, fmt.Errorf("the review ticket expired at %s", exp.UTC().Format(time.RFC3339))
	}
	return authnv1.TokenReviewStatus{
		Authenticated: true,
		Audiences:     []string{policywire.TokenAudience},
		User: authnv1.UserInfo{
			Username: "system:serviceaccount:" + c.Namespace + ":" + c.ServiceAccount,
			Extra:    map[string]authnv1.ExtraValue{extraPodName: {c.Pod}, extraPodUID: {c.UID}},
		},
	}, nil
}

// maxTicketLife bounds a ticket whatever its token's expiry says: the
// serving key signs tickets, so whoever steals it could mint a ticket for
// a token of their own making, and this bounds for how long. A kubelet
// replaces a pod's token well within it (at 80% of its hour), and a
// sidecar with a new token is reviewed anyway.
const maxTicketLife = time.Hour

// claimsOf is what a ticket for st and token, issued at now, says; ok is
// false when st would not make one (not bound to a pod, no expiry).
func claimsOf(st authnv1.TokenReviewStatus, token string, now time.Time) (ticketClaims, bool) {
	ns, sa, ok := serviceAccount(st.User.Username)
	names, uids := st.User.Extra[extraPodName], st.User.Extra[extraPodUID]
	exp := tokenExpiry(token)
	if !ok || len(names) != 1 || len(uids) != 1 || exp.IsZero() {
		return ticketClaims{}, false
	}
	if limit := now.Add(maxTicketLife); exp.After(limit) {
		exp = limit
	}
	return ticketClaims{Namespace: ns, ServiceAccount: sa, Pod: names[0], UID: uids[0], Expires: exp.Unix()}, true
}
