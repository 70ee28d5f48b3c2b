//go:build linux

package share_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/sharetest"
	"github.com/seed743c36cf/cudashare/share"
)

// lostSendSetup starts an exporter with n consumer processes (params as
// startConsumers takes them).
func lostSendSetup(t *testing.T, n int, params ...string) (*sharetest.Env, *share.Exporter, context.Context) {
	t.Helper()
	env := sharetest.Setup(t)
	e := newExporter(t, env)
	ctx := sharetest.Ctx(t)
	startConsumers(t, e, n, params...)
	return env, e, ctx
}

func lostSendRing(t *testing.T, env *sharetest.Env, e *share.Exporter, n int) (*share.Ring, *share.Buffer) {
	t.Helper()
	if sh, why := e.Sharing(); sh != share.SharingVMM {
		t.Skipf("sharing %v (%s)", sh, why)
	}
	return acquireFilled(t, env, e, n)
}

// TestConsumerLostDuringSend: a consumer lost while an offer of a VMM ring
// buffer to it is being sent. If the send fails, the offer never reached
// it: the buffer is not abandoned (no fresh memory replaces it) and the
// producer offers it to another consumer. If the offer went out, the lost
// consumer may read the buffer: it is abandoned and the ring gets fresh
// memory in its place.
func TestConsumerLostDuringSend(t *testing.T) {
	for _, delivered := range []bool{false, true} {
		t.Run(fmt.Sprintf("delivered=%v", delivered), func(t *testing.T) {
			env, e, ctx := lostSendSetup(t, 2)
			r, b := lostSendRing(t, env, e, 1)
			opts := share.OfferOptions{Meta: sharetest.Meta(0)}
			offered, err := share.OfferToConsumerLostDuringSend(ctx, e, b, opts, delivered)
			if err != nil || offered != delivered {
				t.Fatalf("offer to a consumer lost during the send = %v, %v; want %v, nil", offered, err, delivered)
			}
			s := e.Stats()
			if !delivered {
				if s.Abandoned != 0 || s.Replaced != 0 {
					t.Fatalf("an offer that never reached the lost consumer abandoned its buffer: %+v", s)
				}
				if err := e.Offer(ctx, b, opts); err != nil {
					t.Fatalf("Offer to the other consumer after the loss: %v", err)
				}
				if s := e.Stats(); s.Offers != 1 {
					t.Errorf("stats %+v, want 1 offer", s)
				}
			} else {
				if s.Abandoned != 1 || s.Replaced != 1 || s.Offers != 1 {
					t.Fatalf("an offer that reached the lost consumer: stats %+v, want 1 abandoned, 1 replaced, 1 offer", s)
				}
				nb, err := r.Acquire(ctx)
				if err != nil {
					t.Fatalf("Acquire after the ring's replacement: %v", err)
				}
				if nb.AllocID() == b.AllocID() {
					t.Errorf("the ring handed out the abandoned allocation %d again", b.AllocID())
				}
				if err := nb.Free(); err != nil {
					t.Fatal(err)
				}
			}
			shutdown(t, e)
		})
	}
}

// TestLostDuringSendProcessServedLast: a consumer lost while a VMM offer to
// it is being sent, whose offer went out, has the buffer abandoned to it;
// as when it is lost after the send, its process stays watched and is
// served last while it lives (procWatch.abandoned).
func TestLostDuringSendProcessServedLast(t *testing.T) {
	for _, deferred := range []bool{false, true} {
		t.Run(fmt.Sprintf("deferred=%v", deferred), func(t *testing.T) {
			// Their processes outlive their connections, as a lost
			// consumer's that may still read what it mapped does.
			env, e, ctx := lostSendSetup(t, 2, sharetest.EnvParam(sharetest.ParamLinger, 1))
			_, b := lostSendRing(t, env, e, 2)
			opts := share.OfferOptions{Meta: sharetest.Meta(0)}
			var (
				offered bool
				err     error
				li      share.LostInfo
			)
			if deferred {
				offered, li, err = share.OfferLostDuringSendInfo(ctx, e, b, opts, true)
			} else {
				offered, li, err = share.OfferThenLose(ctx, e, b, opts)
			}
			if !offered || err != nil {
				t.Fatalf("offer = %v, %v", offered, err)
			}
			s := e.Stats()
			t.Logf("lost consumer: %+v; stats: Abandoned=%d Replaced=%d Offers=%d Releases=%d Leases=%d Lost=%d",
				li, s.Abandoned, s.Replaced, s.Offers, s.Releases, s.Leases, s.ConsumersLost)
			if li.Abandoned != 1 || li.ProcAbandoned != 1 {
				t.Errorf("abandoned counts %+v", li)
			}
			if li.Dropped || !li.Watched {
				t.Errorf("the lost consumer, whose process may read an abandoned buffer, was dropped and its process unwatched (%+v): a reconnect from that process is not served last", li)
			}
			shutdown(t, e)
		})
	}
}

