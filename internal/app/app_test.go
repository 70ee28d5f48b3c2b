package app

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/seed743c36cf/cudashare/share"
	"github.com/seed743c36cf/cudashare/transport"
	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"
)

func TestParseSize(t *testing.T) {
	good := map[string]uint64{
		"0": 0, "4096": 4096, "5B": 5, "1KiB": 1 << 10, "1MiB": 1 << 20, "64MiB": 64 << 20, "1GiB": 1 << 30,
		"2TiB": 2 << 40, "1M": 1 << 20, "1mb": 1 << 20, " 3 GiB ": 3 << 30, "16k": 16 << 10,
	}
	for in, want := range good {
		if got, err := ParseSize(in); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "MiB", "1.5GiB", "-1", "1XB", "1iB", "1 MiBs", "99999999999TiB"} {
		if got, err := ParseSize(in); err == nil {
			t.Errorf("ParseSize(%q) = %d, want an error", in, got)
		}
	}
	for _, n := range []uint64{1, 255, 1 << 10, 3 << 20, 64 << 20, 1 << 30, 5 << 40} {
		if got, err := ParseSize(FormatSize(n)); err != nil || got != n {
			t.Errorf("ParseSize(FormatSize(%d) = %q) = %d, %v", n, FormatSize(n), got, err)
		}
	}
}

// TestHistogram compares the quantiles with those of the sorted samples:
// within the buckets' 1.6%.
func TestHistogram(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var h histogram
	var all []int64
	for range 100000 {
		v := int64(rng.ExpFloat64() * 50000) // latencies around 50 µs, a long tail
		if rng.IntN(100) == 0 {
			v *= 100
		}
		h.record(v)
		all = append(all, v)
	}
	slices.Sort(all)
	for _, q := range []float64{0.5, 0.9, 0.99, 0.999} {
		exact := all[int(q*float64(len(all)))]
		got := h.quantile(q)
		if diff := float64(got-exact) / float64(exact); diff > 0.02 || diff < -0.02 {
			t.Errorf("q%.3f: %d, exact %d (%.1f%% off)", q, got, exact, diff*100)
		}
	}
	if h.quantile(1) != all[len(all)-1] {
		t.Errorf("q1 = %d, want the maximum %d", h.quantile(1), all[len(all)-1])
	}
	var empty histogram
	if empty.quantile(0.5) != 0 {
		t.Error("an empty histogram has a median")
	}
	for v := uint64(0); v < 1<<20; v += 7 {
		b := histBucket(v)
		if b < 0 || b >= histBuckets || (v >= histSub && histBucket(histValue(b)) != b) {
			t.Fatalf("value %d: bucket %d, whose middle %d is in bucket %d", v, b, histValue(b), histBucket(histValue(b)))
		}
	}
	if b := histBucket(^uint64(0)); b >= histBuckets {
		t.Fatalf("the largest value falls in bucket %d of %d", b, histBuckets)
	}
}

// TestMeta proves the example consumer reads the producer's metadata (the
// map of PROTOCOL.md section 4.2) in whatever integer encoding a msgpack
// library chose, the smallest included, and refuses what lacks it.
func TestMeta(t *testing.T) {
	b := appendMeta(nil, 123456789, 987654321, 1<<20)
	var generic map[string]any
	if err := msgpack.Unmarshal(b, &generic); err != nil {
		t.Fatalf("the producer's metadata is not msgpack: %v", err)
	}
	if generic["dtype"] != "uint8" || fmt.Sprint(generic["shape"]) != "[1048576]" {
		t.Fatalf("the producer's metadata: %v, want dtype uint8 and shape [1048576]", generic)
	}
	if seq, sent, ok := parseMeta(b); !ok || seq != 123456789 || sent != 987654321 {
		t.Fatalf("round trip: %d %d %v", seq, sent, ok)
	}
	// The same values in every msgpack integer encoding a sender may use.
	enc := func(code byte, v uint64) []byte {
		switch code {
		case 0: // positive fixint
			return []byte{byte(v)}
		case 0xcc, 0xd0:
			return []byte{code, byte(v)}
		case 0xcd, 0xd1:
			return binary.BigEndian.AppendUint16([]byte{code}, uint16(v))
		case 0xce, 0xd2:
			return binary.BigEndian.AppendUint32([]byte{code}, uint32(v))
		}
		return binary.BigEndian.AppendUint64([]byte{code}, v)
	}
	for _, code := range []byte{0, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3} {
		m := []byte{0x83, 0xa1, 't'}
		m = append(m, enc(code, 99)...)
		m = append(m, 0xa5, 'o', 't', 'h', 'e', 'r', 0x92, 0xc0, 0xa1, 'x') // a key of the application's, skipped
		m = append(append(m, 0xa5, 'b', 'a', 't', 'c', 'h'), enc(code, 7)...)
		if seq, sent, ok := parseMeta(m); !ok || seq != 7 || sent != 99 {
			t.Errorf("integers as 0x%02x: %d %d %v, want 7 99 true (%x)", code, seq, sent, ok, m)
		}
	}
	for _, bad := range [][]byte{
		nil,
		b[:len(b)-1],
		append(slices.Clone(b), 0),
		{0x92, 0x07, 0x63}, // the old array layout
		{0x82, 0xa5, 'b', 'a', 't', 'c', 'h', 0x07},                  // truncated
		{0x81, 0xa5, 'b', 'a', 't', 'c', 'h', 0x07},                  // no "t"
		{0x82, 0xa5, 'b', 'a', 't', 'c', 'h', 0xff, 0xa1, 't', 0x01}, // negative batch
	} {
		if _, _, ok := parseMeta(bad); ok {
			t.Errorf("parseMeta(%x) accepted", bad)
		}
	}
}

