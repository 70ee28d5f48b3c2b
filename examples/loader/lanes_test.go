package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/share"
)

// fakeDecoder stands for a lane's nvJPEG decoder: it writes the batch's
// first key into dst's buffer, after yielding a random number of times so
// that the lanes finish out of order.
type fakeDecoder struct {
	rnd  *rand.Rand
	bufs *fakeRing
}

func (d *fakeDecoder) DecodeCrop(jpgs [][]byte, ws, hs, xs, ys []int, dst driver.DevicePtr) error {
	for i := d.rnd.IntN(50); i > 0; i-- {
		runtime.Gosched()
	}
	d.bufs.write(int(dst), xs[0])
	return nil
}

// fakeRing models share.Ring and Exporter.Offer for the lanes: ring
// buffers shared by every lane, a consumer's credits, and a slow consumer
// that gives a buffer and its credit back only once it has read the batch.
type fakeRing struct {
	free    chan int      // buffers no one holds
	credits chan struct{} // the consumer's credits
	queue   chan offered  // offers the consumer has not read yet

	mu      sync.Mutex
	content []int // per buffer: what the decoder wrote
	held    []bool
}

type offered struct {
	buf  int
	meta []byte
}

func newFakeRing(buffers, credits int) *fakeRing {
	r := &fakeRing{free: make(chan int, buffers), credits: make(chan struct{}, credits),
		queue: make(chan offered, credits), content: make([]int, buffers), held: make([]bool, buffers)}
	for i := 0; i < buffers; i++ {
		r.free <- i
	}
	for i := 0; i < credits; i++ {
		r.credits <- struct{}{}
	}
	return r
}

func (r *fakeRing) write(buf, v int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.content[buf] = v
}

// consume reads the offers in turn until ctx ends, checks that batch n
// comes n-th with what its decoder wrote, and gives each buffer back after
// yielding a while (a slow trainer).
func (r *fakeRing) consume(ctx context.Context, rnd *rand.Rand, want int) error {
	for n := 0; n < want; n++ {
		var o offered
		select {
		case o = <-r.queue:
		case <-ctx.Done():
			return fmt.Errorf("batch %d never came: %w", n, ctx.Err())
		}
		var m struct {
			Batch int   `msgpack:"batch"`
			Crops []int `msgpack:"crops"`
		}
		var vm share.ViewMeta
		vm.Extra = map[string]any{}
		if err := share.DecodeMeta(o.meta, &vm); err != nil {
			return err
		}
		m.Batch = toInt(vm.Extra["batch"])
		if m.Batch != n {
			return fmt.Errorf("offer %d is batch %d", n, m.Batch)
		}
		r.mu.Lock()
		got := r.content[o.buf]
		r.mu.Unlock()
		if got != n {
			return fmt.Errorf("batch %d's buffer %d holds batch %d's pixels", n, o.buf, got)
		}
		for i := rnd.IntN(100); i > 0; i-- {
			runtime.Gosched()
		}
		r.mu.Lock()
		r.held[o.buf] = false
		r.mu.Unlock()
		r.free <- o.buf
		r.credits <- struct{}{}
	}
	return nil
}

func toInt(v any) int {
	switch x := v.(type) {
	case int:
		return x
	case int8:
		return int(x)
	case int16:
		return int(x)
	case int32:
		return int(x)
	case int64:
		return int(x)
	case uint8:
		return int(x)
	case uint16:
		return int(x)
	case uint32:
		return int(x)
	case uint64:
		return int(x)
	}
	return -1
}

// fakeSink is one lane's view of the fakeRing.
type fakeSink struct {
	r   *fakeRing
	cur int
}

func (s *fakeSink) take(ctx context.Context) (driver.DevicePtr, error) {
	select {
	case b := <-s.r.free:
		s.r.mu.Lock()
		defer s.r.mu.Unlock()
		if s.r.held[b] {
			return 0, fmt.Errorf("buffer %d taken twice", b)
		}
		s.r.held[b] = true
		s.cur = b
		return driver.DevicePtr(b), nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

func (s *fakeSink) give(ctx context.Context, meta []byte) error {
	select {
	case <-s.r.credits:
	case <-ctx.Done():
		s.drop()
		return ctx.Err()
	}
	s.r.queue <- offered{buf: s.cur, meta: meta} // room for every credit
	s.cur = -1
	return nil
}

func (s *fakeSink) drop() {
	if s.cur >= 0 {
		s.r.mu.Lock()
		s.r.held[s.cur] = false
		s.r.mu.Unlock()
		s.r.free <- s.cur
		s.cur = -1
	}
}

// TestLanesNeverDeadlock: every lane count with the smallest ring the
// loader accepts (-lanes + 1) and more, a consumer of 1 to 4 credits that
// reads slowly, and decoders that finish out of order: every batch is
// offered, in the source's order, each in a buffer no one else holds, and
// the lanes end. A deadlock shows as the test's context ending first.
func TestLanesNeverDeadlock(t *testing.T) {
	const want = 200
	for lanes := 1; lanes <= 4; lanes++ {
		for _, extra := range []int{1, 2, 4} {
			for credits := 1; credits <= 4; credits++ {
				ring := lanes + extra
				t.Run(fmt.Sprintf("lanes%d-ring%d-credits%d", lanes, ring, credits), func(t *testing.T) {
					runLanes(t, lanes, ring, credits, want)
				})
			}
		}
	}
}

func runLanes(t *testing.T, lanes, ring, credits, want int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	r := newFakeRing(ring, credits)
	seed := rand.Uint64()
	decs := make([]cropDecoder, lanes)
	outs := make([]sink, lanes)
	for i := range decs {
		decs[i] = &fakeDecoder{rnd: rand.New(rand.NewPCG(seed, uint64(i))), bufs: r}
		outs[i] = &fakeSink{r: r, cur: -1}
	}
	batches := make(chan []item, 4)
	go func() {
		defer close(batches)
		for n := 0; n < want; n++ {
			select {
			case batches <- []item{{X: n, W: 1, H: 1}}:
			case <-ctx.Done():
				return
			}
		}
	}()
	l := &loader{cfg: config{crop: 1, batches: uint64(want)}, stderr: io.Discard}
	consumed := make(chan error, 1)
	go func() { consumed <- r.consume(ctx, rand.New(rand.NewPCG(seed, 99)), want) }()
	_, epochs, err := l.lanes(ctx, decs, outs, batches, time.Now())
	if err != nil {
		t.Fatalf("lanes: %v", err)
	}
	if err := <-consumed; err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatalf("seed %d: deadlocked", seed)
	}
	if l.rep.Batches != uint64(want) || l.rep.Images != uint64(want) || epochs != 1 {
		t.Fatalf("batches %d, images %d, epochs %d; want %d, %d, 1", l.rep.Batches, l.rep.Images, epochs, want, want)
	}
}
