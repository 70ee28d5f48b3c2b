//go:build linux

package share_test

// Stress tests of the producer's waits (Alloc, Acquire, Offer, WaitOn) against
// in-process raw consumers that release in bursts, stall, die holding leases
// and come and go, while contexts are cancelled and the exporter closes: every
// wait must end, with a result or an error, within opDeadline.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
	"github.com/seed743c36cf/cudashare/transport"
)

// inConsumer is an in-process raw consumer: it takes offers and releases
// them according to its policy, answers retires with closed once it holds
// nothing in the allocation, and ends with a goodbye (or abruptly).
type inConsumer struct {
	conn    *transport.Conn
	burst   int           // release once this many are held
	stallP  float64       // chance, per offer, to stall (stop reading)
	stall   time.Duration // how long
	holdMin time.Duration // hold each batch at least this long
	rng     *rand.Rand

	mu       sync.Mutex
	held     []uint64
	alloc    map[uint64]uint64 // seq -> alloc id
	quit     chan struct{}
	done     chan struct{}
	abrupt   atomic.Bool
	stopping atomic.Bool
	holdAll  bool // never release
	stopOnce sync.Once
	err      error
	n        atomic.Int64
}

func dialIn(t testing.TB, e *share.Exporter, credits uint32, shm bool) *transport.Conn {
	t.Helper()
	cfg := transport.DefaultConfig(transport.RoleConsumer)
	cfg.Devices = []transport.UUID{sharetest.Setup(t).Ctx.Device().UUID()}
	cfg.AcceptVMM = true
	cfg.Credits = credits
	cfg.DisableShm = !shm
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := transport.Dial(ctx, e.Addr(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return conn
}

func startIn(t testing.TB, e *share.Exporter, credits uint32, burst int, seed uint64, opts ...func(*inConsumer)) *inConsumer {
	c := &inConsumer{
		conn: dialIn(t, e, credits, seed%2 == 0), burst: burst,
		rng:   rand.New(rand.NewPCG(seed, 7)),
		alloc: map[uint64]uint64{},
		quit:  make(chan struct{}), done: make(chan struct{}),
	}
	for _, o := range opts {
		o(c)
	}
	go c.loop()
	return c
}

func (c *inConsumer) loop() {
	defer close(c.done)
	defer func() {
		if c.stopping.Load() {
			c.err = nil
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-c.quit:
			cancel()
		case <-c.done:
		}
	}()
	var m transport.Message
	retired := map[uint64]bool{}
	last := time.Now()
	flush := func() error {
		if len(c.held) == 0 || c.holdAll {
			return nil
		}
		if d := c.holdMin - time.Since(last); d > 0 {
			time.Sleep(d)
		}
		seqs := c.held
		c.held = nil
		for _, s := range seqs {
			delete(c.alloc, s)
		}
		last = time.Now()
		if err := c.conn.SendRelease(ctx, seqs...); err != nil {
			return err
		}
		// Closed for retired allocations now empty.
		for id := range retired {
			busy := false
			for _, a := range c.alloc {
				if a == id {
					busy = true
				}
			}
			if !busy {
				delete(retired, id)
				if err := c.conn.SendClosed(ctx, id); err != nil {
					return err
				}
			}
		}
		return nil
	}
	for {
		rctx, rcancel := ctx, context.CancelFunc(func() {})
		if len(c.held) > 0 {
			rctx, rcancel = context.WithTimeout(ctx, 3*time.Millisecond)
		}
		err := c.conn.Recv(rctx, &m)
		rcancel()
		if err != nil && ctx.Err() == nil && rctx.Err() != nil && errors.Is(err, context.DeadlineExceeded) {
			if err := flush(); err != nil {
				c.err = err
				return
			}
			continue
		}
		if err != nil {
			if ctx.Err() == nil {
				c.err = err
			}
			break
		}
		switch m.Kind {
		case transport.KindOffer:
			for _, fd := range m.Offer.FDs {
				syscall.Close(fd)
			}
			c.n.Add(1)
			c.held = append(c.held, m.Offer.Seq)
			c.alloc[m.Offer.Seq] = m.Offer.AllocID
			if c.stallP > 0 && c.rng.Float64() < c.stallP {
				time.Sleep(c.stall)
			}
			if len(c.held) >= c.burst {
				if err := flush(); err != nil {
					c.err = err
					return
				}
			}
		case transport.KindRetire:
			retired[m.AllocID] = true
			if err := flush(); err != nil {
				c.err = err
				return
			}
			// flush may not have sent closed if it held nothing.
			if retired[m.AllocID] {
				delete(retired, m.AllocID)
				c.conn.SendClosed(ctx, m.AllocID)
			}
		case transport.KindGoodbye:
			return
		}
		// Release what is held when nothing else is coming soon.
		if len(c.held) > 0 && c.burst > 1 && c.rng.IntN(4) == 0 {
			if err := flush(); err != nil {
				c.err = err
				return
			}
		}
	}
}

// stop ends the consumer: with a goodbye, or abruptly (its connection
// closed without one).
func (c *inConsumer) stop(abrupt bool) {
	c.stopOnce.Do(func() { c.stop1(abrupt) })
}

func (c *inConsumer) stop1(abrupt bool) {
	c.stopping.Store(true)
	if !abrupt {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		c.conn.SendGoodbye(ctx, "bye")
		cancel()
	}
	close(c.quit)
	<-c.done
	c.conn.Close()
}

func dumpGoroutines(t testing.TB) {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	t.Logf("goroutines:\n%s", buf)
}

// opDeadline bounds one producer operation: past it, a wait that should
// have ended hangs.
const opDeadline = 5 * time.Second

// TestStressProducerWaits: producer goroutines that Alloc, Acquire,
// Offer and WaitOn concurrently while the one consumer releases in bursts,
// and a second consumer comes and goes (1 -> 2 -> 1), and contexts are
// cancelled at random.
func TestStressProducerWaits(t *testing.T) {
	bothPaths(t, func(t *testing.T, sharing share.Sharing) {
		for _, burst := range []int{1, 3} {
			t.Run(fmt.Sprint("burst", burst), func(t *testing.T) { testStressWaits(t, sharing, burst) })
		}
	})
}

func testStressWaits(t *testing.T, sharing share.Sharing, burst int) {
	env := sharetest.Setup(t)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: sharing, MaxLeasesPerConsumer: 4})
	ctx := sharetest.Ctx(t)
	main := startIn(t, e, 4, burst, uint64(time.Now().UnixNano()))
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	a, err := e.NewArena(8 * 4096)
	if err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(3, 4096)
	if err != nil {
		t.Fatal(err)
	}
	s := newStressRun(t, e, ctx)
	var wg sync.WaitGroup
	for g := range 2 {
		s.arenaLoop(&wg, g, func(c context.Context, rng *rand.Rand) (*share.Buffer, error) {
			return a.Alloc(c, 4096*uint64(1+rng.IntN(2)))
		})
	}
	s.ringLoop(&wg, r)
	// A second consumer comes and goes, with a goodbye.
	wg.Add(1)
	go func() {
		defer wg.Done()
		i := uint64(0)
		for s.running() {
			i++
			c2 := startIn(t, e, 2, 1, i)
			time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
			c2.stop(false)
			time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
		}
	}()
	wg.Wait()
	t.Logf("%d producer rounds, main consumer %d offers", s.ops.Load(), main.n.Load())
	main.stop(false)
	if main.err != nil {
		t.Errorf("main consumer: %v", main.err)
	}
	e.Close()
}

