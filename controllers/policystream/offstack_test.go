package policystream

import (
	"errors"
	"net/http"
	"runtime"
	"strings"
	"testing"
)

// TestOffStackPanicsOnTheCaller: a panic in the function, or a function
// that exits its goroutine, is raised on the caller's goroutine, where
// net/http's recovery of a handler ends one stream, not the manager.
func TestOffStackPanicsOnTheCaller(t *testing.T) {
	recovered := func(f func() (int, error)) (v any) {
		defer func() { v = recover() }()
		_, _ = offStack(f)
		return nil
	}
	if v := recovered(func() (int, error) { panic("boom") }); v == nil || !strings.Contains(v.(string), "boom") {
		t.Fatalf("a panic in f: the caller recovered %v, want it naming boom", v)
	}
	if v := recovered(func() (int, error) { panic(http.ErrAbortHandler) }); v != http.ErrAbortHandler { //nolint:errorlint // the same value, as net/http compares it
		t.Fatalf("panic(http.ErrAbortHandler) in f: the caller recovered %v, want it as it was", v)
	}
	if v := recovered(func() (int, error) { runtime.Goexit(); return 0, nil }); v == nil {
		t.Fatal("an f that exited its goroutine: the caller went on as if it had returned")
	}
	wantErr := errors.New("refused")
	if v, err := offStack(func() (int, error) { return 7, wantErr }); v != 7 || !errors.Is(err, wantErr) {
		t.Fatalf("offStack = %d, %v; want f's 7, %v", v, err, wantErr)
	}
}
