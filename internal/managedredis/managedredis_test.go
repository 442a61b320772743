package managedredis

import "testing"

func TestAddr(t *testing.T) {
	if got, want := Addr("shop", "payments"), "payments-redis.shop.svc:6379"; got != want {
		t.Errorf("Addr = %q, want %q", got, want)
	}
}