// stressRun is the producer side of a stress test, for 1.5 s: goroutines
// that take arena buffers, offer them, sometimes wait for them, and free
// them, and one that acquires and offers ring buffers. Each operation runs
// under a deadline that only a hang reaches or, at random, a short one
// whose end is expected.
type stressRun struct {
	t      *testing.T
	e      *share.Exporter
	ctx    context.Context
	stopAt time.Time
	hung   atomic.Bool
	ops    atomic.Int64
	// tolerate are errors that the test causes on purpose (consumers lost
	// with VMM: ErrAbandoned, ErrRetired).
	tolerate []error
}

func newStressRun(t *testing.T, e *share.Exporter, ctx context.Context, tolerate ...error) *stressRun {
	return &stressRun{t: t, e: e, ctx: ctx, stopAt: time.Now().Add(1500 * time.Millisecond), tolerate: tolerate}
}

func (s *stressRun) running() bool { return time.Now().Before(s.stopAt) && !s.t.Failed() }

func (s *stressRun) fail(what string, err error) {
	if errors.Is(err, context.DeadlineExceeded) && s.hung.CompareAndSwap(false, true) {
		dumpGoroutines(s.t)
	}
	s.t.Errorf("%s: %v", what, err)
}

// opCtx is an operation's context; short: its end is expected.
func (s *stressRun) opCtx(rng *rand.Rand) (c context.Context, cancel context.CancelFunc, short bool) {
	if rng.IntN(8) == 0 {
		c, cancel := context.WithTimeout(s.ctx, time.Duration(rng.IntN(2000))*time.Microsecond)
		return c, cancel, true
	}
	c, cancel = context.WithTimeout(s.ctx, opDeadline)
	return c, cancel, false
}

