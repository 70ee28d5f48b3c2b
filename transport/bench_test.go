//go:build linux

package transport

import (
	"context"
	"slices"
	"testing"
	"time"
)

// BenchmarkOfferEncodeDecode measures encoding an offer (with metadata and
// an event handle) into a reused buffer and decoding it.
func BenchmarkOfferEncodeDecode(b *testing.B) {
	o := testOffer()
	var d decoder
	var m Message
	buf := appendOffer(nil, &o)
	b.SetBytes(int64(len(buf)))
	b.ReportAllocs()
	for b.Loop() {
		buf = appendOffer(buf[:0], &o)
		if _, err := d.decode(buf[headerSize:], &m); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkReleaseEncodeDecode measures the same for a one-seq release.
func BenchmarkReleaseEncodeDecode(b *testing.B) {
	var d decoder
	var m Message
	seqs := []uint64{1 << 40}
	buf := appendRelease(nil, seqs)
	b.ReportAllocs()
	for b.Loop() {
		buf = appendRelease(buf[:0], seqs)
		if _, err := d.decode(buf[headerSize:], &m); err != nil {
			b.Fatal(err)
		}
	}
}

// benchPeer starts a consumer helper process with the given credits and
// returns the producer's end of its connection.
func benchPeer(b *testing.B, credits string) *Conn {
	b.Helper()
	l := listen(b, testConfig(RoleProducer, nil))
	h := startHelper(b, "consumer", l.Addr(), []string{helperCredits + "=" + credits}, nil, "")
	c, err := l.Accept(testCtx(b))
	if err != nil {
		b.Fatalf("%v\nhelper: %s", err, h.out)
	}
	b.Cleanup(func() {
		c.Shutdown(context.Background(), "")
		h.wait()
	})
	return c
}

// BenchmarkRoundTrip measures an offer to a consumer in another process
// and its release back, one at a time, and reports the latency quantiles.
func BenchmarkRoundTrip(b *testing.B) {
	c := benchPeer(b, "1")
	ctx := context.Background()
	o := testOffer()
	var m Message
	lat := make([]time.Duration, 0, b.N)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		o.Seq = uint64(i)
		start := time.Now()
		if err := c.SendOffer(ctx, &o); err != nil {
			b.Fatal(err)
		}
		if err := c.Recv(ctx, &m); err != nil || m.Kind != KindRelease || m.Seqs[0] != o.Seq {
			b.Fatalf("recv: %v %v", m.Kind, err)
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
}

// BenchmarkPipelined measures offer+release pairs per second with up to
// 1024 offers in flight, one producer to one consumer in another process.
func BenchmarkPipelined(b *testing.B) {
	c := benchPeer(b, "1024")
	ctx := context.Background()
	done := make(chan error, 1)
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	go func() {
		o := testOffer()
		for i := range b.N {
			o.Seq = uint64(i)
			if err := c.SendOffer(ctx, &o); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	var m Message
	for n := 0; n < b.N; {
		if err := c.Recv(ctx, &m); err != nil {
			b.Fatal(err)
		}
		n += len(m.Seqs)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "pairs/s")
}