// TestPattern: the fill byte is never 0 (fresh memory never passes) and
// differs between consecutive batches (a stale buffer never passes).
func TestPattern(t *testing.T) {
	for seq := uint64(0); seq < 10000; seq++ {
		if patternByte(seq) == 0 || patternByte(seq) == patternByte(seq+1) {
			t.Fatalf("batch %d: byte %d, next %d", seq, patternByte(seq), patternByte(seq+1))
		}
	}
}

func TestParseVerify(t *testing.T) {
	for _, s := range []string{"every", "byte", "none", "sample:1", "sample:100"} {
		if m, err := parseVerify(s); err != nil || m.String() != s {
			t.Errorf("parseVerify(%q) = %v, %v", s, m, err)
		}
	}
	for _, s := range []string{"", "all", "sample:", "sample:0", "sample:-3", "sample:x"} {
		if _, err := parseVerify(s); err == nil {
			t.Errorf("parseVerify(%q) accepted", s)
		}
	}
}

// TestExplain: every failure a user can cause maps to its exit code, and
// the message names the socket.
func TestExplain(t *testing.T) {
	opErr := func(errno syscall.Errno) error {
		return fmt.Errorf("transport: dial /x: %w", &net.OpError{Op: "dial", Net: "unix", Err: errno})
	}
	dial := []struct {
		err  error
		code int
	}{
		{opErr(syscall.ENOENT), ExitSocket},
		{opErr(syscall.ECONNREFUSED), ExitSocket},
		{opErr(syscall.EACCES), ExitRefused},
		{fmt.Errorf("x: %w", transport.ErrPeerRefused), ExitRefused},
		{fmt.Errorf("x: %w", transport.ErrVersion), ExitRefused},
		{fmt.Errorf("x: %w", transport.ErrHandshake), ExitRefused},
		// A malformed hello-ack, or a bad shm segment with it: a
		// protocol error from a producer that is there, not "no producer".
		{fmt.Errorf("x: %w", transport.ErrMalformed), ExitFailure},
		{fmt.Errorf("x: %w", transport.ErrUnexpectedMessage), ExitFailure},
		{opErr(syscall.ENOTSOCK), ExitSocket},
		{errors.New("something else"), ExitFailure},
	}
	for _, tc := range dial {
		err := explainDial("/run/p.sock", tc.err)
		if exitCode(err) != tc.code || !errors.Is(err, tc.err) {
			t.Errorf("explainDial(%v) = %v (exit %d), want exit %d wrapping the cause", tc.err, err, exitCode(err), tc.code)
		}
	}
	if !dialRetryable(opErr(syscall.ENOENT)) || !dialRetryable(opErr(syscall.ECONNREFUSED)) || dialRetryable(opErr(syscall.EACCES)) {
		t.Error("only a missing socket or a refused connection is worth retrying")
	}
	for _, err := range []error{
		fmt.Errorf("listen: %w", syscall.EADDRINUSE), fmt.Errorf("listen: %w", transport.ErrUnsafePath), fmt.Errorf("x: %w", syscall.EINVAL),
	} {
		if e := explainListen("/run/p.sock", err); exitCode(e) != ExitSocket {
			t.Errorf("explainListen(%v): exit %d", err, exitCode(e))
		}
	}
	if !producerEnd(fmt.Errorf("%w (goodbye): %w", share.ErrProducerGone, io.EOF)) || producerEnd(share.ErrProducerGone) {
		t.Error("only a producer's goodbye is a clean end")
	}
}

