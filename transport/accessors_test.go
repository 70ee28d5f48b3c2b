//go:build linux

package transport

import (
	"errors"
	"io"
	"testing"
)

// TestCreditsAccessor proves that Credits reports the consumer's window less the
// offers outstanding, on both sides, and follows releases and grants.
func TestCreditsAccessor(t *testing.T) {
	ccfg := testConfig(RoleConsumer, nil)
	ccfg.Credits = 3
	prod, cons := pair(t, testConfig(RoleProducer, nil), ccfg)
	ctx := testCtx(t)
	if got := prod.Credits(); got != 3 {
		t.Fatalf("producer's credits after the handshake: %d, want 3", got)
	}
	o := testOffer()
	for i := range 3 {
		o.Seq = uint64(i)
		if err := prod.SendOffer(ctx, &o); err != nil {
			t.Fatal(err)
		}
	}
	if got := prod.Credits(); got != 0 {
		t.Fatalf("producer's credits with 3 offers out: %d, want 0", got)
	}
	var m Message
	for range 3 {
		if err := cons.Recv(ctx, &m); err != nil {
			t.Fatal(err)
		}
	}
	if got := cons.Credits(); got != 0 {
		t.Fatalf("consumer's credits holding 3 offers: %d, want 0", got)
	}
	if err := cons.SendRelease(ctx, 0, 1); err != nil {
		t.Fatal(err)
	}
	if err := cons.SendCredit(ctx, 5); err != nil {
		t.Fatal(err)
	}
	if got := cons.Credits(); got != 7 {
		t.Fatalf("consumer's credits after releasing 2 and granting 5: %d, want 7", got)
	}
	for range 2 {
		if err := prod.Recv(ctx, &m); err != nil {
			t.Fatal(err)
		}
	}
	if got := prod.Credits(); got != 7 {
		t.Fatalf("producer's credits after the release and the grant: %d, want 7", got)
	}
}

// TestSendGoodbyeLingers proves that SendGoodbye leaves the connection
// open: the peer reads the goodbye and a clean end even when it writes
// after the goodbye was sent, because the socket stays open until the
// sender closes. (With Shutdown, such a write can fail first and lose the
// goodbye.)
func TestSendGoodbyeLingers(t *testing.T) {
	prod, cons := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	ctx := testCtx(t)
	if err := cons.SendGoodbye(ctx, "done"); err != nil {
		t.Fatal(err)
	}
	if err := cons.SendRelease(ctx, 1); !errors.Is(err, ErrClosed) {
		t.Fatalf("send after goodbye: %v, want ErrClosed", err)
	}
	// The producer keeps writing; nothing fails, since the consumer's
	// socket is still open.
	o := testOffer()
	for i := range 3 {
		o.Seq = uint64(i)
		if err := prod.SendOffer(ctx, &o); err != nil {
			t.Fatal(err)
		}
	}
	if err := prod.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	var m Message
	if err := prod.Recv(ctx, &m); err != nil || m.Kind != KindGoodbye || m.Reason != "done" {
		t.Fatalf("producer's Recv: %v %v %q, want the goodbye", err, m.Kind, m.Reason)
	}
	prod.Close() // as a peer does on a goodbye
	for {
		err := cons.Recv(ctx, &m)
		if err == nil {
			continue // the offers sent after the goodbye
		}
		if !errors.Is(err, ErrDisconnected) {
			t.Fatalf("consumer's Recv once the producer closed: %v, want ErrDisconnected", err)
		}
		break
	}
	cons.Close()
}

// TestSendGoodbyeHalfCloses proves what PROTOCOL.md section 4 says of
// goodbye: its sender stops writing and half-closes, so a peer that has not
// closed its own side reads the goodbye and then end of stream, while the
// sender can still read what the peer sends until the peer closes. (Before
// the half-close, a peer waiting for end of stream and a sender waiting for
// the peer to close waited for each other until a timeout.)
func TestSendGoodbyeHalfCloses(t *testing.T) {
	prod, raw := rawConsumer(t, testConfig(RoleProducer, nil), 4)
	ctx := testCtx(t)
	if err := prod.SendGoodbye(ctx, "shut down"); err != nil {
		t.Fatal(err)
	}
	m, err := raw.recv()
	if err != nil || m[0] != uint64(KindGoodbye) || m[1] != "shut down" {
		t.Fatalf("raw peer's first read: %v, %v; want the goodbye", m, err)
	}
	// The raw peer has not closed anything: end of stream can only come
	// from the producer's half-close.
	if m, err := raw.recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("raw peer's read after the goodbye: %v, %v; want end of stream", m, err)
	}
	// The producer still reads.
	raw.sendMsg(KindGoodbye, "bye too")
	var msg Message
	if err := prod.Recv(ctx, &msg); err != nil || msg.Kind != KindGoodbye || msg.Reason != "bye too" {
		t.Fatalf("producer's Recv after its goodbye: %v %v %q, want the peer's goodbye", err, msg.Kind, msg.Reason)
	}
}