func (s *stressRun) ok(err error, short bool) bool {
	if err == nil || short && (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) {
		return true
	}
	for _, x := range s.tolerate {
		if errors.Is(err, x) {
			return true
		}
	}
	return false
}

// takeAndOffer takes a buffer (take: nil, nil when there is none to take
// now) and offers it, each under an operation context of its own. It
// returns the buffer (nil: none taken) and the Offer's error, a tolerated
// one; ok is false once the run failed, the buffer freed.
func (s *stressRun) takeAndOffer(rng *rand.Rand, what string, take func(context.Context) (*share.Buffer, error)) (b *share.Buffer, offerErr error, ok bool) {
	c, cancel, short := s.opCtx(rng)
	b, err := take(c)
	cancel()
	if !s.ok(err, short) {
		s.fail(what, err)
		return nil, nil, false
	}
	if b == nil {
		return nil, nil, true
	}
	c, cancel, short = s.opCtx(rng)
	err = s.e.Offer(c, b, share.OfferOptions{})
	cancel()
	if !s.ok(err, short) {
		s.fail("Offer after "+what, err)
		b.Free()
		return nil, nil, false
	}
	return b, err, true
}

// arenaLoop runs goroutine g: alloc (nil, nil: try again), Offer,
// sometimes WaitOn, Free.
func (s *stressRun) arenaLoop(wg *sync.WaitGroup, g int, alloc func(context.Context, *rand.Rand) (*share.Buffer, error)) {
	wg.Go(func() {
		rng := rand.New(rand.NewPCG(uint64(g), 1))
		take := func(c context.Context) (*share.Buffer, error) { return alloc(c, rng) }
		for s.running() {
			b, err, ok := s.takeAndOffer(rng, "Alloc", take)
			if !ok {
				return
			}
			if b == nil {
				continue
			}
			if err == nil && rng.IntN(2) == 0 {
				c, cancel, short := s.opCtx(rng)
				err = b.WaitOn(c, nil)
				cancel()
				if !s.ok(err, short) {
					s.fail("WaitOn", err)
					b.Free()
					return
				}
			}
			b.Free()
			s.ops.Add(1)
		}
	})
}

// ringLoop runs a goroutine that acquires r's buffers and offers them.
func (s *stressRun) ringLoop(wg *sync.WaitGroup, r *share.Ring) {
	wg.Go(func() {
		rng := rand.New(rand.NewPCG(99, 1))
		for s.running() {
			b, err, ok := s.takeAndOffer(rng, "Acquire", r.Acquire)
			if !ok {
				return
			}
			if b == nil {
				continue
			}
			if err != nil {
				b.Free()
			}
			s.ops.Add(1)
		}
	})
}

// TestStressChurnVMM: as TestStressProducerWaits, with VMM, while the main
// consumer stalls now and then, and the second consumer often dies
// holding leases (its buffers are abandoned: rings get fresh memory,
// arenas shrink until Alloc says ErrAbandoned, and a new arena is made).
func TestStressChurnVMM(t *testing.T) {
	for _, wt := range []time.Duration{0, 30 * time.Millisecond} {
		t.Run(fmt.Sprint("wt", wt), func(t *testing.T) { testStressChurn(t, wt) })
	}
}

