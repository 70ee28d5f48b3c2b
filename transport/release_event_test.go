//go:build linux

package transport

import (
	"errors"
	"testing"
)

// TestReleaseEvent: a stream-ordered release carries its event to a
// producer that advertised CapReleaseEvents; a consumer cannot send one to
// a producer that did not, and a producer that did not advertise it
// refuses one sent anyway.
func TestReleaseEvent(t *testing.T) {
	pcfg := testConfig(RoleProducer, nil)
	pcfg.ReleaseEvents = true
	prod, cons := pair(t, pcfg, testConfig(RoleConsumer, nil))
	ctx := testCtx(t)
	o := testOffer()
	if err := prod.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	var m Message
	if err := cons.Recv(ctx, &m); err != nil {
		t.Fatal(err)
	}
	ev := Handle{9, 8, 7}
	if err := cons.SendReleaseAfter(ctx, ev, m.Offer.Seq); err != nil {
		t.Fatal(err)
	}
	if err := prod.Recv(ctx, &m); err != nil {
		t.Fatal(err)
	}
	if m.Kind != KindRelease || !m.HasReleaseEvent || m.ReleaseEvent != ev || len(m.Seqs) != 1 || m.Seqs[0] != o.Seq {
		t.Fatalf("received %+v, want the release of %d after event %x", m, o.Seq, ev[:3])
	}
	// A plain release after it carries none.
	if err := prod.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	if err := cons.Recv(ctx, &m); err != nil {
		t.Fatal(err)
	}
	if err := cons.SendRelease(ctx, m.Offer.Seq); err != nil {
		t.Fatal(err)
	}
	if err := prod.Recv(ctx, &m); err != nil || m.HasReleaseEvent {
		t.Fatalf("plain release: %v, event %v", err, m.HasReleaseEvent)
	}

	prod2, cons2 := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	if err := prod2.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	if err := cons2.Recv(ctx, &m); err != nil {
		t.Fatal(err)
	}
	if err := cons2.SendReleaseAfter(ctx, ev, m.Offer.Seq); !errors.Is(err, ErrNotSupported) {
		t.Fatalf("SendReleaseAfter to a producer without CapReleaseEvents: %v, want ErrNotSupported", err)
	}
	// Sent anyway, by a peer that ignores the capability.
	cons2.mu.Lock()
	cons2.peer.Caps |= CapReleaseEvents
	cons2.mu.Unlock()
	if err := cons2.SendReleaseAfter(ctx, ev, m.Offer.Seq); err != nil {
		t.Fatal(err)
	}
	if err := prod2.Recv(ctx, &m); !errors.Is(err, ErrNotSupported) {
		t.Fatalf("a release event to a producer that did not advertise them: %v, want ErrNotSupported", err)
	}
}
