//go:build linux

package transport

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

// TestReceiveBufferGrows proves a connection's receive buffer starts small
// and grows when a frame needs it.
func TestReceiveBufferGrows(t *testing.T) {
	cons, p := rawProducer(t, testConfig(RoleConsumer, nil), 64)
	if n := len(cons.rbuf); n > 4096 {
		t.Fatalf("receive buffer of a new connection: %d bytes, want at most 4096", n)
	}
	big := make([]byte, 60000)
	big[len(big)-1] = 7
	p.sendMsg(KindRetire, 99, big) // an extra element, ignored
	var m Message
	if err := cons.Recv(testCtx(t), &m); err != nil || m.Kind != KindRetire || m.AllocID != 99 {
		t.Fatalf("large frame: %v %d, %v", m.Kind, m.AllocID, err)
	}
	p.sendMsg(KindRetire, 100)
	if err := cons.Recv(testCtx(t), &m); err != nil || m.Kind != KindRetire || m.AllocID != 100 {
		t.Fatalf("after the large frame: %v %d, %v", m.Kind, m.AllocID, err)
	}
}

// TestFrameTimeout proves a peer that holds half a frame past
// FrameTimeout fails the connection with ErrTimeout and is told, that a
// frame completed in time is received, and that an idle connection with
// nothing buffered never times out.
func TestFrameTimeout(t *testing.T) {
	ccfg := testConfig(RoleConsumer, nil)
	ccfg.FrameTimeout = 200 * time.Millisecond
	cons, p := rawProducer(t, ccfg, 64)
	var m Message

	// Idle for several times FrameTimeout: only the context ends Recv.
	ctx, cancel := context.WithTimeout(context.Background(), 4*ccfg.FrameTimeout)
	err := cons.Recv(ctx, &m)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Recv on an idle connection: %v, want context.DeadlineExceeded", err)
	}

	// A frame in two pieces, the second well within the timeout of Recv
	// starting to wait for it.
	f := frame(mustMarshal([]any{KindRetire, 5}))
	p.write(f[:3])
	ctx, cancel = context.WithTimeout(context.Background(), ccfg.FrameTimeout/4)
	err = cons.Recv(ctx, &m)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Recv on the first piece of a frame: %v, want context.DeadlineExceeded", err)
	}
	p.write(f[3:])
	if err := cons.Recv(testCtx(t), &m); err != nil || m.Kind != KindRetire || m.AllocID != 5 {
		t.Fatalf("frame in two pieces: %v %d, %v", m.Kind, m.AllocID, err)
	}

	// Half a frame, held: a Recv whose context ends first leaves the
	// connection be; the next one fails with ErrTimeout.
	p.write(frame(mustMarshal([]any{KindRetire, 6, strings.Repeat("x", 100)}))[:20])
	ctx, cancel = context.WithTimeout(context.Background(), ccfg.FrameTimeout/4)
	err = cons.Recv(ctx, &m)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Recv with a short context on half a frame: %v, want context.DeadlineExceeded", err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second) // a watchdog
	defer cancel()
	err = cons.Recv(ctx, &m)
	var remote *RemoteError
	if !errors.Is(err, ErrTimeout) || errors.As(err, &remote) {
		t.Fatalf("Recv on half a frame held past FrameTimeout: %v, want ErrTimeout", err)
	}
	p.expectError(codeTimeout)
}
