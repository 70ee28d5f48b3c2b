//go:build linux

package share_test

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// TestViewMetaRoundTrip: ViewMeta encodes to the section 4.2 map (what a
// Python consumer reads: plain msgpack with "dtype", "shape" and the other
// keys beside them) and decodes back, and View reads it.
func TestViewMetaRoundTrip(t *testing.T) {
	in := share.ViewMeta{DType: "float32", Shape: []uint64{4, 256}, Extra: map[string]any{"batch": 7}}
	b, err := share.EncodeMeta(in)
	if err != nil {
		t.Fatal(err)
	}
	var plain map[string]any
	if err := msgpack.Unmarshal(b, &plain); err != nil {
		t.Fatal(err)
	}
	if plain["dtype"] != "float32" || len(plain) != 3 {
		t.Fatalf("the wire map is %v", plain)
	}
	var out share.ViewMeta
	if err := share.DecodeMeta(b, &out); err != nil {
		t.Fatal(err)
	}
	if out.DType != in.DType || !slices.Equal(out.Shape, in.Shape) || len(out.Extra) != 1 {
		t.Fatalf("decoded %+v, want %+v", out, in)
	}
	if n, ok := out.Extra["batch"].(int8); !ok || n != 7 {
		t.Fatalf("batch decoded as %T %v", out.Extra["batch"], out.Extra["batch"])
	}
	dtype, shape, err := share.ViewOf(b, 4*256*4)
	if err != nil || dtype != "float32" || !slices.Equal(shape, []uint64{4, 256}) {
		t.Fatalf("ViewOf = %s %v %v", dtype, shape, err)
	}
}

// TestEncodeMetaRefuses: what the protocol does not carry is refused
// here, naming the value, instead of at Offer.
func TestEncodeMetaRefuses(t *testing.T) {
	for _, c := range []struct {
		name string
		v    any
		want string
	}{
		{"too large", strings.Repeat("x", 5000), "limit 4096"},
		{"a time", time.Unix(1, 0), "time.Time is not a type the protocol carries"},
		{"unknown dtype", share.ViewMeta{DType: "float8"}, "unknown dtype"},
		{"dtype in Extra", share.ViewMeta{Extra: map[string]any{"dtype": "int8"}}, "set the field"},
		{"too deep", deep(20), "16 deep"},
	} {
		_, err := share.EncodeMeta(c.v)
		if !errors.Is(err, share.ErrMeta) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: EncodeMeta = %v, want ErrMeta saying %q", c.name, err, c.want)
		}
	}
	type batch struct {
		Index uint64 `msgpack:"batch"`
		Name  string `msgpack:"name"`
	}
	b, err := share.EncodeMeta(batch{Index: 3, Name: "a"})
	if err != nil {
		t.Fatal(err)
	}
	var got batch
	if err := share.DecodeMeta(b, &got); err != nil || got.Index != 3 || got.Name != "a" {
		t.Fatalf("struct round trip: %+v, %v", got, err)
	}
}

func deep(n int) any {
	var v any = 1
	for range n {
		v = []any{v}
	}
	return v
}

// TestDecodeMetaErrors: the errors say what is wrong, JSON above all (the
// mistake the issue saw: 27 bytes after the value, and no hint).
func TestDecodeMetaErrors(t *testing.T) {
	js, _ := json.Marshal(map[string]any{"dtype": "float32", "shape": []int{2, 3}})
	var a share.ViewMeta
	err := share.DecodeMeta(js, &a)
	if !errors.Is(err, share.ErrMeta) || !strings.Contains(err.Error(), "meta is JSON, not msgpack: use share.EncodeMeta") {
		t.Errorf("JSON: %v", err)
	}
	if _, _, err := share.ViewOf(js, 1024); err == nil || !strings.Contains(err.Error(), "JSON") {
		t.Errorf("ViewOf(JSON) = %v", err)
	}
	if err := share.DecodeMeta(nil, &a); !errors.Is(err, share.ErrMeta) || !strings.Contains(err.Error(), "no metadata") {
		t.Errorf("empty: %v", err)
	}
	two := append(sharetest.Meta(1), sharetest.Meta(2)...)
	var n uint64
	if err := share.DecodeMeta(two, &n); !errors.Is(err, share.ErrMeta) || !strings.Contains(err.Error(), "9 bytes after") {
		t.Errorf("two values: %v", err)
	}
	bad, _ := msgpack.Marshal(map[string]any{"shape": []any{2, -1}})
	if err := share.DecodeMeta(bad, &a); !errors.Is(err, share.ErrMeta) || !strings.Contains(err.Error(), "negative") {
		t.Errorf("negative dimension: %v", err)
	}
}

