package transport

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
)

// exampleMeta is the example producer's metadata (internal/app/pattern.go):
// what the fast path is for.
var exampleMeta = []byte{0x84,
	0xa5, 'b', 'a', 't', 'c', 'h', 0xce, 0x00, 0x12, 0xd6, 0x87,
	0xa1, 't', 0xcf, 0x00, 0x00, 0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc,
	0xa5, 'd', 't', 'y', 'p', 'e', 0xa5, 'u', 'i', 'n', 't', '8',
	0xa5, 's', 'h', 'a', 'p', 'e', 0x91, 0xce, 0x00, 0x10, 0x00, 0x00}

// skipLen is what the full check says of p's first value: its length, or
// its error.
func skipLen(p []byte) (int, error) {
	r := reader{b: p}
	err := r.skip(1)
	return r.off, err
}

// nest wraps v in depth-1 one-element arrays: v's skip depth is depth.
func nest(depth int, v []byte) []byte {
	return append(bytes.Repeat([]byte{0x91}, depth-1), v...)
}

// FuzzScanValue: whatever the fast path accepts, the full check accepts,
// with the same length; so the fast path can only save time, never change
// a verdict.
func FuzzScanValue(f *testing.F) {
	f.Add(exampleMeta)
	f.Add(mustMarshal(map[string]any{"dtype": "f16", "shape": []any{2, -3, 1.5, nil, true}, "b": []byte{1, 2}}))
	f.Add(nest(maxDepth, []byte{0x01}))
	f.Add(nest(maxDepth+1, []byte{0x01}))
	f.Add([]byte{0x81, 0xa1, 'k', 0xa2, 0xc3, 0xa9})
	f.Fuzz(func(t *testing.T, p []byte) {
		n, ok := scanValue(p)
		if !ok {
			return
		}
		m, err := skipLen(p)
		if err != nil || m != n {
			t.Fatalf("scanValue(% x) = %d, ok; skip: %d, %v", p, n, m, err)
		}
	})
}

// TestScanValueCommon: the metadata producers write takes the fast path
// (every str ASCII, nothing past 8-bit lengths), here generated at random
// from what msgpack libraries write, and is accepted whole.
func TestScanValueCommon(t *testing.T) {
	for _, p := range [][]byte{
		exampleMeta,
		{0xc0}, {0x90}, {0x80}, {0xa0}, {0xc4, 0x00},
		nest(maxDepth, []byte{0x01}),
		nest(maxDepth, []byte{0x80}),
		mustMarshal(map[string]any{"dtype": "float16", "shape": []any{8, 1024}, "scale": 0.5, "neg": -129, "ok": false}),
	} {
		if n, ok := scanValue(p); !ok || n != len(p) {
			t.Errorf("scanValue(% x) = %d, %v; want %d, true", p, n, ok, len(p))
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		p := mustMarshal(randomValue(rng, 1))
		n, ok := scanValue(p)
		m, err := skipLen(p)
		if !ok || n != len(p) || err != nil || m != len(p) {
			t.Fatalf("% x: scanValue %d, %v; skip %d, %v; want %d both", p, n, ok, m, err, len(p))
		}
	}
}

// randomValue is a value of the fast path's kinds, nested at most
// maxDepth deep (depth: the value's skip depth).
func randomValue(rng *rand.Rand, depth int) any {
	k := rng.IntN(9)
	if depth == maxDepth && k >= 7 {
		k = rng.IntN(7)
	}
	switch k {
	case 0:
		return nil
	case 1:
		return rng.IntN(2) == 0
	case 2:
		return rng.Int64N(1<<40) - 1<<39
	case 3:
		return rng.Uint64()
	case 4:
		return rng.Float64()
	case 5:
		return strings.Repeat("x", rng.IntN(256))
	case 6:
		return bytes.Repeat([]byte{0xff}, rng.IntN(256))
	case 7:
		a := make([]any, rng.IntN(4))
		for i := range a {
			a[i] = randomValue(rng, depth+1)
		}
		return a
	}
	m := map[string]any{}
	for i := rng.IntN(4); i > 0; i-- {
		m[strings.Repeat("k", rng.IntN(40))] = randomValue(rng, depth+1)
	}
	return m
}

// TestScanValueLeavesToSkip: what the fast path does not take, the full
// check decides, as before it existed.
func TestScanValueLeavesToSkip(t *testing.T) {
	for _, c := range []struct {
		name string
		p    []byte
		ok   bool // checkMeta accepts it
	}{
		{"a str that is not ASCII", mustMarshal("é"), true},
		{"a key that is not ASCII", mustMarshal(map[string]any{"é": 1}), true},
		{"str 16", mustMarshal(strings.Repeat("a", 300)), true},
		{"array 16", mustMarshal(make([]any, 20)), true},
		{"invalid UTF-8", []byte{0xa2, 0xc3, 0x28}, false},
		{"a lone 0x80 in a str", []byte{0xa5, 0x30, 0x80, 0x30, 0x30, 0x30}, false},
		{"a lone 0x80 in a key", []byte{0x81, 0xa1, 0x80, 0x01}, false},
		{"an int key", []byte{0x81, 0x01, 0x01}, false},
		{"ext", []byte{0xd4, 0x01, 0x02}, false},
		{"0xc1", []byte{0xc1}, false},
		{"too deep", nest(maxDepth+1, []byte{0x01}), false},
		{"a map too deep", nest(maxDepth, []byte{0x81, 0xa1, 'k', 0x01}), false},
		{"ends early", exampleMeta[:len(exampleMeta)-1], false},
		{"a count past the end", []byte{0x9f, 0x01}, false},
		{"bytes after the value", append(append([]byte{}, exampleMeta...), 0x01), false},
		{"two values", []byte{0xc0, 0xc0}, false},
	} {
		if n, ok := scanValue(c.p); ok && n == len(c.p) {
			t.Errorf("%s: scanValue(% x) took it: the test no longer reaches skip", c.name, c.p)
		}
		err := checkMeta(c.p)
		if c.ok && err != nil {
			t.Errorf("%s: checkMeta(% x) = %v, want nil", c.name, c.p, err)
		}
		if !c.ok && !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: checkMeta(% x) = %v, want ErrMalformed", c.name, c.p, err)
		}
	}
}

// BenchmarkCheckMeta: the example producer's metadata, checked once per
// offer on each side. go test -bench CheckMeta ./transport
func BenchmarkCheckMeta(b *testing.B) {
	b.Run("fast", func(b *testing.B) {
		for b.Loop() {
			if err := checkMeta(exampleMeta); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("full", func(b *testing.B) {
		for b.Loop() {
			if _, err := skipLen(exampleMeta); err != nil {
				b.Fatal(err)
			}
		}
	})
}
