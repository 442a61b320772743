package store

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"
)

// A sealed record is
//
//	version (1 byte, sealVersion) | key id (4 bytes) | expiry (8 bytes, Unix ms) | nonce (12 bytes) | AES-256-GCM ciphertext and tag
//
// and its associated data is the version, key id and expiry, the store's
// context (its key prefix) and the record's key: a record copied under
// another key, or into another policy's key space, does not open, and
// neither does one restored after its expiry (SealExpiryGrace).
const (
	sealVersion  = 2 // 2: the expiry is sealed too
	sealKeyIDLen = 4
	sealExpiry   = 8
	sealNonceLen = 12
	sealAD       = 1 + sealKeyIDLen + sealExpiry
	sealHeader   = sealAD + sealNonceLen
	// SealKeyBytes is the length of a seal key (AES-256).
	SealKeyBytes = 32
	// SealOverhead is what sealing adds to each stored response.
	SealOverhead = sealHeader + 16
)

// Reasons a record fails to open (SealOptions.OnOpenFailure).
const (
	OpenMalformed  = "malformed"   // too short, or not a sealed record of a known version
	OpenUnknownKey = "unknown_key" // sealed under a key this keyring does not hold
	OpenForged     = "forged"      // the tag does not verify: altered, planted, or copied from another key
	OpenExpired    = "expired"     // genuine, but past its expiry: copied out and restored after its TTL
)

// SealExpiryGrace is how long past its sealed expiry a record still opens:
// the clocks of the sidecars that write and read a store may differ by
// this much. A reader whose clock runs further ahead treats results as
// expired early and runs their calls again, so keep node clocks in sync.
const SealExpiryGrace = 2 * time.Minute

type sealKey struct {
	id   [sealKeyIDLen]byte
	aead cipher.AEAD
}

// Keyring holds the seal keys of a policy: the first seals, every one
// opens. Keeping the previous key after a rotation lets records sealed
// under it be read until they expire.
type Keyring struct {
	keys []sealKey
}

// SealKeyID names a key without revealing it: the first bytes of a hash
// of it, in hex. Records carry it so that the right key is tried.
func SealKeyID(key []byte) string {
	id := keyID(key)
	return hex.EncodeToString(id[:])
}

func keyID(key []byte) [sealKeyIDLen]byte {
	h := sha256.Sum256(append([]byte("idemcp seal key id\x00"), key...))
	var id [sealKeyIDLen]byte
	copy(id[:], h[:])
	return id
}

// NewKeyring makes a keyring; keys[0] seals. Each key is SealKeyBytes long.
func NewKeyring(keys ...[]byte) (*Keyring, error) {
	if len(keys) == 0 {
		return nil, errors.New("a keyring needs at least one key")
	}
	k := &Keyring{}
	for i, raw := range keys {
		if len(raw) != SealKeyBytes {
			return nil, fmt.Errorf("seal key %d is %d bytes long; a seal key is %d random bytes (AES-256)", i+1, len(raw), SealKeyBytes)
		}
		block, err := aes.NewCipher(raw)
		if err != nil {
			return nil, fmt.Errorf("seal key %d: %w", i+1, err)
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return nil, fmt.Errorf("seal key %d: %w", i+1, err)
		}
		k.keys = append(k.keys, sealKey{id: keyID(raw), aead: aead})
	}
	return k, nil
}

// ParseKeyring reads a keyring as the Secret holds it: base64 keys (standard
// or URL alphabet, padded or not) separated by commas, spaces or newlines,
// the current key first. Lines starting with # are comments.
func ParseKeyring(text string) (*Keyring, error) {
	var keys [][]byte
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "#") {
			continue
		}
		for _, f := range strings.FieldsFunc(line, func(r rune) bool { return r == ',' || r == ' ' || r == '\t' || r == '\r' }) {
			raw, err := decodeKey(f)
			if err != nil {
				return nil, fmt.Errorf("seal key %d is not base64: %w; a seal key is %d random bytes in base64, such as the output of: head -c %d /dev/urandom | base64",
					len(keys)+1, err, SealKeyBytes, SealKeyBytes)
			}
			keys = append(keys, raw)
		}
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("no seal key given; a seal key is %d random bytes in base64, such as the output of: head -c %d /dev/urandom | base64", SealKeyBytes, SealKeyBytes)
	}
	return NewKeyring(keys...)
}

func decodeKey(s string) ([]byte, error) {
	s = strings.TrimRight(s, "=")
	enc := base64.RawStdEncoding
	if strings.ContainsAny(s, "-_") {
		enc = base64.RawURLEncoding
	}
	return enc.DecodeString(s)
}

// CurrentID is the id of the key that seals.
func (k *Keyring) CurrentID() string { return hex.EncodeToString(k.keys[0].id[:]) }

// IDs are the ids of every key, the current one first.
func (k *Keyring) IDs() []string {
	out := make([]string, len(k.keys))
	for i, key := range k.keys {
		out[i] = hex.EncodeToString(key.id[:])
	}
	return out
}

func associatedData(header []byte, context, key string) []byte {
	ad := make([]byte, 0, sealAD+binary.MaxVarintLen64+len(context)+len(key))
	ad = append(ad, header[:sealAD]...)
	ad = binary.AppendUvarint(ad, uint64(len(context)))
	ad = append(ad, context...)
	return append(ad, key...)
}

