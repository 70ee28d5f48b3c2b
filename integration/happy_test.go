package integration

import (
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/app"
)

// TestHappyPath runs a producer and several consumers to the end of a
// count: every batch offered is received once (or by everyone, broadcast),
// verified on the device side, and released; ring buffers are reused, an
// arena is mapped once; the producer frees everything.
func TestHappyPath(t *testing.T) {
	cases := []struct {
		name      string
		consumers int
		producer  []string
		consumer  []string
		broadcast bool
		fresh     bool
	}{
		{name: "ring", consumers: 3, producer: []string{"-ring", "4", "-size", "256KiB", "-count", "1500"}},
		{name: "fresh-arena", consumers: 2, fresh: true, producer: []string{"-fresh", "-ring", "4", "-size", "300KiB", "-count", "800"}},
		{name: "broadcast", consumers: 3, broadcast: true, producer: []string{"-broadcast", "-ring", "4", "-size", "64KiB", "-count", "400"}},
		{name: "fresh-broadcast", consumers: 2, broadcast: true, fresh: true, producer: []string{"-fresh", "-broadcast", "-ring", "3", "-size", "64KiB", "-count", "300"}},
		{name: "host-synchronized", consumers: 2, producer: []string{"-event=false", "-ring", "4", "-size", "64KiB", "-count", "600"}},
		{name: "verify-sampled", consumers: 2, producer: []string{"-ring", "8", "-size", "64KiB", "-count", "600"}, consumer: []string{"-verify", "sample:7", "-workers", "4"}},
		// Stream-ordered: each worker copies its batch on its own stream and
		// releases after the copy; the producer refills with AcquireOn.
		{name: "async", consumers: 2, producer: []string{"-ring", "4", "-size", "256KiB", "-count", "1000"}, consumer: []string{"-verify", "async", "-workers", "3"}},
		// Groups: four buffers taken and filled before any is offered,
		// and a count that ends inside a group.
		{name: "async-group", consumers: 2, producer: []string{"-ring", "8", "-group", "4", "-size", "64KiB", "-count", "1002"}, consumer: []string{"-verify", "async", "-workers", "2"}},
		{name: "async-fresh", consumers: 1, fresh: true, producer: []string{"-fresh", "-ring", "3", "-size", "300KiB", "-count", "400"}, consumer: []string{"-verify", "async", "-workers", "2"}},
		{name: "verify-byte", consumers: 1, producer: []string{"-ring", "8", "-size", "64KiB", "-count", "600"}, consumer: []string{"-verify", "byte", "-workers", "1", "-credits", "2"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, "")
			prod := e.producer(append([]string{"-consumers", itoa(tc.consumers)}, tc.producer...)...)
			var cons []*proc
			for i := range tc.consumers {
				cons = append(cons, e.consumer("consumer "+itoa(i+1), tc.consumer...))
			}
			var reps []app.ConsumerReport
			for _, c := range cons {
				reps = append(reps, c.consumerDone(60*time.Second))
			}
			pr := prod.producerDone(30 * time.Second)

			var total uint64
			for i, r := range reps {
				total += r.Handoffs
				if r.End != "producer said goodbye" {
					t.Errorf("consumer %d ended by %q, want the producer's goodbye", i+1, r.End)
				}
				if r.Handoffs == 0 {
					t.Errorf("consumer %d got no batch", i+1)
				}
				// The benchmark's CPU column: hundreds of batches cost some.
				if r.Handoffs > 1 && r.CPUusPerHandoff <= 0 {
					t.Errorf("consumer %d reports %v µs of CPU per handoff", i+1, r.CPUusPerHandoff)
				}
				if r.Verify == "async" && (r.Verified != r.Handoffs || r.VerifyErrors != 0) {
					t.Errorf("consumer %d: %d of %d batches verified, %d wrong", i+1, r.Verified, r.Handoffs, r.VerifyErrors)
				}
				if tc.broadcast && r.Handoffs != pr.Batches {
					t.Errorf("broadcast: consumer %d got %d of the %d batches", i+1, r.Handoffs, pr.Batches)
				}
				// One IPC open per allocation, whatever the batches: a ring
				// or an arena is one allocation.
				if r.Mappings != 1 {
					t.Errorf("consumer %d opened %d mappings, want 1 (one allocation)", i+1, r.Mappings)
				}
				if !tc.fresh && r.BuffersSeen > pr.Ring {
					t.Errorf("consumer %d saw %d buffers of a ring of %d", i+1, r.BuffersSeen, pr.Ring)
				}
			}
			want := pr.Batches
			if tc.broadcast {
				want *= uint64(tc.consumers)
			}
			if pr.End != "count" || total != want || pr.Offers != want {
				t.Errorf("producer: %d batches (ended by %s), %d offers; consumers received %d, want %d", pr.Batches, pr.End, pr.Offers, total, want)
			}
			if slices.Contains(tc.consumer, "async") && pr.OrderedReleases != pr.Offers {
				t.Errorf("producer: %d of %d releases stream-ordered", pr.OrderedReleases, pr.Offers)
			}
			if pr.Retired != 1 {
				t.Errorf("producer retired %d allocations, want 1", pr.Retired)
			}
			if pr.CPUusPerBatch <= 0 {
				t.Errorf("producer reports %v µs of CPU per batch", pr.CPUusPerBatch)
			}
		})
	}
}