func testStressChurn(t *testing.T, writeTimeout time.Duration) {
	env := sharetest.Setup(t)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: share.SharingVMM, MaxLeasesPerConsumer: 4,
		WriteTimeout: writeTimeout, LeaseTimeout: 500 * time.Millisecond})
	ctx := sharetest.Ctx(t)
	main := startIn(t, e, 4, 2, uint64(time.Now().UnixNano()), func(c *inConsumer) {
		if writeTimeout == 0 { // else the transport drops it: no consumer left
			c.stallP, c.stall = 0.02, 20*time.Millisecond
		}
	})
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	var amu sync.Mutex
	newArena := func() *share.Arena {
		a, err := e.NewArena(8 * 4096)
		if err != nil {
			t.Error(err)
			return nil
		}
		return a
	}
	a := newArena()
	chunk := a.Available() / 8
	r, err := e.NewRing(3, 4096)
	if err != nil {
		t.Fatal(err)
	}
	s := newStressRun(t, e, ctx, share.ErrAbandoned, share.ErrRetired)
	var wg sync.WaitGroup
	var arenas atomic.Int64
	for g := range 2 {
		s.arenaLoop(&wg, g, func(c context.Context, rng *rand.Rand) (*share.Buffer, error) {
			amu.Lock()
			cur := a
			amu.Unlock()
			b, err := cur.Alloc(c, chunk*uint64(1+rng.IntN(2)))
			if errors.Is(err, share.ErrAbandoned) || errors.Is(err, share.ErrRetired) {
				// Given up to lost consumers: a new arena takes its place.
				amu.Lock()
				if a == cur {
					a = newArena()
					arenas.Add(1)
					go cur.Retire(ctx)
				}
				amu.Unlock()
				return nil, nil
			}
			return b, err
		})
	}
	s.ringLoop(&wg, r)
	wg.Go(func() {
		i := uint64(0)
		for s.running() {
			i++
			c2 := startIn(t, e, 2, 4, i, func(c *inConsumer) {
				if writeTimeout > 0 && i%2 == 0 {
					c.stallP, c.stall = 1, 4*writeTimeout
				}
			})
			time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
			if writeTimeout > 0 && i%2 == 0 {
				time.Sleep(5 * writeTimeout)
			}
			c2.stop(rand.IntN(2) == 0)
			time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
		}
	})
	wg.Wait()
	t.Logf("%d producer rounds, %d arenas, main consumer %d offers; stats %+v", s.ops.Load(), arenas.Load(), main.n.Load(), e.Stats())
	main.stop(false)
	e.Close()
}

// TestStressCloseMidway: producer goroutines wait in Alloc, Acquire, Offer and
// WaitOn (the one consumer holds everything and stalls) when the exporter
// closes (Close, or Shutdown): every wait must end.
func TestStressCloseMidway(t *testing.T) {
	bothPaths(t, func(t *testing.T, sharing share.Sharing) {
		hows := []string{"close", "shutdown", "cancel", "consumer-exit", "second-consumer"}
		if sharing == share.SharingVMM {
			// With legacy IPC, what a consumer lost without a goodbye
			// held waits for its process, this one, to exit.
			hows = append(hows, "abrupt-exit")
		}
		for _, how := range hows {
			t.Run(how, func(t *testing.T) { testStressCloseMidway(t, sharing, how) })
		}
	})
}

