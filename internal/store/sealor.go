package store

import "log/slog"

// SealSetup is how a process (the sidecar, the wrapper, the library) seals
// the store it opened: the one place that decides between sealing and the
// warning that results are stored unsealed.
type SealSetup struct {
	// Keyring seals; nil leaves the store unsealed, after Unsealed.
	Keyring *Keyring
	// Context is SealOptions.Context: the store's key prefix.
	Context string
	Log     *slog.Logger
	// Unsealed is the warning logged without a Keyring ("": none).
	Unsealed string
	// OpenFailed is the warning logged for each stored result that fails
	// to open, with its key and reason.
	OpenFailed string
	// Attrs go with both warnings.
	Attrs []any
	// Counted is told each open failure's reason (nil: nothing counts).
	Counted func(reason string)
}

// SealOrWarn returns st sealed under s.Keyring, or st itself after the
// warning s.Unsealed when there is no keyring.
func SealOrWarn(st Store, s SealSetup) Store {
	if s.Keyring == nil {
		if s.Unsealed != "" {
			s.Log.Warn(s.Unsealed, s.Attrs...)
		}
		return st
	}
	return Seal(st, SealOptions{
		Keyring: s.Keyring,
		Context: s.Context,
		OnOpenFailure: func(key, reason string) {
			if s.Counted != nil {
				s.Counted(reason)
			}
			s.Log.Warn(s.OpenFailed, append(append([]any{}, s.Attrs...), "key", key, "reason", reason)...)
		},
	})
}