// TestBroadcastWithAConsumerLost: one consumer lost during (or right
// after) its part of a Broadcast of a VMM ring buffer: its abandonment
// retires the buffer's allocation in the background (quarantine), so the
// Broadcast's next target finds b retired; the Broadcast still ends with
// the consumers it reached, not with an error.
func TestBroadcastWithAConsumerLost(t *testing.T) {
	for _, sentFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("sentFirst=%v", sentFirst), func(t *testing.T) {
			env, e, ctx := lostSendSetup(t, 3)
			_, b := lostSendRing(t, env, e, 1)
			n, err := share.BroadcastLosingFirst(ctx, e, b, share.OfferOptions{Meta: sharetest.Meta(0)}, sentFirst, 50*time.Millisecond)
			s := e.Stats()
			t.Logf("Broadcast = %d, %v; stats: Abandoned=%d Replaced=%d Offers=%d Releases=%d Leases=%d", n, err, s.Abandoned, s.Replaced, s.Offers, s.Releases, s.Leases)
			if err != nil {
				t.Errorf("one consumer's loss failed the Broadcast: %d, %v", n, err)
			}
			shutdown(t, e)
		})
	}
}

// TestArenaConsumerLostDuringSend: the deferred path for an arena buffer.
func TestArenaConsumerLostDuringSend(t *testing.T) {
	for _, delivered := range []bool{false, true} {
		t.Run(fmt.Sprintf("delivered=%v", delivered), func(t *testing.T) {
			env, e, ctx := lostSendSetup(t, 2)
			if sh, _ := e.Sharing(); sh != share.SharingVMM {
				t.Skip("vmm")
			}
			a, err := e.NewArena(1 << 20)
			if err != nil {
				t.Fatal(err)
			}
			full := a.Available()
			b, err := a.Alloc(ctx, 4096)
			if err != nil {
				t.Fatal(err)
			}
			if err := sharetest.Fill(env.Ctx, b.Ptr(), b.Size(), 0); err != nil {
				t.Fatal(err)
			}
			env.Ctx.Synchronize()
			opts := share.OfferOptions{Meta: sharetest.Meta(0)}
			offered, err := share.OfferToConsumerLostDuringSend(ctx, e, b, opts, delivered)
			if err != nil || offered != delivered {
				t.Fatalf("offer = %v, %v", offered, err)
			}
			if !delivered {
				if err := e.Offer(ctx, b, opts); err != nil {
					t.Fatalf("re-offer: %v", err)
				}
			}
			if err := b.Free(); err != nil {
				t.Fatal(err)
			}
			want := full
			if delivered {
				want = full - 4096
			}
			waitUntil(t, "arena range back", func() bool { return a.Available() == want })
			s := e.Stats()
			t.Logf("stats: %+v, available %d of %d", s, a.Available(), full)
			if s.Leases != 0 || s.Offers != s.Releases {
				t.Errorf("stats inconsistent: %+v", s)
			}
			wantAb := uint64(0)
			if delivered {
				wantAb = 4096
			}
			if s.AbandonedBytes != wantAb {
				t.Errorf("AbandonedBytes %d, want %d", s.AbandonedBytes, wantAb)
			}
			shutdown(t, e)
		})
	}
}

// TestShutdownDuringALostConsumersSend: Shutdown starts while the send to
// a consumer already lost is in flight (a deferred voided vmm lease): it
// must wait for the send, and free nothing early.
func TestShutdownDuringALostConsumersSend(t *testing.T) {
	for _, delivered := range []bool{false, true} {
		t.Run(fmt.Sprintf("delivered=%v", delivered), func(t *testing.T) {
			env := sharetest.Setup(t)
			before := sharetest.CountViolations(t)
			e := newExporter(t, env)
			ctx := sharetest.Ctx(t)
			startConsumers(t, e, 2)
			_, b := lostSendRing(t, env, e, 2)
			done := make(chan error, 1)
			offered, err := share.OfferLostDuringSendThen(ctx, e, b, share.OfferOptions{Meta: sharetest.Meta(0)}, delivered, func() {
				go func() {
					c, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					defer cancel()
					done <- e.Shutdown(c)
				}()
				for !share.Closing(e) {
					time.Sleep(time.Millisecond)
				}
				time.Sleep(50 * time.Millisecond) // Shutdown waits on rec.sending
				if s := e.Stats(); s.Allocations == 0 {
					t.Errorf("Shutdown freed allocations while a send was in flight")
				}
			})
			t.Logf("offer = %v, %v", offered, err)
			if err := <-done; err != nil {
				t.Errorf("Shutdown: %v", err)
			}
			s := e.Stats()
			t.Logf("stats: %+v", s)
			if s.Leases != 0 || s.Allocations != 0 || s.Offers != s.Releases {
				t.Errorf("stats after Shutdown: %+v", s)
			}
			sharetest.NoNewViolations(t, before)
		})
	}
}