func testStressCloseMidway(t *testing.T, sharing share.Sharing, how string) {
	env := sharetest.Setup(t)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: sharing, MaxLeasesPerConsumer: 2})
	ctx := sharetest.Ctx(t)
	// The consumer holds all it gets until told.
	hold := make(chan struct{})
	main := startIn(t, e, 2, 1, 1, func(c *inConsumer) { c.holdAll = true })
	_ = hold
	if err := e.WaitConsumers(ctx, 1); err != nil {
		t.Fatal(err)
	}
	a, err := e.NewArena(4 * 4096)
	if err != nil {
		t.Fatal(err)
	}
	chunk := a.Available() / 2
	r, err := e.NewRing(1, 4096)
	if err != nil {
		t.Fatal(err)
	}
	// The consumer takes the ring's buffer and half the arena.
	rb, err := r.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Offer(ctx, rb, share.OfferOptions{}); err != nil {
		t.Fatal(err)
	}
	ab, err := a.Alloc(ctx, chunk)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Offer(ctx, ab, share.OfferOptions{}); err != nil {
		t.Fatal(err)
	}
	kept, err := a.Alloc(ctx, chunk)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type res struct {
		what string
		err  error
	}
	done := make(chan res, 8)
	go func() { _, err := r.Acquire(wctx); done <- res{"Acquire", err} }()
	go func() { _, err := a.Alloc(wctx, chunk); done <- res{"Alloc", err} }()
	go func() { done <- res{"Offer", e.Offer(wctx, kept, share.OfferOptions{})} }()
	go func() { done <- res{"WaitOn", ab.WaitOn(wctx, nil)} }()
	time.Sleep(30 * time.Millisecond)
	switch how {
	case "close":
		e.Close()
	case "shutdown":
		sctx, scancel := context.WithTimeout(ctx, 200*time.Millisecond)
		go func() { e.Shutdown(sctx); scancel() }()
	case "cancel":
		cancel()
	case "consumer-exit", "second-consumer", "abrupt-exit":
		if how == "second-consumer" {
			c2 := startIn(t, e, 2, 1, 2)
			time.Sleep(30 * time.Millisecond)
			c2.stop(false)
			time.Sleep(30 * time.Millisecond)
		}
		main.stop(how == "abrupt-exit") // with a goodbye, what it held is void
		// Acquire and WaitOn end now: the ring's buffer and ab are no
		// longer leased (with VMM and no goodbye, abandoned).
		got := map[string]error{}
		timeout := time.After(2 * time.Second)
		for len(got) < 2 {
			select {
			case x := <-done:
				got[x.what] = x.err
				t.Logf("%s: %v", x.what, x.err)
			case <-timeout:
				dumpGoroutines(t)
				t.Fatalf("after the consumer's end (%s): only %v returned", how, got)
			}
		}
		cancel()
		for range 2 {
			x := <-done
			t.Logf("%s: %v", x.what, x.err)
		}
		e.Close()
		return
	}
	deadline := time.After(5 * time.Second)
	for range 4 {
		select {
		case x := <-done:
			t.Logf("%s: %v", x.what, x.err)
		case <-deadline:
			dumpGoroutines(t)
			t.Fatalf("a wait did not end after %s", how)
		}
	}
	main.stop(false)
	e.Close()
}

// TestStressQuarantineDrain: with VMM, a consumer lost while holding a
// ring buffer makes the exporter replace the ring's allocation
// (quarantineLocked), which drains the ring's free list under the
// exporter's lock with `for len(r.free) > 0 { <-r.free }`, while
// Ring.Acquire takes from the same channel without the lock. If an
// Acquire takes the last free buffer between the length and the receive,
// the receive blocks for ever, holding the exporter's lock.
func TestStressQuarantineDrain(t *testing.T) {
	env := sharetest.Setup(t)
	e := newExporterWith(t, env, share.ExporterConfig{Sharing: share.SharingVMM})
	ctx := sharetest.Ctx(t)
	const n = 16
	r, err := e.NewRing(n, 256)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var spins atomic.Int64
	for range stressSpinners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				c, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
				b, err := r.Acquire(c)
				cancel()
				if err == nil {
					b.Free()
					spins.Add(1)
				}
			}
		}()
	}
	deadline := time.Now().Add(4 * time.Second)
	iters := 0
	for time.Now().Before(deadline) {
		iters++
		c := startIn(t, e, 1, 1, uint64(iters), func(c *inConsumer) { c.holdAll = true })
		octx, cancel := context.WithTimeout(ctx, 3*time.Second)
		var b *share.Buffer
		for b == nil {
			b, err = r.Acquire(octx)
			if err != nil {
				cancel()
				dumpGoroutines(t)
				t.Fatalf("iteration %d: Acquire: %v", iters, err)
			}
		}
		if err := e.Offer(octx, b, share.OfferOptions{}); err != nil {
			cancel()
			dumpGoroutines(t)
			t.Fatalf("iteration %d: Offer: %v", iters, err)
		}
		cancel()
		for c.n.Load() == 0 {
			time.Sleep(50 * time.Microsecond)
		}
		c.stop(true) // lost while holding it: abandoned, the ring's allocation replaced
		done := make(chan struct{})
		go func() {
			for e.Stats().Replaced < uint64(iters) {
				time.Sleep(50 * time.Microsecond)
			}
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(3 * time.Second):
			dumpGoroutines(t)
			t.Fatalf("iteration %d: the exporter is stuck", iters)
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("%d replacements, %d acquires", iters, spins.Load())
	e.Close()
}

// stressSpinners is how many goroutines take and give back ring buffers
// while the ring's allocation is replaced.
const stressSpinners = 12
