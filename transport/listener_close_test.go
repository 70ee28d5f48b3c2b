//go:build linux

package transport

import (
	"errors"
	"os"
	"testing"
)

// TestListenerCloseMidHandshake: a listener that closes while a dialer
// is in its handshake (a producer that shuts down, or restarts) leaves
// the dialer disconnected, as a producer that is gone does, and tells it
// of no error of its own (it sent "context canceled" as an internal
// error, which a consumer with a reconnect policy cannot tell from a
// refusal).
func TestListenerCloseMidHandshake(t *testing.T) {
	l := listen(t, testConfig(RoleProducer, nil))
	raw := rawDial(t, l.Addr())
	raw.write([]byte{0, 0, 0, 40}) // a hello's header, and no hello yet
	// A handshake after it completes: the listener accepted the raw
	// connection before this one, and its handshake has begun.
	c, err := Dial(testCtx(t), l.Addr(), testConfig(RoleConsumer, nil))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	l.Close()
	m, err := raw.recv()
	if err == nil {
		t.Fatalf("a listener closing mid-handshake sent %v, want the connection closed with nothing said", m)
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatal(err)
	}
}

// TestSnapshotRequestBeforeHello: a snapshot-request in place of the
// hello is refused (the handshake decoder does not know kind 16: unknown message), and never answered with a snapshot.
func TestSnapshotRequestBeforeHello(t *testing.T) {
	l := listen(t, testConfig(RoleProducer, nil))
	l.ServeObservers(func() []byte { return []byte{0x80} })
	raw := rawDial(t, l.Addr())
	raw.sendMsg(KindSnapshotRequest)
	raw.expectError(codeUnknownMessage)
}
