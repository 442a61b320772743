package canonical

import (
	"math"
	"testing"
)

func TestTransform(t *testing.T) {
	tests := []struct {
		name, in, want string
	}{
		{"keys sorted", `{"b":1,"a":2}`, `{"a":2,"b":1}`},
		{"nested and arrays keep order", `{"z":[3,1,{"y":1,"x":2}]}`, `{"z":[3,1,{"x":2,"y":1}]}`},
		{"whitespace dropped", " { \"a\" : [ 1 , 2 ] } ", `{"a":[1,2]}`},
		{"1.0 is 1", `{"n":1.0}`, `{"n":1}`},
		{"exponent normalized", `{"n":1e3}`, `{"n":1000}`},
		{"negative zero", `-0.0`, `0`},
		{"large uses exponent", `1e21`, `1e+21`},
		{"below 1e21 is plain", `123456789012345678901`, `123456789012345680000`},
		{"small decimals", `0.000001`, `0.000001`},
		{"tiny uses exponent", `0.0000001`, `1e-7`},
		{"fraction", `-12.50`, `-12.5`},
		{"rfc 8785 sample", `[333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001]`, `[333333333.3333333,1e+30,4.5,0.002,1e-27]`},
		{"escapes minimal", `"\u0041\u00e9\u2028<>&\u001f\n"`, "\"A\u00e9\u2028<>&\\u001f\\n\""},
		{"utf16 key order", `{"\ud83d\ude00":1,"\ufb33":2}`, "{\"\U0001F600\":1,\"\ufb33\":2}"},
		{"literals", `[true,false,null]`, `[true,false,null]`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Transform([]byte(tt.in))
			if err != nil {
				t.Fatalf("Transform(%s): %v", tt.in, err)
			}
			if string(got) != tt.want {
				t.Errorf("Transform(%s) = %s, want %s", tt.in, got, tt.want)
			}
		})
	}
}

func TestTransformRejects(t *testing.T) {
	for _, in := range []string{`{"a":}`, `{"a":1} {}`, `1e400`, ``} {
		if got, err := Transform([]byte(in)); err == nil {
			t.Errorf("Transform(%q) = %s, want an error", in, got)
		}
	}
}

func TestAppendNumberRejectsNonFinite(t *testing.T) {
	for _, f := range []float64{math.NaN(), math.Inf(1)} {
		if _, err := AppendNumber(nil, f); err == nil {
			t.Errorf("AppendNumber(%v) succeeded, want an error", f)
		}
	}
}

func TestPointerRemove(t *testing.T) {
	tests := []struct {
		ptr, in, want string
	}{
		{"/requestedAt", `{"amount":5,"requestedAt":"now"}`, `{"amount":5}`},
		{"/order/at", `{"order":{"at":1,"id":2}}`, `{"order":{"id":2}}`},
		{"/items/1", `{"items":[1,2,3]}`, `{"items":[1,3]}`},
		{"/a~1b", `{"a/b":1,"c":2}`, `{"c":2}`},
		{"/m~0n", `{"m~n":1,"c":2}`, `{"c":2}`},
		{"/missing/deep", `{"a":1}`, `{"a":1}`},
		{"/items/9", `{"items":[1]}`, `{"items":[1]}`},
	}
	for _, tt := range tests {
		p, err := ParsePointer(tt.ptr)
		if err != nil {
			t.Fatalf("ParsePointer(%q): %v", tt.ptr, err)
		}
		v, err := Decode([]byte(tt.in))
		if err != nil {
			t.Fatal(err)
		}
		got, err := Append(nil, p.Remove(v))
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != tt.want {
			t.Errorf("remove %s from %s = %s, want %s", tt.ptr, tt.in, got, tt.want)
		}
	}
}

func TestParsePointerRejects(t *testing.T) {
	for _, s := range []string{"", "requestedAt", "/a~2", "/a~"} {
		if _, err := ParsePointer(s); err == nil {
			t.Errorf("ParsePointer(%q) succeeded, want an error", s)
		}
	}
}