// TestExplainRefusals: a refusal says who refused and why. The producer's
// refusal arrives as its error message (a *transport.RemoteError); the same
// sentinel found by this consumer's own check is this consumer refusing the
// listener, and must not be blamed on the producer.
func TestExplainRefusals(t *testing.T) {
	remote := func(code uint32, sentinel error) error {
		re := &transport.RemoteError{Code: code, Message: "no", Peer: "producer pid 1"}
		if sentinel != nil && !errors.Is(re, sentinel) {
			t.Fatalf("RemoteError code %d does not match %v", code, sentinel)
		}
		return fmt.Errorf("transport: dial /x: transport: handshake with producer: %w", re)
	}
	cases := []struct {
		name    string
		err     error
		code    int
		says    string
		notSays string
	}{
		{"the producer refuses this user", remote(2, transport.ErrPeerRefused), ExitRefused, "the producer at /run/p.sock refused this user", ""},
		{"this consumer refuses the listener", fmt.Errorf("transport: dial /x: %w: pid 7 uid 0: uid 0 is not allowed", transport.ErrPeerRefused), ExitRefused, "this consumer refused the process listening at /run/p.sock", "the producer at /run/p.sock refused"},
		{"the producer's limit", remote(12, transport.ErrLimit), ExitRefused, "refused the connection for a limit", "not a cudashare producer"},
		{"the producer refuses the handshake", remote(8, transport.ErrHandshake), ExitRefused, "the producer at /run/p.sock refused the handshake", ""},
		{"no answer to the handshake", fmt.Errorf("x: %w: no answer within 5s", transport.ErrHandshake), ExitRefused, "did not complete the cudashare handshake", ""},
		{"hung up during the handshake", fmt.Errorf("x: %w", transport.ErrDisconnected), ExitSocket, "hung up during the handshake", ""},
	}
	for _, tc := range cases {
		err := explainDial("/run/p.sock", tc.err)
		if exitCode(err) != tc.code || !errors.Is(err, tc.err) {
			t.Errorf("%s: exit %d, want %d wrapping the cause: %v", tc.name, exitCode(err), tc.code, err)
		}
		if msg := err.Error(); !strings.Contains(msg, tc.says) || tc.notSays != "" && strings.Contains(msg, tc.notSays) {
			t.Errorf("%s: %q should say %q and not %q", tc.name, msg, tc.says, tc.notSays)
		}
	}
}

// TestExplainEnd: how a consumer's batches ended decides its exit code and
// its message; only a vanished producer is "went away without saying
// goodbye".
func TestExplainEnd(t *testing.T) {
	gone := func(err error) error { return fmt.Errorf("pool: %w: %w", share.ErrProducerGone, err) }
	cases := []struct {
		name string
		err  error
		code int
		end  string
		says string
	}{
		{"goodbye", nil, ExitOK, "producer said goodbye", ""},
		{"goodbye after a shutdown timeout", fmt.Errorf("%w (goodbye: %q): %w", share.ErrProducerGone, "producer shut down", io.EOF), ExitOK, "producer said goodbye", ""},
		{"lease timeout", gone(&transport.RemoteError{Code: 11, Message: "it held a lease longer than the producer's lease timeout of 2s"}), ExitDropped, "dropped: timeout",
			"the producer dropped this consumer for a timeout after 42 batches: it held a lease longer than the producer's lease timeout"},
		{"dropped for a protocol error", gone(&transport.RemoteError{Code: 5, Message: "closed while leased"}), ExitDropped, "dropped", "dropped this consumer with an error"},
		{"malformed offer", gone(fmt.Errorf("%w: offer: size past alloc_size", transport.ErrMalformed)), ExitFailure, "protocol error", "cannot accept"},
		{"too many offers", gone(fmt.Errorf("%w: 9 offers, window 8", transport.ErrCredit)), ExitFailure, "protocol error", "cannot accept"},
		{"producer stopped reading", gone(fmt.Errorf("release: %w", transport.ErrWriteTimeout)), ExitProducerGone, "producer stopped reading", "stopped reading"},
		{"vanished", gone(transport.ErrDisconnected), ExitProducerGone, "producer vanished", "went away without saying goodbye"},
		{"anything else", errors.New("boom"), ExitFailure, "error", "receiving a batch failed"},
	}
	for _, tc := range cases {
		end, err := explainEnd("/run/p.sock", tc.err, 42)
		if end != tc.end || exitCode(err) != tc.code && !(tc.code == ExitOK && err == nil) {
			t.Errorf("%s: end %q, exit %d (%v); want %q, exit %d", tc.name, end, exitCode(err), err, tc.end, tc.code)
		}
		if tc.code == ExitOK {
			if err != nil {
				t.Errorf("%s: %v, want a clean end", tc.name, err)
			}
			continue
		}
		if !strings.Contains(err.Error(), tc.says) || !errors.Is(err, tc.err) {
			t.Errorf("%s: %q should say %q and wrap the cause", tc.name, err, tc.says)
		}
		if tc.code != ExitProducerGone && strings.Contains(err.Error(), "went away") {
			t.Errorf("%s: %q blames a vanished producer", tc.name, err)
		}
	}
}

