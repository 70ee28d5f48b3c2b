package transport

import (
	"testing"
)

// TestHelloCredits: the window a consumer's hello opens is bounded as every
// window is, with the same error (PROTOCOL.md 2.2: credit, code 7, not
// malformed); 0 is a valid window that a later credit opens; and a
// producer's credits are ignored (section 3), whatever they hold.
func TestHelloCredits(t *testing.T) {
	t.Run("past the limit", func(t *testing.T) {
		l := listen(t, testConfig(RoleProducer, nil))
		p := rawDial(t, l.Addr())
		p.sendMsg(KindHello, Version, RoleConsumer, 1, make([]byte, 16), []any{}, 0, MaxWindow+1)
		p.expectError(codeCredit)
	})
	t.Run("zero, then a credit", func(t *testing.T) {
		prod, p := rawConsumer(t, testConfig(RoleProducer, nil), 0)
		if n := prod.Credits(); n != 0 {
			t.Fatalf("producer's credits after a hello with 0: %d", n)
		}
		p.sendMsg(KindCredit, 1)
		var m Message
		if err := prod.Recv(testCtx(t), &m); err != nil || m.Kind != KindCredit {
			t.Fatalf("Recv: %v, %v; want the credit", err, m.Kind)
		}
		if n := prod.Credits(); n != 1 {
			t.Fatalf("producer's credits after a credit of 1: %d, want 1", n)
		}
	})
	t.Run("a producer's are ignored", func(t *testing.T) {
		cfg := testConfig(RoleConsumer, nil)
		l := listen(t, cfg)
		p := rawDial(t, l.Addr())
		p.sendMsg(KindHello, Version, RoleProducer, 1, make([]byte, 16), []any{}, 0, MaxWindow+1)
		ack, err := p.recv()
		if err != nil || ack[0] != uint64(KindHelloAck) {
			t.Fatalf("answer to a producer's hello with %d credits: %v, %v; want a hello-ack", MaxWindow+1, ack, err)
		}
		c, err := l.Accept(testCtx(t))
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
	})
}
