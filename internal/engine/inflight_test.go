package engine

import (
	"testing"
	"time"
)

func TestInFlight(t *testing.T) {
	now := time.Unix(0, 0)
	s := NewInFlight[int](time.Minute)
	s.now = func() time.Time { return now }

	a := s.Start("a", 1)
	if a == nil || s.Start("a", 2) != nil {
		t.Fatal("a second Start of an id in flight must be refused")
	}
	s.Hold(a)
	s.Release(a)
	if _, ok := s.Get("a"); !ok {
		t.Fatal("a held call is forgotten")
	}
	s.Release(a) // last reference: grace starts
	now = now.Add(59 * time.Second)
	if _, ok := s.Get("a"); !ok {
		t.Fatal("a call released less than a minute ago is forgotten")
	}
	// The id is reused: the new call replaces the old one, and the old
	// one's late release does not touch it.
	b := s.Start("a", 3)
	if b == nil {
		t.Fatal("an id whose call ended cannot be reused")
	}
	now = now.Add(2 * time.Second)
	if c, ok := s.Get("a"); !ok || c.Value != 3 {
		t.Fatalf("Get = %v %v, want the new call", c, ok)
	}
	s.Release(b)
	now = now.Add(61 * time.Second)
	if _, ok := s.Get("a"); ok || s.Len() != 0 {
		t.Fatalf("expired calls are kept: %d", s.Len())
	}
}

// BenchmarkInFlightChurn: the cost of registering and releasing calls
// while many recently ended ones are remembered stays constant.
func BenchmarkInFlightChurn(b *testing.B) {
	s := NewInFlight[struct{}](time.Minute)
	for i := range 50_000 {
		s.Release(s.Start(string(rune(i))+"warm", struct{}{}))
	}
	i := 0
	b.ReportAllocs()
	for b.Loop() {
		i++
		c := s.Start(string(rune(i%1_000_000)), struct{}{})
		if c != nil {
			s.Release(c)
		}
	}
}