// TestExplainListenNotASocket: something other than a socket at -socket is
// named as what it is, not blamed on the directory.
func TestExplainListenNotASocket(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "p.sock")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	cause := fmt.Errorf("transport: listen %s: %w: %s exists and is not a socket", path, transport.ErrUnsafePath, path)
	err := explainListen(path, cause)
	if exitCode(err) != ExitSocket || !strings.Contains(err.Error(), "a regular file is there") || strings.Contains(err.Error(), "mode 0700") {
		t.Errorf("a regular file at the socket path: %v", err)
	}
	os.Remove(path)
	err = explainListen(path, fmt.Errorf("transport: listen: %w: %s has mode 0755", transport.ErrUnsafePath, dir))
	if !strings.Contains(err.Error(), "mode 0700") {
		t.Errorf("an open directory: %v", err)
	}
}

// parseMetaMsgpack is parseMeta as it was, on the msgpack library: the
// reference TestMetaScanAgrees holds the in-place scanner to. One change:
// it refused bytes after the map only when they decoded as a value, so a
// truncated one passed, and it took nil and bin as keys; now any byte left
// is refused, and keys must be str (PROTOCOL.md section 2.1: the transport
// refuses metadata with other keys), as the scanner does.
func parseMetaMsgpack(b []byte) (seq uint64, sentNS int64, ok bool) {
	r := bytes.NewReader(b)
	dec := msgpack.NewDecoder(r)
	n, err := dec.DecodeMapLen()
	if err != nil || n < 0 {
		return 0, 0, false
	}
	var haveSeq, haveT bool
	for range n {
		if c, err := dec.PeekCode(); err != nil || !(c >= 0xa0 && c <= 0xbf || c >= 0xd9 && c <= 0xdb) {
			return 0, 0, false
		}
		key, err := dec.DecodeString()
		if err != nil {
			return 0, 0, false
		}
		if key != "batch" && key != "t" {
			if dec.Skip() != nil {
				return 0, 0, false
			}
			continue
		}
		v, err := dec.DecodeInterfaceLoose()
		if err != nil {
			return 0, 0, false
		}
		var u uint64
		switch v := v.(type) {
		case uint64:
			u = v
		case int64:
			if v < 0 {
				return 0, 0, false
			}
			u = uint64(v)
		default:
			return 0, 0, false
		}
		if key == "batch" {
			seq, haveSeq = u, true
		} else {
			sentNS, haveT = int64(u), true
		}
	}
	if r.Len() != 0 {
		return 0, 0, false // bytes after the map
	}
	return seq, sentNS, haveSeq && haveT
}

