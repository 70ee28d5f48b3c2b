//go:build linux

package transport

import (
	"context"
	"io"
	"net"
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
	buf := appendRelease(nil, seqs, nil)
	b.ReportAllocs()
	for b.Loop() {
		buf = appendRelease(buf[:0], seqs, nil)
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

// The bare benchmarks measure the same exchanges over a plain Unix socket
// with no protocol, one write per message: a floor for the ones above on
// the same machine.
const (
	bareOffer   = 205 // bytes of the test offer's frame
	bareRelease = 12  // bytes of a one-seq release frame, seq < 2^32
)

// bareEcho answers every bareOffer bytes read with bareRelease bytes, one
// write each, until end of stream.
func bareEcho(path string) error {
	c, err := net.Dial("unix", path)
	if err != nil {
		return err
	}
	defer c.Close()
	buf := make([]byte, 64<<10)
	reply := make([]byte, bareRelease)
	pending := 0
	for {
		n, err := c.Read(buf)
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		for pending += n; pending >= bareOffer; pending -= bareOffer {
			if _, err := c.Write(reply); err != nil {
				return err
			}
		}
	}
}

func barePeer(b *testing.B) net.Conn {
	b.Helper()
	path := socketDir(b) + "/bare"
	ln, err := listenRaw(path)
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	h := startHelper(b, "bare", path, nil, nil, "")
	c, err := ln.Accept()
	if err != nil {
		b.Fatalf("%v\nhelper: %s", err, h.out)
	}
	b.Cleanup(func() {
		c.Close()
		h.wait()
	})
	return c
}

func BenchmarkBareRoundTrip(b *testing.B) {
	c := barePeer(b)
	offer := make([]byte, bareOffer)
	release := make([]byte, bareRelease)
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		if _, err := c.Write(offer); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, release); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
}

func BenchmarkBarePipelined(b *testing.B) {
	c := barePeer(b)
	done := make(chan error, 1)
	b.ResetTimer()
	start := time.Now()
	go func() {
		offer := make([]byte, bareOffer)
		for range b.N {
			if _, err := c.Write(offer); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	if _, err := io.CopyN(io.Discard, c, int64(b.N)*bareRelease); err != nil {
		b.Fatal(err)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "pairs/s")
}
