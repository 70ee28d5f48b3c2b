//go:build linux

package transport

import (
	"io"
	"testing"
)

// A producer's session id reaches the consumer in the hello-ack, and a
// producer that restarts says so in its goodbye's code (PROTOCOL.md,
// sections 3 and 4, goodbye): what a consumer that reconnects needs to
// tell a new producer from the one before it.
func TestSessionAndRestartingGoodbye(t *testing.T) {
	pcfg := testConfig(RoleProducer, io.Discard)
	pcfg.Session = 0xfeedface_12345678
	prod, cons := pair(t, pcfg, testConfig(RoleConsumer, io.Discard))
	if got := cons.Peer().Session; got != pcfg.Session {
		t.Fatalf("the consumer sees session %#x, want %#x", got, pcfg.Session)
	}
	if got := prod.Peer().Session; got != 0 {
		t.Fatalf("the producer sees the consumer's session %#x, want 0 (a consumer has none)", got)
	}
	ctx := testCtx(t)
	if err := prod.SendGoodbyeCode(ctx, GoodbyeRestarting, "restarting"); err != nil {
		t.Fatal(err)
	}
	var m Message
	if err := cons.Recv(ctx, &m); err != nil || m.Kind != KindGoodbye || m.ByeCode != GoodbyeRestarting || m.Reason != "restarting" {
		t.Fatalf("recv: %+v, %v; want a goodbye with code restarting", m, err)
	}
}

// A producer without a session sends the hello-ack of before, which a
// consumer reads as an unknown session (0).
func TestNoSession(t *testing.T) {
	prod, cons := pair(t, testConfig(RoleProducer, io.Discard), testConfig(RoleConsumer, io.Discard))
	if got := cons.Peer().Session; got != 0 {
		t.Fatalf("session %#x, want 0", got)
	}
	ctx := testCtx(t)
	if err := prod.SendGoodbye(ctx, "done"); err != nil {
		t.Fatal(err)
	}
	var m Message
	m.ByeCode = GoodbyeRestarting // a plain goodbye must reset it
	if err := cons.Recv(ctx, &m); err != nil || m.Kind != KindGoodbye || m.ByeCode != GoodbyeDone {
		t.Fatalf("recv: %+v, %v; want a plain goodbye", m, err)
	}
}