// TestMetaScanAgrees: on the producer's metadata, with keys of an
// application's around it, and on many corruptions of both, the in-place
// scanner accepts what the msgpack library's decoding accepted, with the
// same values, and refuses what it refused.
func TestMetaScanAgrees(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	extra, err := msgpack.Marshal(map[string]any{"name": "batch of images", "labels": []any{1, -2, 3.5, nil, true, []byte{1, 2}}, "nested": map[string]any{"a": []any{"x"}}})
	if err != nil {
		t.Fatal(err)
	}
	var compared, accepted, refused int
	check := func(b []byte) {
		t.Helper()
		s1, t1, ok1 := parseMeta(b)
		// The library allocates what a corrupted length declares: give it
		// only single well-formed values (whose lengths fit in b); the
		// scanner must refuse the rest.
		w := metaScan{b: b}
		if w.skip(0); w.bad || w.i != len(b) {
			if ok1 {
				t.Fatalf("%x: not one well-formed value, yet the scanner read %d %d", b, s1, t1)
			}
			refused++
			return
		}
		compared++
		s2, t2, ok2 := parseMetaMsgpack(b)
		if ok1 != ok2 || ok1 && (s1 != s2 || t1 != t2) {
			t.Fatalf("%x: scanner %d %d %v, msgpack %d %d %v", b, s1, t1, ok1, s2, t2, ok2)
		}
		if ok1 {
			accepted++
		}
	}
	for range 20000 {
		b := appendMeta(nil, rng.Uint64()>>rng.IntN(64), int64(rng.Uint64()>>(1+rng.IntN(63))), rng.Uint64()>>rng.IntN(64))
		if rng.IntN(2) == 0 {
			// The application's keys after the producer's: one map of 5.
			b[0] = 0x85
			b = append(append(b, 0xa5, 'e', 'x', 't', 'r', 'a'), extra...)
		}
		check(b)
		switch m := slices.Clone(b); rng.IntN(4) {
		case 0:
			m[rng.IntN(len(m))] = byte(rng.Uint32())
			check(m)
		case 1:
			check(m[:rng.IntN(len(m))])
		case 2:
			i := rng.IntN(len(m) + 1)
			check(slices.Insert(m, i, byte(rng.Uint32())))
		case 3:
			for range 4 {
				m[rng.IntN(len(m))] = byte(rng.Uint32())
			}
			check(m)
		}
	}
	t.Logf("%d inputs compared with the msgpack library (%d accepted), %d malformed ones refused", compared, accepted, refused)
	if compared < 20000 || accepted < 20000 || refused < 2000 {
		t.Errorf("too few cases of a kind: the mutations no longer exercise both sides")
	}
}

// BenchmarkParseMeta: the consumer's per-batch metadata read, in place
// (ns/op, 0 allocs) against the msgpack library's Decoder it replaced.
func BenchmarkParseMeta(b *testing.B) {
	m := appendMeta(nil, 123456789, 987654321, 1<<20)
	for _, f := range []struct {
		name  string
		parse func([]byte) (uint64, int64, bool)
	}{{"scan", parseMeta}, {"msgpack", parseMetaMsgpack}} {
		b.Run(f.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, _, ok := f.parse(m); !ok {
					b.Fatal("not parsed")
				}
			}
		})
	}
}

// TestMonoNow: monoNow reads CLOCK_MONOTONIC, the clock a peer in another
// process (or Python's time.perf_counter) stamps with, give or take
// half the width of the tightest bracket it was paired in (monoErr).
func TestMonoNow(t *testing.T) {
	var a, b unix.Timespec
	for range 1000 {
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &a); err != nil {
			t.Fatal(err)
		}
		m := monoNow()
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &b); err != nil {
			t.Fatal(err)
		}
		if m < a.Nano()-int64(monoErr) || m > b.Nano()+int64(monoErr) {
			t.Fatalf("monoNow %d, CLOCK_MONOTONIC read %d before and %d after (pairing error at most %v)", m, a.Nano(), b.Nano(), monoErr)
		}
	}
}

// FuzzParseMeta: on any bytes the scanner neither panics nor reads past
// them, refuses what is not one well-formed value, and agrees with the
// msgpack library on what is (go test -fuzz FuzzParseMeta ./internal/app).
func FuzzParseMeta(f *testing.F) {
	f.Add(appendMeta(nil, 123456789, 987654321, 1<<20))
	f.Add([]byte{0x83, 0xa1, 't', 0xd3, 0, 0, 0, 0, 0, 0, 0, 99, 0xa5, 'o', 't', 'h', 'e', 'r', 0x92, 0xc0, 0xa1, 'x', 0xa5, 'b', 'a', 't', 'c', 'h', 0x07})
	f.Add([]byte{0xdf, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		s1, t1, ok1 := parseMeta(b)
		w := metaScan{b: b}
		if w.skip(0); w.bad || w.i != len(b) {
			if ok1 {
				t.Fatalf("%x: not one well-formed value, yet the scanner read %d %d", b, s1, t1)
			}
			return
		}
		if s2, t2, ok2 := parseMetaMsgpack(b); ok1 != ok2 || ok1 && (s1 != s2 || t1 != t2) {
			t.Fatalf("%x: scanner %d %d %v, msgpack %d %d %v", b, s1, t1, ok1, s2, t2, ok2)
		}
	})
}