// TestAsyncCatchesWrongContent: -verify async checks its samples only
// once their copy back is done, with no host wait; it must still judge
// every batch, and find unwritten buffers wrong (-fill=false: memory
// nobody wrote cannot hold every batch's pattern).
func TestAsyncCatchesWrongContent(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-fill=false", "-ring", "4", "-size", "64KiB", "-count", "300", "-consumers", "1")
	c := e.consumer("async", "-verify", "async", "-workers", "2")
	c.expectExit(app.ExitFailure, 60*time.Second)
	var r app.ConsumerReport
	c.report(&r)
	if r.Handoffs != 300 || r.VerifyErrors == 0 || r.Verified+r.VerifyErrors != r.Handoffs {
		t.Errorf("%d handoffs: %d verified, %d wrong; want 300, all judged, some wrong", r.Handoffs, r.Verified, r.VerifyErrors)
	}
	if r.AsyncWaits == nil {
		t.Errorf("-verify async reported no async_waits")
	}
	prod.producerDone(30 * time.Second)
}

// TestConsumersComeAndGo: consumers that stop on their own (-count) say
// goodbye; the producer goes on with the others and with a newcomer, and
// shuts down cleanly on SIGTERM.
func TestConsumersComeAndGo(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-ring", "6", "-size", "64KiB", "-consumers", "1")
	steady := e.consumer("steady", "-work", "200us")
	for i := range 3 {
		c := e.consumer("short "+itoa(i+1), "-count", "150", "-credits", "2")
		r := c.consumerDone(30 * time.Second)
		if r.Handoffs < 150 || r.End != "count" {
			t.Errorf("short consumer %d: %d handoffs, ended by %q", i+1, r.Handoffs, r.End)
		}
	}
	prod.signal(syscall.SIGTERM)
	sr := steady.consumerDone(30 * time.Second)
	pr := prod.producerDone(30 * time.Second)
	if pr.End != "signal" || pr.ConsumersLost != 0 {
		t.Errorf("producer ended by %q with %d consumers lost, want signal and none", pr.End, pr.ConsumersLost)
	}
	if sr.End != "producer said goodbye" || sr.Handoffs == 0 {
		t.Errorf("steady consumer: %d handoffs, ended by %q", sr.Handoffs, sr.End)
	}
}

// TestDuration: -duration ends the producer, whether or not anything
// blocks it (an arena with room and consumers with credits never do), and
// the consumers follow.
func TestDuration(t *testing.T) {
	for _, mode := range [][]string{{"-ring", "4", "-size", "64KiB"}, {"-fresh", "-ring", "32", "-size", "4MiB"}} {
		t.Run(mode[0][1:], func(t *testing.T) {
			e := newEnv(t, "")
			start := time.Now()
			prod := e.producer(append(mode, "-duration", "700ms", "-consumers", "2")...)
			a, b := e.consumer("a", "-credits", "8", "-verify", "none"), e.consumer("b", "-credits", "8", "-verify", "none")
			ra, rb := a.consumerDone(30*time.Second), b.consumerDone(30*time.Second)
			pr := prod.producerDone(30 * time.Second)
			if pr.End != "duration" || ra.Handoffs+rb.Handoffs != pr.Batches {
				t.Errorf("producer ended by %q after %d batches; consumers got %d", pr.End, pr.Batches, ra.Handoffs+rb.Handoffs)
			}
			if pr.Seconds > 5 {
				t.Errorf("a 700ms run offered batches for %.1fs", pr.Seconds)
			}
			t.Logf("%d batches in %v", pr.Batches, time.Since(start).Round(time.Millisecond))
		})
	}
}
