package canonical

import (
	"encoding/json"
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
		{"below 1e21 is plain", `123456789012345000000`, `123456789012345000000`},
		{"small decimals", `0.000001`, `0.000001`},
		{"tiny uses exponent", `0.0000001`, `1e-7`},
		{"fraction", `-12.50`, `-12.5`},
		{"rfc 8785 sample", `[333333333.3333333, 1E30, 4.50, 2e-3, 0.000000000000000000000000001]`, `[333333333.3333333,1e+30,4.5,0.002,1e-27]`},
		{"exact beyond a double", `[9007199254740993, 9007199254740992, 9007199254740993.0, 90071992547409930e-1]`, `[9007199254740993e0,9007199254740992,9007199254740993e0,9007199254740993e0]`},
		{"shortest double form kept", `0.1`, `0.1`},
		{"zeros", `[0, -0, 0.0, -0e5, 0.000e10]`, `[0,0,0,0,0]`},
		{"subnormals keep their digits", `[3e-324, 4e-324, 5e-324]`, `[3e-324,4e-324,5e-324]`},
		{"beyond the double range", `[1e-400, 2e-400]`, `[1e-400,2e-400]`},
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
	for _, in := range []string{`{"a":}`, `{"a":1} {}`, `1e400`, ``, `{"a":1,"a":2}`, `"\ud800"`, `"\udc00x"`, "\"\xff\"", `[01]`, `[1.]`, `1e99999999999999999999`, `{"a" 1}`, "\"a\tb\""} {
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

// FuzzTransform: what the parser accepts, encoding/json accepts too; the
// canonical form is valid JSON and canonical itself.
func FuzzTransform(f *testing.F) {
	for _, s := range []string{`{"b":1,"a":[1.0,"x\u00e9",null,true]}`, `-0.0`, `1e21`, `"\ud83d\ude00"`, `{"a":{"b":{}}}`, `9007199254740993`, `[]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		out, err := Transform(data)
		if err != nil {
			return
		}
		if !json.Valid(data) {
			t.Fatalf("accepted invalid JSON %q", data)
		}
		if !json.Valid(out) {
			t.Fatalf("canonical form %q of %q is not JSON", out, data)
		}
		again, err := Transform(out)
		if err != nil || string(again) != string(out) {
			t.Fatalf("canonical form %q is not a fixed point: %q, %v", out, again, err)
		}
	})
}
