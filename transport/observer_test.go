//go:build linux

package transport

import (
	"bytes"
	"errors"
	"io"
	"testing"
)

// TestObserverRoles: an observer gets snapshots from a producer that
// serves them; it is refused by a producer that serves none (not
// supported) and by a consumer listening (handshake), and a listener
// never hands it to Accept.
func TestObserverRoles(t *testing.T) {
	ctx := testCtx(t)
	l := listen(t, testConfig(RoleProducer, io.Discard))
	if _, err := DialObserver(ctx, l.Addr(), DefaultConfig(RoleObserver)); !errors.Is(err, ErrNotSupported) {
		t.Fatalf("observer of a producer serving no snapshots: %v, want ErrNotSupported", err)
	}
	want := []byte{0x81, 0xa1, 'k', 1} // {"k": 1}
	l.ServeObservers(func() []byte { return want })
	o, err := DialObserver(ctx, l.Addr(), DefaultConfig(RoleObserver))
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	for range 2 {
		got, err := o.Snapshot(ctx)
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("snapshot %x, %v; want %x", got, err, want)
		}
	}
	select {
	case c := <-l.conns:
		t.Errorf("the observer was handed to Accept: %v", c.Peer())
	default:
	}

	lc := listen(t, testConfig(RoleConsumer, io.Discard))
	if _, err := DialObserver(ctx, lc.Addr(), DefaultConfig(RoleObserver)); !errors.Is(err, ErrHandshake) {
		t.Fatalf("observer of a consumer: %v, want ErrHandshake", err)
	}
}