// Seal encrypts plaintext for the record at key with the current key,
// binding the time it expires.
func (k *Keyring) Seal(context, key string, expires time.Time, plaintext []byte) []byte {
	cur := k.keys[0]
	out := make([]byte, sealHeader, sealHeader+len(plaintext)+cur.aead.Overhead())
	out[0] = sealVersion
	copy(out[1:], cur.id[:])
	binary.BigEndian.PutUint64(out[1+sealKeyIDLen:sealAD], uint64(max(expires.UnixMilli(), 0)))
	nonce := out[sealAD:sealHeader]
	_, _ = rand.Read(nonce) // crypto/rand.Read never fails (Go 1.24)
	return cur.aead.Seal(out, nonce, plaintext, associatedData(out, context, key))
}

// Open decrypts a record sealed for key, with whichever key sealed it, if
// it had not expired at now. The reason is one of the Open* constants when
// it fails.
func (k *Keyring) Open(context, key string, record []byte, now time.Time) (plaintext []byte, reason string, ok bool) {
	if len(record) < SealOverhead || record[0] != sealVersion {
		return nil, OpenMalformed, false
	}
	id := record[1 : 1+sealKeyIDLen]
	reason = OpenUnknownKey
	for _, sk := range k.keys {
		if string(sk.id[:]) != string(id) {
			continue
		}
		out, err := sk.aead.Open(nil, record[sealAD:sealHeader], record[sealHeader:], associatedData(record, context, key))
		if err == nil {
			expires := int64(binary.BigEndian.Uint64(record[1+sealKeyIDLen : sealAD])) //nolint:gosec // written from a non-negative int64
			if now.UnixMilli() > expires {
				return nil, OpenExpired, false
			}
			if out == nil {
				out = []byte{}
			}
			return out, "", true
		}
		reason = OpenForged
	}
	return nil, reason, false
}

// SealOptions configure a sealed store.
type SealOptions struct {
	Keyring *Keyring
	// Context is bound into every record besides its key: the store's key
	// prefix, so that records of another policy or server never open here
	// even under the same key.
	Context string
	// OnOpenFailure is told of every stored result that failed to open (to
	// count and log it); the call then runs as if there were none. It is
	// never given key material or the record.
	OnOpenFailure func(key, reason string)
	// ExpiryGrace is how long past its expiry a record still opens
	// (default SealExpiryGrace).
	ExpiryGrace time.Duration
	// Now is the sidecar's clock, which sealed expiries are written and
	// checked by (default the wall clock).
	Now func() time.Time
}

// sealAttempts bounds how often Reserve replaces results that fail to open
// before it gives up: more than one only when someone keeps writing them.
const sealAttempts = 4

// Sealed is a Store whose stored responses are sealed with authenticated
// encryption (AES-256-GCM) bound to their key. Whoever can read the store
// cannot read results, and whoever can write to it cannot plant one that a
// retry replays: a result that fails to open counts as absent, and the
// caller claims the key in its place as one atomic step of the store
// (Claim.Discard), so two callers never both run. Claims hold only hashes
// and are not sealed.
type Sealed struct {
	Store
	ring   *Keyring
	ctx    string
	onFail func(key, reason string)
	grace  time.Duration
	now    func() time.Time
}

var _ Store = (*Sealed)(nil)

// Seal wraps a store so that every response it keeps is sealed.
func Seal(inner Store, o SealOptions) *Sealed {
	onFail := o.OnOpenFailure
	if onFail == nil {
		onFail = func(string, string) {}
	}
	grace := o.ExpiryGrace
	if grace <= 0 {
		grace = SealExpiryGrace
	}
	now := o.Now
	if now == nil {
		now = wallClock
	}
	return &Sealed{Store: inner, ring: o.Keyring, ctx: o.Context, onFail: onFail, grace: grace, now: now}
}

// Reserve implements Store: a completed record is opened, and one that
// does not open is replaced by this claim.
func (s *Sealed) Reserve(ctx context.Context, c Claim) (Reservation, error) {
	for range sealAttempts {
		r, err := s.Store.Reserve(ctx, c)
		if err != nil || r.State != Completed {
			return r, err
		}
		plain, reason, ok := s.ring.Open(s.ctx, c.Key, r.Response, s.now().Add(-s.grace))
		if ok {
			r.Response = plain
			return r, nil
		}
		s.onFail(c.Key, reason)
		c.Discard = r.Response
		if c.Discard == nil {
			c.Discard = []byte{}
		}
	}
	return Reservation{}, fmt.Errorf("reserve %s: %w: the stored result kept failing to open after %d replacements (is someone writing to the store with another seal key?)",
		c.Key, ErrUnavailable, sealAttempts)
}

// Complete implements Store.
func (s *Sealed) Complete(ctx context.Context, key, owner string, response []byte, ttl time.Duration) error {
	return s.Store.Complete(ctx, key, owner, s.ring.Seal(s.ctx, key, s.now().Add(ttl), response), ttl)
}

// Unwrap returns the store underneath.
func (s *Sealed) Unwrap() Store { return s.Store }
