package app

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"syscall"
	"testing"

	"github.com/seed743c36cf/cudashare/share"
	"github.com/seed743c36cf/cudashare/transport"
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

func TestMeta(t *testing.T) {
	b := appendMeta(nil, 123456789, 987654321)
	seq, sent, ok := parseMeta(b)
	if !ok || seq != 123456789 || sent != 987654321 || len(b) != metaSize {
		t.Fatalf("round trip: %d %d %v (%d bytes)", seq, sent, ok, len(b))
	}
	for _, bad := range [][]byte{nil, b[:metaSize-1], append(slices.Clone(b), 0), {0x91, 0xcf, 0, 0, 0, 0, 0, 0, 0, 0, 0xcf, 0, 0, 0, 0, 0, 0, 0, 0}} {
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
