//go:build linux

package transport

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// pollAll is a producer's reading loop over a poller: it takes what every
// connection has, and waits when none has anything, until done says so.
// It returns the messages taken per connection and how each ended (nil:
// it has not).
func pollAll(t *testing.T, p *poller, conns []*Conn, done func(got []int, ended []error) bool) (got []int, ended []error) {
	t.Helper()
	ctx := testCtx(t)
	got = make([]int, len(conns))
	ended = make([]error, len(conns))
	var m Message
	for !done(got, ended) {
		for i, c := range conns {
			if ended[i] != nil {
				continue
			}
			for {
				ok, err := c.tryRecv(&m)
				if err != nil {
					ended[i] = err
					p.Remove(c)
					break
				}
				if !ok {
					break
				}
				got[i]++
			}
		}
		if done(got, ended) {
			break
		}
		if err := p.Wait(ctx); err != nil {
			t.Fatalf("Wait: %v (got %v, ended %v)", err, got, ended)
		}
	}
	return got, ended
}

// TestPollerReadsEveryConn: one goroutine reads many consumers through a
// poller, on lanes and on sockets: every release comes, whenever each
// consumer sends it (at once, or after it slept long enough for the
// reader to sleep too); then consumers that close, with a goodbye or
// without, end their connection's tryRecv with the right error.
func TestPollerReadsEveryConn(t *testing.T) {
	for _, shm := range []bool{true, false} {
		t.Run(fmt.Sprintf("shm=%v", shm), func(t *testing.T) {
			checkNoFDLeak(t)
			const n, per = 12, 40
			pcfg, ccfg := testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil)
			pcfg.DisableShm, ccfg.DisableShm = !shm, !shm
			ccfg.Credits = 4
			l := listen(t, pcfg)
			ctx := testCtx(t)
			p, err := newPoller(50 * time.Microsecond)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			prods := make([]*Conn, n)
			conss := make([]*Conn, n)
			for i := range n {
				if conss[i], err = Dial(ctx, l.Addr(), ccfg); err != nil {
					t.Fatal(err)
				}
				defer conss[i].Close()
				if prods[i], err = l.Accept(ctx); err != nil {
					t.Fatal(err)
				}
				defer prods[i].Close()
				if prods[i].Shm() != shm {
					t.Fatalf("shm mode %v, want %v", prods[i].Shm(), shm)
				}
				if err := p.Add(prods[i]); err != nil {
					t.Fatal(err)
				}
			}
			if len(p.conns) != n {
				t.Fatalf("Len %d, want %d", len(p.conns), n)
			}
			// Each consumer releases what it is offered, at once or
			// after a pause.
			var wg sync.WaitGroup
			for i, c := range conss {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(i), 7))
					var m Message
					for range per {
						if err := c.Recv(ctx, &m); err != nil {
							t.Errorf("consumer %d: %v", i, err)
							return
						}
						if rng.IntN(4) == 0 {
							time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond)
						}
						if err := c.SendRelease(ctx, m.Offer.Seq); err != nil {
							t.Errorf("consumer %d: %v", i, err)
							return
						}
					}
				}()
			}
			// The producer offers per times to each, within its credits,
			// reading the releases through the poller alone.
			o := testOffer()
			sent := make([]int, n)
			got := make([]int, n)
			var m Message
			for total := 0; total < n*per; {
				for i, c := range prods {
					for sent[i] < per && sent[i]-got[i] < int(ccfg.Credits) {
						o.Seq = uint64(sent[i] + 1)
						if err := c.SendOffer(ctx, &o); err != nil {
							t.Fatal(err)
						}
						sent[i]++
					}
				}
				progressed := false
				for i, c := range prods {
					for {
						ok, err := c.tryRecv(&m)
						if err != nil {
							t.Fatalf("conn %d: %v", i, err)
						}
						if !ok {
							break
						}
						if m.Kind != KindRelease {
							t.Fatalf("conn %d: %v, want release", i, m.Kind)
						}
						got[i] += len(m.Seqs)
						total += len(m.Seqs)
						progressed = true
					}
				}
				if !progressed && total < n*per {
					if err := p.Wait(ctx); err != nil {
						t.Fatal(err)
					}
				}
			}
			wg.Wait()
			// Half leave with a goodbye, half without: each end is seen.
			for i, c := range conss {
				if i%2 == 0 {
					if err := c.SendGoodbye(ctx, "done"); err != nil {
						t.Fatal(err)
					}
				}
				c.Close()
			}
			_, ended := pollAll(t, p, prods, func(_ []int, ended []error) bool {
				for _, e := range ended {
					if e == nil {
						return false
					}
				}
				return true
			})
			for i, err := range ended {
				if i%2 == 0 && !errors.Is(err, io.EOF) {
					t.Errorf("conn %d after a goodbye: %v, want io.EOF", i, err)
				}
				if i%2 == 1 && !errors.Is(err, ErrDisconnected) {
					t.Errorf("conn %d closed without a goodbye: %v, want ErrDisconnected", i, err)
				}
			}
			if len(p.conns) != 0 {
				t.Errorf("Len %d after every Remove", len(p.conns))
			}
		})
	}
}

