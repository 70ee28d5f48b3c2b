//go:build linux

package transport

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"
)

// TestNewErrorCodes proves the timeout and limit codes map both ways: a
// local failure is sent with its code, and a received one matches the
// sentinel.
func TestNewErrorCodes(t *testing.T) {
	for code, sentinel := range map[uint32]error{codeTimeout: ErrTimeout, codeLimit: ErrLimit} {
		if got := codeOf(fmt.Errorf("wrapped: %w", sentinel)); got != code {
			t.Errorf("codeOf(%v) = %d, want %d", sentinel, got, code)
		}
		e := &RemoteError{Code: code, Message: "m", Peer: "p"}
		if !errors.Is(e, sentinel) || !errors.Is(e, ErrRemote) || errors.Is(e, ErrMalformed) {
			t.Errorf("RemoteError with code %d does not match %v alone", code, sentinel)
		}
	}
}

// TestCloseWithError proves CloseWithError sends the peer one error
// message with the code of err's sentinel and err's text, ends a Recv
// blocked in another goroutine, and leaves Close and itself callable.
func TestCloseWithError(t *testing.T) {
	checkNoFDLeak(t)
	cases := []struct {
		err  error
		code uint32
	}{
		{fmt.Errorf("%w: lease 7 held past the lease deadline of 2s", ErrTimeout), codeTimeout},
		{fmt.Errorf("%w: 9 consumers, limit 8", ErrLimit), codeLimit},
		{errors.New("shutting down the device"), codeInternal},
	}
	for _, tc := range cases {
		prod, cons := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
		ctx := testCtx(t)
		var wg sync.WaitGroup
		wg.Add(1)
		var recvErr error
		go func() {
			defer wg.Done()
			var m Message
			recvErr = prod.Recv(ctx, &m) // blocked: the consumer sends nothing
		}()
		if err := prod.CloseWithError(tc.err); err != nil {
			t.Fatalf("CloseWithError: %v", err)
		}
		wg.Wait()
		if recvErr != tc.err && !errors.Is(recvErr, ErrClosed) {
			t.Errorf("Recv blocked during CloseWithError(%v): %v, want that error or ErrClosed", tc.err, recvErr)
		}
		prod.CloseWithError(errors.New("again"))
		prod.Close()
		if err := prod.SendRetire(ctx, 1); err == nil {
			t.Errorf("send after CloseWithError succeeded")
		}
		var m Message
		err := cons.Recv(ctx, &m)
		var remote *RemoteError
		if !errors.As(err, &remote) || remote.Code != tc.code || remote.Message != tc.err.Error() {
			t.Fatalf("peer of CloseWithError(%v): %v, want a RemoteError with code %d and its text", tc.err, err, tc.code)
		}
		if err := cons.Recv(ctx, &m); !errors.As(err, &remote) {
			t.Fatalf("Recv after the error message: %v, want the same error", err)
		}
	}
}

// TestRefusalSides proves that a dialer can tell the listener refusing it
// (a RemoteError) from itself refusing the listener (not one), though both
// match ErrPeerRefused.
func TestRefusalSides(t *testing.T) {
	cfg := testConfig(RoleProducer, nil)
	cfg.AllowedUIDs = []uint32{uint32(os.Getuid()) + 4242}
	l := listen(t, cfg)
	var remote *RemoteError
	_, err := Dial(testCtx(t), l.Addr(), testConfig(RoleConsumer, nil))
	if !errors.Is(err, ErrPeerRefused) || !errors.As(err, &remote) || remote.Code != codePeerRefused {
		t.Fatalf("Dial refused by the listener: %v, want a RemoteError matching ErrPeerRefused", err)
	}
	l2 := listen(t, testConfig(RoleProducer, nil))
	ccfg := testConfig(RoleConsumer, nil)
	ccfg.AllowedUIDs = []uint32{uint32(os.Getuid()) + 4242}
	_, err = Dial(testCtx(t), l2.Addr(), ccfg)
	if !errors.Is(err, ErrPeerRefused) || errors.As(err, &remote) || errors.Is(err, ErrRemote) {
		t.Fatalf("Dial refusing the listener: %v, want ErrPeerRefused and no RemoteError", err)
	}
}

// TestRemoteErrorBeatsFailedWrite: a consumer whose producer dropped it
// with an error, and whose own write then failed because the producer had
// closed, learns from Recv what the producer said, not "broken pipe". (A
// consumer stopped and resumed past a lease deadline meets exactly this.)
func TestRemoteErrorBeatsFailedWrite(t *testing.T) {
	checkNoFDLeak(t)
	prod, cons := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	ctx := testCtx(t)
	o := testOffer()
	if err := prod.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	var m Message
	if err := cons.Recv(ctx, &m); err != nil {
		t.Fatal(err)
	}
	why := fmt.Errorf("%w: it held a lease past the lease timeout", ErrTimeout)
	prod.CloseWithError(why)
	// The release fails: the producer is gone.
	if err := cons.SendRelease(ctx, m.Offer.Seq); err == nil {
		cons.Flush(ctx)
	}
	err := cons.Recv(ctx, &m)
	if !errors.Is(err, ErrTimeout) || !errors.Is(err, ErrRemote) {
		t.Fatalf("Recv after a failed write to a producer that dropped us: %v, want its error message", err)
	}
}

// TestRemoteErrorIsTheCause: whatever failed on this side just before
// (here a write into the connection the peer closed), an error message the
// peer sent is what Recv reports. A resumed consumer's release write and
// its read of the producer's reason race exactly so.
func TestRemoteErrorIsTheCause(t *testing.T) {
	checkNoFDLeak(t)
	_, cons := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	cons.setFailure(fmt.Errorf("transport: send to producer: %w: broken pipe", ErrDisconnected))
	cons.rmu.Lock()
	err := cons.recvFailed(&RemoteError{Code: codeTimeout, Message: "held a lease past the lease timeout"})
	cons.rmu.Unlock()
	if !errors.Is(err, ErrTimeout) || !errors.Is(err, ErrRemote) {
		t.Fatalf("Recv's error after a failed write and the peer's reason: %v, want the reason", err)
	}
	var m Message
	if err := cons.Recv(testCtx(t), &m); !errors.Is(err, ErrTimeout) {
		t.Fatalf("the next Recv: %v, want the same reason", err)
	}
}

// TestErrorWaitsForWriteUnderWay: a connection failed for a protocol error
// while a write is under way (an offer leaving as the peer's bad release
// arrives) still tells the peer why, once the write is done; it used to
// close without a word, and the peer read a bare end of stream.
func TestErrorWaitsForWriteUnderWay(t *testing.T) {
	checkNoFDLeak(t)
	prod, cons := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	prod.mu.Lock()
	prod.writing = true // as a sender in the middle of its write
	prod.mu.Unlock()
	done := make(chan struct{})
	go func() {
		defer close(done)
		prod.CloseWithError(fmt.Errorf("%w: release of an offer it does not hold", ErrUnexpectedMessage))
	}()
	time.Sleep(20 * time.Millisecond) // ordering only: let CloseWithError find the write under way
	prod.mu.Lock()
	prod.writing = false
	prod.wakeLocked()
	prod.mu.Unlock()
	<-done
	var m Message
	var remote *RemoteError
	if err := cons.Recv(testCtx(t), &m); !errors.As(err, &remote) || remote.Code != codeUnexpected {
		t.Fatalf("peer of a connection failed during a write: %v, want the error message (code %d)", err, codeUnexpected)
	}
}