// TestViewOf: the section 4.2 rules: defaults, unknown dtypes, and shapes
// that do not fit the buffer (or overflow) are refused.
func TestViewOf(t *testing.T) {
	enc := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, c := range []struct {
		name  string
		meta  []byte
		size  uint64
		dtype string
		shape []uint64
		err   string
	}{
		{"no metadata", nil, 100, "uint8", []uint64{100}, ""},
		{"not a map", sharetest.Meta(5), 100, "uint8", []uint64{100}, ""},
		{"dtype only", enc(map[string]any{"dtype": "float64"}), 100, "float64", []uint64{12}, ""},
		{"exactly full", enc(map[string]any{"dtype": "complex128", "shape": []int{2, 2}}), 64, "complex128", []uint64{2, 2}, ""},
		{"one byte too many", enc(map[string]any{"dtype": "int32", "shape": []int{5, 5}}), 99, "", nil, "100 bytes, the buffer 99"},
		{"unknown dtype", enc(map[string]any{"dtype": "float4"}), 100, "", nil, `unknown dtype "float4"`},
		{"overflow", enc(map[string]any{"dtype": "int64", "shape": []uint64{1 << 62, 4}}), 100, "", nil, "overflows"},
		{"dtype not a string", enc(map[string]any{"dtype": 4}), 100, "", nil, "not a string"},
	} {
		dtype, shape, err := share.ViewOf(c.meta, c.size)
		if c.err != "" {
			if !errors.Is(err, share.ErrMeta) || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%s: err %v, want ErrMeta saying %q", c.name, err, c.err)
			}
			continue
		}
		if err != nil || dtype != c.dtype || !slices.Equal(shape, c.shape) {
			t.Errorf("%s: %s %v %v, want %s %v", c.name, dtype, shape, err, c.dtype, c.shape)
		}
	}
}

// TestLeaseHostCopies: host copies of a lease stay inside it whatever dst's
// length, read what the producer wrote (ordered after the event the
// lease's non-blocking stream waited on), and after Release the lease has
// no pointer and copies fail with ErrReleased.
func TestLeaseHostCopies(t *testing.T) {
	env := sharetest.Setup(t)
	path := sharetest.SocketPath(t)
	const size = 4096
	p := sharetest.Start(t, "producer", sharetest.EnvParam(sharetest.ParamPath, path),
		sharetest.EnvParam(sharetest.ParamSize, size), sharetest.EnvParam(sharetest.ParamCount, 1),
		sharetest.EnvParam(sharetest.ParamStream, 1))
	p.Expect("LISTENING")
	ctx := sharetest.Ctx(t)
	s, err := env.Ctx.NewStream(true)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	im, err := share.Dial(ctx, path, env.Ctx, share.ImporterConfig{Credits: 2, Stream: s})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	l, err := im.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var n uint64
	if err := l.DecodeMeta(&n); err != nil {
		t.Fatal(err)
	}
	if dtype, shape, err := l.View(); err != nil || dtype != "uint8" || !slices.Equal(shape, []uint64{size}) {
		t.Errorf("View of a lease without the keys: %s %v %v", dtype, shape, err)
	}

	big := make([]byte, 2*size) // what silently read the next buffer before
	if got, err := l.CopyToHost(big); err != nil || got != size {
		t.Fatalf("CopyToHost(2*size) = %d, %v; want %d", got, err, size)
	}
	if binary.LittleEndian.Uint64(big) != n || binary.LittleEndian.Uint64(big[8:]) != ^n {
		t.Fatalf("head %x, want the pattern of batch %d", big[:16], n)
	}
	tail := make([]byte, 64)
	if got, err := l.CopyToHostAt(tail, size-8); err != nil || got != 8 || binary.LittleEndian.Uint64(tail) != n {
		t.Fatalf("CopyToHostAt(size-8) = %d, %v, %x", got, err, tail[:8])
	}
	if _, err := l.CopyToHostAt(tail, size+1); !errors.Is(err, driver.ErrInvalidValue) {
		t.Fatalf("CopyToHostAt past the end = %v, want ErrInvalidValue", err)
	}
	words := make([]uint64, size) // 8x the lease
	if got, err := share.CopyElements(l, words); err != nil || got != size/8 || words[0] != n || words[1] != ^n {
		t.Fatalf("CopyElements = %d, %v, %d %d", got, err, words[0], words[1])
	}
	pinned, err := env.Ctx.AllocHost(size)
	if err != nil {
		t.Fatal(err)
	}
	defer pinned.Close()
	if got, err := l.CopyToHost(pinned.Bytes()); err != nil || got != size || binary.LittleEndian.Uint64(pinned.Bytes()) != n {
		t.Fatalf("CopyToHost into pinned memory = %d, %v", got, err)
	}

	if l.Ptr() == 0 {
		t.Fatal("Ptr() of a held lease is 0")
	}
	l.Release()
	if l.Ptr() != 0 {
		t.Fatalf("Ptr() after Release = %#x, want 0", uint64(l.Ptr()))
	}
	if _, err := l.CopyToHost(big); !errors.Is(err, share.ErrReleased) {
		t.Fatalf("CopyToHost after Release = %v, want ErrReleased", err)
	}
	if err := l.DecodeMeta(&n); err != nil {
		t.Fatalf("the metadata after Release: %v (it belongs to the lease)", err)
	}
	if err := im.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	p.Wait()
}