// TestPollerWake: Wait returns for Wake, from any goroutine, and when its
// context ends; a Wake before Wait is not lost; a connection closed by
// another goroutine while the reader sleeps wakes it, and its tryRecv says
// it is closed.
func TestPollerWake(t *testing.T) {
	checkNoFDLeak(t)
	p, err := newPoller(0)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx := testCtx(t)
	p.Wake()
	if err := p.Wait(ctx); err != nil {
		t.Fatalf("Wait after Wake: %v", err)
	}
	go func() {
		time.Sleep(20 * time.Millisecond) // long enough that Wait sleeps: the condition under test
		p.Wake()
	}()
	if err := p.Wait(ctx); err != nil {
		t.Fatalf("Wait woken: %v", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	go func() {
		time.Sleep(20 * time.Millisecond)
		cancel()
	}()
	if err := p.Wait(cctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait whose context ended: %v", err)
	}

	prod, _ := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	if err := p.Add(prod); err != nil {
		t.Fatal(err)
	}
	if err := p.Add(prod); err == nil {
		t.Fatal("a second Add of one connection was accepted")
	}
	go func() {
		time.Sleep(20 * time.Millisecond)
		prod.Close()
	}()
	_, ended := pollAll(t, p, []*Conn{prod}, func(_ []int, ended []error) bool { return ended[0] != nil })
	if !errors.Is(ended[0], ErrClosed) {
		t.Fatalf("tryRecv of a connection closed under the poller: %v, want ErrClosed", ended[0])
	}
}

// TestPollerFrameTimeout: a peer that sends half a frame and stops is
// failed once FrameTimeout has passed, as a Recv would fail it, although
// nothing more ever arrives to wake the poller.
func TestPollerFrameTimeout(t *testing.T) {
	cfg := testConfig(RoleProducer, nil)
	cfg.DisableShm = true
	cfg.FrameTimeout = 300 * time.Millisecond
	l := listen(t, cfg)
	ctx := testCtx(t)
	raw := rawDial(t, filepath.Clean(l.Addr()))
	go raw.hello(RoleConsumer, 4, 0)
	prod, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close()
	p, err := newPoller(0)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.Add(prod); err != nil {
		t.Fatal(err)
	}
	raw.write([]byte{0, 0, 0, 10, 0x93})
	_, ended := pollAll(t, p, []*Conn{prod}, func(_ []int, ended []error) bool { return ended[0] != nil })
	if !errors.Is(ended[0], ErrTimeout) {
		t.Fatalf("half a frame under the poller: %v, want ErrTimeout", ended[0])
	}
}

// TestPollerWaitsNotOnAClosedConnUnread: the Wake of a connection closed
// by this side is the only word of its end (its socket left the epoll set
// with no event). A reader that took that Wake but did not look at the
// connection in the pass after it (a shrinking list skipped it: a reader
// that ended another connection in the same pass) must not sleep for
// ever in its next Wait: a connection whose end is untaken keeps Wait
// from sleeping, as a socket with bytes unread does.
func TestPollerWaitsNotOnAClosedConnUnread(t *testing.T) {
	for _, shm := range []bool{true, false} {
		t.Run(fmt.Sprintf("shm=%v", shm), func(t *testing.T) {
			pcfg, ccfg := testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil)
			pcfg.DisableShm, ccfg.DisableShm = !shm, !shm
			p, err := newPoller(0)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			a, _ := pair(t, pcfg, ccfg)
			b, _ := pair(t, pcfg, ccfg)
			for _, c := range []*Conn{a, b} {
				if err := p.Add(c); err != nil {
					t.Fatal(err)
				}
			}
			// Both are read to their (empty) present.
			var m Message
			for _, c := range []*Conn{a, b} {
				if ok, err := c.tryRecv(&m); ok || err != nil {
					t.Fatalf("tryRecv of an idle connection: %v, %v", ok, err)
				}
			}
			a.Close()
			b.Close()
			ctx := testCtx(t)
			if err := p.Wait(ctx); err != nil {
				t.Fatalf("Wait after the closes: %v", err)
			}
			// The pass after it takes a's end only.
			if _, err := a.tryRecv(&m); !errors.Is(err, ErrClosed) {
				t.Fatalf("tryRecv of a closed connection: %v, want ErrClosed", err)
			}
			p.Remove(a)
			// b's end is still to be taken: Wait returns (the watchdog
			// only ends a Wait that would sleep for ever).
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			if err := p.Wait(wctx); err != nil {
				t.Fatalf("Wait with a closed connection unread: %v, want nil (it slept)", err)
			}
			if _, err := b.tryRecv(&m); !errors.Is(err, ErrClosed) {
				t.Fatalf("tryRecv of a closed connection: %v, want ErrClosed", err)
			}
		})
	}
}

// TestPollerKickToldWhy: a connection failed with a reason by another
// goroutine (a producer's lease janitor) while a reader polls it, and the
// reader closes it as soon as its tryRecv fails (as a producer does when a
// consumer ends): the peer is still told why, every time. The reader must
// not see the failure before the error message is written.
func TestPollerKickToldWhy(t *testing.T) {
	for _, shm := range []bool{true, false} {
		t.Run(fmt.Sprintf("shm=%v", shm), func(t *testing.T) {
			pcfg, ccfg := testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil)
			pcfg.DisableShm, ccfg.DisableShm = !shm, !shm
			l := listen(t, pcfg)
			ctx := testCtx(t)
			p, err := newPoller(0)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			for i := range 100 {
				cons, err := Dial(ctx, l.Addr(), ccfg)
				if err != nil {
					t.Fatal(err)
				}
				prod, err := l.Accept(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if err := p.Add(prod); err != nil {
					t.Fatal(err)
				}
				go prod.CloseWithError(fmt.Errorf("%w: held a lease too long", ErrTimeout))
				pollAll(t, p, []*Conn{prod}, func(_ []int, ended []error) bool { return ended[0] != nil })
				prod.Close() // what the reader does at once
				var m Message
				err = cons.Recv(ctx, &m)
				if !errors.Is(err, ErrTimeout) {
					t.Fatalf("connection %d: the peer got %v, want the reason (ErrTimeout)", i, err)
				}
				cons.Close()
			}
		})
	}
}
