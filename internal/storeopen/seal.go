package storeopen

import (
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemcp/idemcp/internal/store"
)

// SealKeysEnv holds the seal keyring in a pod: the webhook sets it from
// the policy's seal Secret with a secretKeyRef, so keys never travel in
// the policy or on the policy stream.
const SealKeysEnv = "IDEMCP_SEAL_KEYS"

func (o *Options) sealFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.SealKeysFile, "seal-keys-file", "",
		"file holding the seal keyring: base64 AES-256 keys separated by commas or newlines, the current one first (default: $"+SealKeysEnv+"; none: results are stored unsealed)")
}

// NewSealMetrics registers idemcp_sealed_open_failures_total with reg (nil:
// not registered).
func NewSealMetrics(reg prometheus.Registerer) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "idemcp_sealed_open_failures_total",
		Help: "Stored results that failed to open (malformed, unknown_key, forged, expired) and were treated as absent: the call ran as new, once.",
	}, []string{"reason"})
	for _, r := range []string{store.OpenMalformed, store.OpenUnknownKey, store.OpenForged} {
		c.WithLabelValues(r)
	}
	if reg != nil {
		reg.MustRegister(c)
	}
	return c
}

// sealKeyring reads the keyring from --seal-keys-file or $IDEMCP_SEAL_KEYS;
// nil when neither is set.
func sealKeyring(o Options) (*store.Keyring, error) {
	if o.SealKeysFile != "" {
		b, err := os.ReadFile(o.SealKeysFile)
		if err != nil {
			return nil, fmt.Errorf("--seal-keys-file: %w", err)
		}
		ring, err := store.ParseKeyring(string(b))
		if err != nil {
			return nil, fmt.Errorf("--seal-keys-file %s: %w", o.SealKeysFile, err)
		}
		return ring, nil
	}
	text, ok := os.LookupEnv(SealKeysEnv)
	if !ok {
		return nil, nil
	}
	ring, err := store.ParseKeyring(text)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", SealKeysEnv, err)
	}
	return ring, nil
}

// sealStore seals st's records when there is a keyring. Without one a
// shared store gets a warning (whoever can write to it can plant a result
// that a retry replays); the memory store, inside the process, a note.
func sealStore(st store.Store, ring *store.Keyring, prefix string, o Options, log *slog.Logger) store.Store {
	unsealed := "Results are stored unsealed: whoever can read the store reads them, and whoever can write to it can plant a result that a retry replays; give a seal key with --seal-keys-file or " + SealKeysEnv + " (in a pod the webhook does)"
	switch _, memory := st.(*store.Memory); {
	case ring == nil && memory:
		log.Info("Results are stored unsealed (memory store, no seal key)")
		unsealed = ""
	case ring != nil:
		log.Info("Results are sealed", "keyID", ring.CurrentID(), "keyIDs", strings.Join(ring.IDs(), ","))
	}
	var counted func(string)
	if failures := o.SealOpenFailures; failures != nil {
		counted = func(reason string) { failures.WithLabelValues(reason).Inc() }
	}
	return store.SealOrWarn(st, store.SealSetup{
		Keyring: ring, Context: prefix, Log: log, Unsealed: unsealed, Counted: counted,
		OpenFailed: "A stored result failed to open and is treated as absent; the call runs as new",
	})
}
