//go:build linux

package transport

import (
	"context"
	"errors"
	"io"
	"os"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/internal/testutil"
)

// TestExchange proves every message reaches the peer intact and in order,
// and that a graceful shutdown delivers everything before the goodbye.
func TestExchange(t *testing.T) {
	checkNoFDLeak(t)
	pcfg := testConfig(RoleProducer, nil)
	pcfg.Devices = []UUID{{1, 2, 3}}
	ccfg := testConfig(RoleConsumer, nil)
	ccfg.Devices = []UUID{{9}, {8}}
	ccfg.Credits = 4
	prod, cons := pair(t, pcfg, ccfg)
	ctx := testCtx(t)
	shm := !pcfg.DisableShm // the producer advertises it and the consumer uses it, unless in socket mode

	if p := prod.Peer(); p.Role != RoleConsumer || p.UID != uint32(os.Getuid()) || p.PID != int32(os.Getpid()) ||
		!reflect.DeepEqual(p.Devices, ccfg.Devices) {
		t.Errorf("producer sees %+v", p)
	}
	if p := cons.Peer(); p.Role != RoleProducer || !reflect.DeepEqual(p.Devices, pcfg.Devices) || (p.Caps != CapShm) == shm || cons.Shm() != shm || prod.Shm() != shm {
		t.Errorf("consumer sees %+v", p)
	}

	o := testOffer()
	if err := prod.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	if err := prod.SendRetire(ctx, o.AllocID); err != nil {
		t.Fatal(err)
	}
	var m Message
	if err := cons.Recv(ctx, &m); err != nil || m.Kind != KindOffer {
		t.Fatalf("recv: %v %v", m.Kind, err)
	}
	if !reflect.DeepEqual(m.Offer, o) {
		t.Fatalf("offer changed in transit:\n got %+v\nwant %+v", m.Offer, o)
	}
	if err := cons.Recv(ctx, &m); err != nil || m.Kind != KindRetire || m.AllocID != o.AllocID {
		t.Fatalf("recv retire: %+v %v", m, err)
	}
	for _, send := range []func() error{
		func() error { return cons.SendRelease(ctx, o.Seq) },
		func() error { return cons.SendClosed(ctx, o.AllocID) },
		func() error { return cons.SendCredit(ctx, 5) },
	} {
		if err := send(); err != nil {
			t.Fatal(err)
		}
	}
	want := []Message{
		{Kind: KindRelease, Seqs: []uint64{o.Seq}},
		{Kind: KindClosed, AllocID: o.AllocID},
		{Kind: KindCredit, Credits: 5},
	}
	for _, w := range want {
		var m Message
		if err := prod.Recv(ctx, &m); err != nil || !reflect.DeepEqual(m, w) {
			t.Fatalf("producer got %+v, %v; want %+v", m, err, w)
		}
	}
	// Everything sent before the goodbye arrives before it.
	if err := prod.SendRetire(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if err := prod.Shutdown(ctx, "done"); err != nil {
		t.Fatal(err)
	}
	if err := prod.SendRetire(ctx, 2); !errors.Is(err, ErrClosed) {
		t.Fatalf("send after shutdown: %v, want ErrClosed", err)
	}
	if err := cons.Recv(ctx, &m); err != nil || m.Kind != KindRetire {
		t.Fatalf("recv: %+v %v", m, err)
	}
	if err := cons.Recv(ctx, &m); err != nil || m.Kind != KindGoodbye || m.Reason != "done" {
		t.Fatalf("recv goodbye: %+v %v", m, err)
	}
	if err := cons.Recv(ctx, &m); err != io.EOF {
		t.Fatalf("recv after goodbye: %v, want io.EOF", err)
	}
}

// TestCredits proves a producer holds no more offers outstanding than the
// consumer granted, and resumes on a release or a credit.
func TestCredits(t *testing.T) {
	ccfg := testConfig(RoleConsumer, nil)
	ccfg.Credits = 2
	prod, cons := pair(t, testConfig(RoleProducer, nil), ccfg)
	ctx := testCtx(t)
	o := testOffer()
	for i := range 2 {
		o.Seq = uint64(i)
		if err := prod.SendOffer(ctx, &o); err != nil {
			t.Fatal(err)
		}
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if err := prod.SendOffer(short, &o); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("third offer with two credits: %v, want to wait until the deadline", err)
	}
	var m Message
	for range 2 {
		if err := cons.Recv(ctx, &m); err != nil {
			t.Fatal(err)
		}
	}
	// A consumer cannot release what it does not hold.
	if err := cons.SendRelease(ctx, 1, 2, 3); !errors.Is(err, ErrCredit) {
		t.Fatalf("releasing three of two: %v, want ErrCredit", err)
	}
	// The producer sees the release and its third offer goes through.
	done := make(chan error, 1)
	go func() {
		var m Message
		done <- prod.Recv(ctx, &m)
	}()
	if err := cons.SendRelease(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	o.Seq = 2
	if err := prod.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	// And a credit widens the window.
	go func() {
		var m Message
		done <- prod.Recv(ctx, &m)
	}()
	if err := cons.SendCredit(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	o.Seq = 3
	if err := prod.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
}

// TestWrongRoleSends proves a side cannot send the other role's messages.
func TestWrongRoleSends(t *testing.T) {
	prod, cons := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	ctx := testCtx(t)
	o := testOffer()
	for name, err := range map[string]error{
		"consumer offer":   cons.SendOffer(ctx, &o),
		"consumer retire":  cons.SendRetire(ctx, 1),
		"producer release": prod.SendRelease(ctx, 1),
		"producer closed":  prod.SendClosed(ctx, 1),
		"producer credit":  prod.SendCredit(ctx, 1),
	} {
		if !errors.Is(err, ErrUnexpectedMessage) {
			t.Errorf("%s: %v, want ErrUnexpectedMessage", name, err)
		}
	}
	bad := testOffer()
	bad.Offset = bad.AllocSize
	if err := prod.SendOffer(ctx, &bad); !errors.Is(err, ErrMalformed) {
		t.Errorf("offer outside its allocation: %v, want ErrMalformed", err)
	}
	bad = testOffer()
	bad.Meta = []byte{0x92, 0x01}
	if err := prod.SendOffer(ctx, &bad); !errors.Is(err, ErrMalformed) {
		t.Errorf("offer with truncated meta: %v, want ErrMalformed", err)
	}
}

// TestFDPassing sends a memfd with an offer and reads through the
// received descriptor.
func TestFDPassing(t *testing.T) {
	checkNoFDLeak(t)
	ccfg := testConfig(RoleConsumer, nil)
	ccfg.AcceptVMM = true
	prod, cons := pair(t, testConfig(RoleProducer, nil), ccfg)
	ctx := testCtx(t)
	if prod.Peer().Caps&CapVMM == 0 {
		t.Fatal("consumer did not advertise CapVMM")
	}
	const text = "device memory, exported"
	mfd, err := unix.MemfdCreate("cudashare-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := unix.Write(mfd, []byte(text)); err != nil {
		t.Fatal(err)
	}
	o := testOffer()
	o.FDs = []int{mfd}
	// Offers before and after the one with a descriptor keep theirs apart.
	plain := testOffer()
	plain.Seq = 100
	if err := prod.SendOffer(ctx, &plain); err != nil {
		t.Fatal(err)
	}
	if err := prod.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	plain.Seq = 101
	if err := prod.SendOffer(ctx, &plain); err != nil {
		t.Fatal(err)
	}
	unix.Close(mfd) // SendOffer duplicated it

	var m Message
	if err := cons.Recv(ctx, &m); err != nil || len(m.Offer.FDs) != 0 {
		t.Fatalf("first offer: fds %v err %v", m.Offer.FDs, err)
	}
	if err := cons.Recv(ctx, &m); err != nil || len(m.Offer.FDs) != 1 {
		t.Fatalf("second offer: fds %v err %v", m.Offer.FDs, err)
	}
	got := make([]byte, 64)
	n, err := unix.Pread(m.Offer.FDs[0], got, 0)
	unix.Close(m.Offer.FDs[0])
	if err != nil || string(got[:n]) != text {
		t.Fatalf("read through the received descriptor: %q, %v", got[:n], err)
	}
	if err := cons.Recv(ctx, &m); err != nil || len(m.Offer.FDs) != 0 || m.Offer.Seq != 101 {
		t.Fatalf("third offer: seq %d fds %v err %v", m.Offer.Seq, m.Offer.FDs, err)
	}
}

func TestFDsNeedCapability(t *testing.T) {
	prod, _ := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	o := testOffer()
	o.FDs = []int{0}
	if err := prod.SendOffer(testCtx(t), &o); !errors.Is(err, ErrNotSupported) {
		t.Fatalf("descriptors to a consumer without CapVMM: %v, want ErrNotSupported", err)
	}
}

// rawProducer returns a consumer Conn whose peer is a raw producer.
func rawProducer(t *testing.T, ccfg Config, credits uint64) (*Conn, *rawPeer) {
	t.Helper()
	l := listen(t, ccfg)
	p := rawDial(t, l.Addr())
	ack := p.hello(RoleProducer, 0, 0)
	if ack[7] != credits {
		t.Fatalf("hello-ack credits %v, want %d", ack[7], credits)
	}
	c, err := l.Accept(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, p
}

// rawConsumer returns a producer Conn whose peer is a raw consumer.
func rawConsumer(t *testing.T, pcfg Config, credits uint64) (*Conn, *rawPeer) {
	t.Helper()
	l := listen(t, pcfg)
	p := rawDial(t, l.Addr())
	p.hello(RoleConsumer, credits, 0)
	c, err := l.Accept(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c, p
}

func offerElems(seq uint64, nfds int) []any {
	return []any{KindOffer, seq, 1, 0, make([]byte, 64), 100, 0, 100, make([]byte, 16), nil, nil, nfds}
}

// TestDescriptorAbuse proves descriptors a consumer did not ask for, or
// that no message claims, fail the connection and are closed.
func TestDescriptorAbuse(t *testing.T) {
	// The sender's own copies, closed before the leak check looks.
	var mine []int
	mfd := func() int {
		fd, err := unix.MemfdCreate("abuse", unix.MFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		mine = append(mine, fd)
		return fd
	}
	cases := []struct {
		name      string
		acceptFDs bool
		send      func(p *rawPeer)
		want      error
	}{
		{"not advertised", false, func(p *rawPeer) {
			p.sendFDs(mustMarshal(offerElems(1, 1)), mfd())
		}, ErrUnexpectedMessage},
		{"declared to a side without fds, none sent", false, func(p *rawPeer) {
			p.sendMsg(offerElems(1, 1)...)
		}, ErrUnexpectedMessage},
		{"not claimed", true, func(p *rawPeer) {
			p.sendFDs(mustMarshal([]any{KindRetire, 1}), mfd(), mfd())
		}, ErrMalformed},
		{"declared but missing", true, func(p *rawPeer) {
			p.sendMsg(offerElems(1, 2)...)
		}, ErrMalformed},
		{"declared fewer than sent", true, func(p *rawPeer) {
			p.sendFDs(mustMarshal(offerElems(1, 1)), mfd(), mfd())
		}, ErrMalformed},
		{"more than fit", true, func(p *rawPeer) {
			fd := mfd()
			p.sendFDs(mustMarshal(offerElems(1, 4)), fd, fd, fd, fd, fd, fd)
		}, ErrMalformed},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			checkNoFDLeak(t)
			cfg := testConfig(RoleConsumer, nil)
			cfg.AcceptVMM = tc.acceptFDs
			c, p := rawProducer(t, cfg, 64)
			tc.send(p)
			closeFDs(mine)
			mine = nil
			var m Message
			var err error
			for err == nil {
				err = c.Recv(testCtx(t), &m)
				for _, fd := range m.Offer.FDs {
					unix.Close(fd) // a claimed one is ours to close
				}
				m.Offer.FDs = nil
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("Recv: %v, want %v", err, tc.want)
			}
			c.Close()
		})
	}
}

// TestHostileInput sends each bad input to a Conn after the handshake and
// checks the error Recv returns and the code the peer is sent.
func TestHostileInput(t *testing.T) {
	cases := []struct {
		name string
		role Role // of the Conn under test
		send func(p *rawPeer)
		want error
		code uint64 // of the error message back, or 0 for none
	}{
		{"length past the cap", RoleConsumer, func(p *rawPeer) {
			p.write([]byte{0xff, 0xff, 0xff, 0xff, 0x93})
		}, ErrFrameTooLarge, codeFrameTooLarge},
		{"length just past the cap", RoleConsumer, func(p *rawPeer) {
			p.write([]byte{0x00, 0x01, 0x00, 0x01})
		}, ErrFrameTooLarge, codeFrameTooLarge},
		{"empty frame", RoleConsumer, func(p *rawPeer) {
			p.write([]byte{0, 0, 0, 0})
		}, ErrMalformed, codeMalformed},
		{"garbage", RoleConsumer, func(p *rawPeer) {
			p.send([]byte("GET / HTTP/1.1\r\n\r\n"))
		}, ErrMalformed, codeMalformed},
		{"deep nesting", RoleConsumer, func(p *rawPeer) {
			p.send(append([]byte{0x93, 0x05, 0x01}, strings.Repeat("\x91", 10000)+"\xc0"...))
		}, ErrMalformed, codeMalformed},
		{"huge array in a small frame", RoleConsumer, func(p *rawPeer) {
			p.send([]byte{0x93, 0x05, 0x01, 0xdd, 0x7f, 0xff, 0xff, 0xff})
		}, ErrMalformed, codeMalformed},
		{"huge map in a small frame", RoleConsumer, func(p *rawPeer) {
			p.send([]byte{0x93, 0x05, 0x01, 0xdf, 0x7f, 0xff, 0xff, 0xff})
		}, ErrMalformed, codeMalformed},
		{"huge release in a small frame", RoleProducer, func(p *rawPeer) {
			p.send([]byte{0x92, 0x04, 0xdd, 0x7f, 0xff, 0xff, 0xff, 0x01})
		}, ErrMalformed, codeMalformed},
		{"unknown kind", RoleConsumer, func(p *rawPeer) {
			p.sendMsg(42, "what")
		}, ErrUnknownMessage, codeUnknownMessage},
		{"hello again", RoleConsumer, func(p *rawPeer) {
			p.sendMsg(KindHello, Version, RoleProducer, 1, make([]byte, 16), []any{}, 0, 0)
		}, ErrUnexpectedMessage, codeUnexpected},
		{"offer to a producer", RoleProducer, func(p *rawPeer) {
			p.sendMsg(offerElems(1, 0)...)
		}, ErrUnexpectedMessage, codeUnexpected},
		{"release to a consumer", RoleConsumer, func(p *rawPeer) {
			p.sendMsg(KindRelease, []any{1})
		}, ErrUnexpectedMessage, codeUnexpected},
		{"message after goodbye", RoleConsumer, func(p *rawPeer) {
			p.sendMsg(KindGoodbye, "bye")
			p.sendMsg(KindRetire, 1)
		}, ErrUnexpectedMessage, codeUnexpected},
		{"offers past the credits", RoleConsumer, func(p *rawPeer) {
			for i := range 3 {
				p.sendMsg(offerElems(uint64(i), 0)...)
			}
		}, ErrCredit, codeCredit},
		{"release of what is not outstanding", RoleProducer, func(p *rawPeer) {
			p.sendMsg(KindRelease, []any{1})
		}, ErrCredit, codeCredit},
		{"credit past the limit", RoleProducer, func(p *rawPeer) {
			p.sendMsg(KindCredit, MaxWindow)
		}, ErrCredit, codeCredit},
		{"one credit message past the limit", RoleProducer, func(p *rawPeer) {
			p.sendMsg(KindCredit, MaxWindow+1) // a window past the limit, as above: PROTOCOL.md 2.2
		}, ErrCredit, codeCredit},
		{"credit of 0", RoleProducer, func(p *rawPeer) {
			p.sendMsg(KindCredit, 0) // [7, n] with 1 <= n: a field out of its range
		}, ErrMalformed, codeMalformed},
		{"truncated frame", RoleConsumer, func(p *rawPeer) {
			p.write(frame(mustMarshal(offerElems(1, 0)))[:20])
			p.c.Close()
		}, io.ErrUnexpectedEOF, 0},
		{"peer vanishes", RoleConsumer, func(p *rawPeer) {
			p.c.Close()
		}, ErrDisconnected, 0},
		{"error from the peer", RoleConsumer, func(p *rawPeer) {
			p.sendMsg(KindError, codeVersion, "too old")
		}, ErrVersion, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var c *Conn
			var p *rawPeer
			if tc.role == RoleConsumer {
				cfg := testConfig(RoleConsumer, nil)
				cfg.Credits = 2
				c, p = rawProducer(t, cfg, 2)
			} else {
				c, p = rawConsumer(t, testConfig(RoleProducer, nil), 2)
			}
			tc.send(p)
			var before, after runtimeMem
			before.read()
			var m Message
			var err error
			for err == nil {
				err = c.Recv(testCtx(t), &m)
			}
			after.read()
			if !errors.Is(err, tc.want) {
				t.Fatalf("Recv: %v, want %v", err, tc.want)
			}
			if !strings.Contains(err.Error(), "pid ") {
				t.Errorf("error does not name the peer: %v", err)
			}
			if n := after.bytes - before.bytes; n > 1<<20 {
				t.Errorf("receiving the bad input allocated %d bytes", n)
			}
			if err2 := c.Recv(testCtx(t), &m); err2 != err {
				t.Errorf("Recv after failure: %v, want the same error", err2)
			}
			if tc.code != 0 {
				p.expectError(tc.code)
			}
		})
	}
}

// TestRemoteErrorMatches proves an error message matches ErrRemote and
// the sentinel of its code.
func TestRemoteErrorMatches(t *testing.T) {
	e := &RemoteError{Code: codePeerRefused, Message: "no", Peer: "x"}
	if !errors.Is(e, ErrRemote) || !errors.Is(e, ErrPeerRefused) || errors.Is(e, ErrVersion) {
		t.Fatal("RemoteError matches the wrong sentinels")
	}
	if e := (&RemoteError{Code: 1000}); !errors.Is(e, ErrRemote) || errors.Is(e, ErrMalformed) {
		t.Fatal("unknown code")
	}
}

// TestHandshakeFailures sends bad handshakes to a listener: each peer gets
// the right error code, the failure is logged, and Accept returns only the
// good connection that follows.
func TestHandshakeFailures(t *testing.T) {
	var log testutil.SyncBuffer
	cfg := testConfig(RoleProducer, &log)
	cfg.HandshakeTimeout = 200 * time.Millisecond
	l := listen(t, cfg)
	cases := []struct {
		name string
		send func(p *rawPeer)
		code uint64
	}{
		{"offer before hello", func(p *rawPeer) { p.sendMsg(offerElems(1, 0)...) }, codeUnexpected},
		{"other version", func(p *rawPeer) { p.sendMsg(KindHello, 2, "a layout of the future") }, codeVersion},
		{"same role", func(p *rawPeer) {
			p.sendMsg(KindHello, Version, RoleProducer, 1, make([]byte, 16), []any{}, 0, 0)
		}, codeHandshake},
		{"garbage", func(p *rawPeer) { p.send([]byte{0xc1}) }, codeMalformed},
		{"length past the cap", func(p *rawPeer) { p.write([]byte{0x7f, 0, 0, 0}) }, codeFrameTooLarge},
	}
	for _, tc := range cases {
		p := rawDial(t, l.Addr())
		tc.send(p)
		p.expectError(tc.code)
	}
	// A silent peer is dropped after the handshake timeout and holds up no
	// one meanwhile.
	silent := rawDial(t, l.Addr())
	ctx := testCtx(t)
	c, err := Dial(ctx, l.Addr(), testConfig(RoleConsumer, nil))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	a, err := l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if a.Peer().PID != int32(os.Getpid()) || a.Peer().Role != RoleConsumer {
		t.Fatalf("accepted %v", a.Peer())
	}
	silent.expectError(codeHandshake)
	for _, want := range []string{"version 2", "both sides are producers", "handshake failed", "no answer within"} {
		waitLog(t, &log, want)
	}
}

// TestDialHandshakeFailures runs Dial against a raw listener.
func TestDialHandshakeFailures(t *testing.T) {
	cases := []struct {
		name   string
		answer func(p *rawPeer)
		want   error
	}{
		{"version error", func(p *rawPeer) { p.sendMsg(KindError, codeVersion, "version 2 only") }, ErrVersion},
		{"hello-ack of another version", func(p *rawPeer) { p.sendMsg(KindHelloAck, 7) }, ErrVersion},
		{"same role", func(p *rawPeer) {
			p.sendMsg(KindHelloAck, Version, RoleConsumer, 1, make([]byte, 16), []any{}, 0, 8)
		}, ErrHandshake},
		{"offer instead", func(p *rawPeer) { p.sendMsg(offerElems(1, 0)...) }, ErrUnexpectedMessage},
		{"hang up", func(p *rawPeer) { p.c.Close() }, ErrDisconnected},
		{"silence", func(p *rawPeer) {}, ErrHandshake},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			checkNoFDLeak(t)
			path, ln, done := serveRaw(t, func(p *rawPeer) {
				if _, err := p.recv(); err != nil { // the hello
					return
				}
				tc.answer(p)
				time.Sleep(400 * time.Millisecond) // let the dialer give up first on silence
			})
			cfg := testConfig(RoleConsumer, nil)
			cfg.HandshakeTimeout = 200 * time.Millisecond
			c, err := Dial(testCtx(t), path, cfg)
			if err == nil {
				c.Close()
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("Dial: %v, want %v", err, tc.want)
			}
			ln.Close()
			<-done
		})
	}
}

// TestDialContext proves Dial gives up when its context ends.
func TestDialContext(t *testing.T) {
	path := socketDir(t) + "/sock"
	ln, err := listenRaw(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := Dial(ctx, path, testConfig(RoleConsumer, nil)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Dial to a silent listener: %v, want context.DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 1500*time.Millisecond {
		t.Fatalf("Dial took %v with a 100ms context", d)
	}
}

// TestRefusedInProcess proves a listener refuses a user it does not allow,
// logs it, and the dialer sees ErrPeerRefused. The cross-user version, as
// root, is TestCredentialsRefused.
func TestRefusedInProcess(t *testing.T) {
	var log testutil.SyncBuffer
	cfg := testConfig(RoleProducer, &log)
	cfg.AllowedUIDs = []uint32{uint32(os.Getuid()) + 4242}
	l := listen(t, cfg)
	_, err := Dial(testCtx(t), l.Addr(), testConfig(RoleConsumer, nil))
	if !errors.Is(err, ErrPeerRefused) || !errors.Is(err, ErrRemote) {
		t.Fatalf("Dial: %v, want ErrPeerRefused from the listener", err)
	}
	waitLog(t, &log, "refused peer")
	// And the other way: a dialer refuses a listener it does not allow.
	l2 := listen(t, testConfig(RoleProducer, nil))
	ccfg := testConfig(RoleConsumer, nil)
	ccfg.AllowedUIDs = []uint32{uint32(os.Getuid()) + 4242}
	if _, err := Dial(testCtx(t), l2.Addr(), ccfg); !errors.Is(err, ErrPeerRefused) {
		t.Fatalf("Dial to a disallowed listener: %v, want ErrPeerRefused", err)
	}
}

// TestWriteTimeout proves a peer that stops reading fails the sender with
// ErrWriteTimeout instead of hanging it.
func TestWriteTimeout(t *testing.T) {
	cfg := testConfig(RoleProducer, nil)
	cfg.WriteTimeout = 200 * time.Millisecond
	cfg.MaxQueued = MinFrameSize
	prod, _ := rawConsumer(t, cfg, MaxWindow) // and never reads
	o := testOffer()
	o.Meta = mustMarshal(strings.Repeat("x", 4000))
	ctx := testCtx(t)
	var err error
	for i := 0; err == nil; i++ {
		o.Seq = uint64(i)
		err = prod.SendOffer(ctx, &o)
	}
	if !errors.Is(err, ErrWriteTimeout) {
		t.Fatalf("SendOffer to a peer that does not read: %v, want ErrWriteTimeout", err)
	}
	if err := prod.Flush(ctx); !errors.Is(err, ErrWriteTimeout) {
		t.Fatalf("Flush after the failure: %v", err)
	}
}

// TestSendContext proves a send waiting for room gives up with its ctx.
func TestSendContext(t *testing.T) {
	cfg := testConfig(RoleProducer, nil)
	cfg.MaxQueued = MinFrameSize
	prod, _ := rawConsumer(t, cfg, MaxWindow) // and never reads
	o := testOffer()
	o.Meta = mustMarshal(strings.Repeat("x", 4000))
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	var err error
	for i := 0; err == nil; i++ {
		o.Seq = uint64(i)
		err = prod.SendOffer(ctx, &o)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("SendOffer: %v, want context.DeadlineExceeded", err)
	}
}

// TestRecvContext proves Recv returns when its context ends, whether the
// context was already registered or not, and that the connection goes on.
func TestRecvContext(t *testing.T) {
	prod, cons := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	var m Message
	for range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
		if err := cons.Recv(ctx, &m); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Recv with nothing to receive: %v", err)
		}
		cancel()
	}
	// One long-lived context, cancelled while Recv blocks.
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(30*time.Millisecond, cancel)
	if err := cons.Recv(ctx, &m); !errors.Is(err, context.Canceled) {
		t.Fatalf("Recv cancelled: %v", err)
	}
	if err := cons.Recv(ctx, &m); !errors.Is(err, context.Canceled) {
		t.Fatalf("Recv with a cancelled context: %v", err)
	}
	o := testOffer()
	if err := prod.SendOffer(testCtx(t), &o); err != nil {
		t.Fatal(err)
	}
	if err := cons.Recv(context.Background(), &m); err != nil || m.Kind != KindOffer {
		t.Fatalf("Recv after cancellations: %v %v", m.Kind, err)
	}
}

// TestRecvInterrupt: interrupt ends one wait of Recv, whether it waits
// already or not yet, with errInterrupted, and leaves the connection, and
// its context's watch, working.
func TestRecvInterrupt(t *testing.T) {
	prod, cons := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	var m Message
	short := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
		defer cancel()
		return cons.Recv(ctx, &m)
	}
	// While Recv waits, with a context that never ends and with one that
	// does: the watch of the second must survive the interrupt.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, c := range []context.Context{context.Background(), ctx, ctx} {
		time.AfterFunc(30*time.Millisecond, cons.interrupt)
		if err := cons.Recv(c, &m); !errors.Is(err, errInterrupted) {
			t.Fatalf("Recv interrupted: %v", err)
		}
	}
	time.AfterFunc(30*time.Millisecond, cancel)
	if err := cons.Recv(ctx, &m); !errors.Is(err, context.Canceled) {
		t.Fatalf("Recv whose context ends after an interrupt: %v", err)
	}
	// Before Recv waits: several interrupts end one wait, not more.
	cons.interrupt()
	cons.interrupt()
	if err := cons.Recv(context.Background(), &m); !errors.Is(err, errInterrupted) {
		t.Fatalf("Recv after Interrupt: %v", err)
	}
	if err := short(); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the second Recv after two interrupts: %v, want its own deadline", err)
	}
	// Nothing is lost: a message sent before an interrupt is received,
	// either at once (the interrupt then ends the next wait) or after
	// the interrupted wait.
	o := testOffer()
	if err := prod.SendOffer(testCtx(t), &o); err != nil {
		t.Fatal(err)
	}
	cons.interrupt()
	err := cons.Recv(context.Background(), &m)
	pending := err == nil
	if errors.Is(err, errInterrupted) {
		err = cons.Recv(context.Background(), &m)
	}
	if err != nil || m.Kind != KindOffer || m.Offer.Seq != o.Seq {
		t.Fatalf("after an interrupt: %v seq %d, %v; want offer %d", m.Kind, m.Offer.Seq, err, o.Seq)
	}
	if pending {
		if err := short(); !errors.Is(err, errInterrupted) {
			t.Fatalf("the first wait after an interrupt that no Recv took: %v", err)
		}
	}
	if err := short(); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Recv with nothing sent: %v", err)
	}
}

// TestTryRecv: tryRecv takes what has arrived and reports false, at
// once, when nothing has; the connection then receives as before.
func TestTryRecv(t *testing.T) {
	prod, cons := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	ctx := testCtx(t)
	var m Message
	if ok, err := cons.tryRecv(&m); ok || err != nil {
		t.Fatalf("tryRecv with nothing sent: %v %v", ok, err)
	}
	o := testOffer()
	for i := range 3 {
		o.Seq = uint64(i + 1)
		if err := prod.SendOffer(ctx, &o); err != nil {
			t.Fatal(err)
		}
	}
	if err := prod.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	// The first may need a Recv: flushed is written, not yet arrived.
	if err := cons.Recv(ctx, &m); err != nil || m.Offer.Seq != 1 {
		t.Fatalf("Recv: %v seq %d, %v", m.Kind, m.Offer.Seq, err)
	}
	for want := uint64(2); want <= 3; want++ {
		if ok, err := cons.tryRecv(&m); !ok || err != nil || m.Kind != KindOffer || m.Offer.Seq != want {
			t.Fatalf("tryRecv of what has arrived: %v %v, %v seq %d; want offer %d", ok, err, m.Kind, m.Offer.Seq, want)
		}
	}
	if ok, err := cons.tryRecv(&m); ok || err != nil {
		t.Fatalf("tryRecv with everything taken: %v %v", ok, err)
	}
	o.Seq = 4
	if err := prod.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	if err := cons.Recv(ctx, &m); err != nil || m.Offer.Seq != 4 {
		t.Fatalf("Recv after tryRecv: %v seq %d, %v", m.Kind, m.Offer.Seq, err)
	}
}

// TestClose proves Close is idempotent and unblocks every blocked call.
func TestClose(t *testing.T) {
	checkNoFDLeak(t)
	ccfg := testConfig(RoleConsumer, nil)
	ccfg.Credits = 1
	prod, cons := pair(t, testConfig(RoleProducer, nil), ccfg)
	ctx := testCtx(t)
	o := testOffer()
	if err := prod.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	wg.Add(2)
	go func() { // waits for a credit
		defer wg.Done()
		errs <- prod.SendOffer(ctx, &o)
	}()
	go func() { // waits for a message
		defer wg.Done()
		var m Message
		errs <- prod.Recv(ctx, &m)
	}()
	time.Sleep(50 * time.Millisecond)
	prod.Close()
	prod.Close()
	wg.Wait()
	close(errs)
	for err := range errs {
		if !errors.Is(err, ErrClosed) {
			t.Errorf("blocked call after Close: %v, want ErrClosed", err)
		}
	}
	if err := prod.SendRetire(ctx, 1); !errors.Is(err, ErrClosed) {
		t.Errorf("send after Close: %v", err)
	}
	var m Message
	if err := cons.Recv(ctx, &m); err != nil || m.Kind != KindOffer {
		t.Fatalf("consumer: %v %v", m.Kind, err)
	}
	if err := cons.Recv(ctx, &m); !errors.Is(err, ErrDisconnected) {
		t.Fatalf("consumer after the producer closed without goodbye: %v", err)
	}
}

func TestListenerClose(t *testing.T) {
	l := listen(t, testConfig(RoleProducer, nil))
	done := make(chan error)
	go func() {
		_, err := l.Accept(context.Background())
		done <- err
	}()
	time.Sleep(20 * time.Millisecond)
	l.Close()
	if err := <-done; !errors.Is(err, ErrClosed) {
		t.Fatalf("Accept after Close: %v", err)
	}
	l.Close()
	if _, err := os.Stat(l.Addr()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket file after Close: %v", err)
	}
}

// TestConcurrentSenders proves that several goroutines may send while one
// receives, and every message arrives once.
func TestConcurrentSenders(t *testing.T) {
	ccfg := testConfig(RoleConsumer, nil)
	ccfg.Credits = 64
	prod, cons := pair(t, testConfig(RoleProducer, nil), ccfg)
	ctx := testCtx(t)
	const senders, each = 4, 500
	var seq sync.Mutex
	next := uint64(0)
	go func() { // the consumer releases everything
		var m Message
		for cons.Recv(ctx, &m) == nil {
			if m.Kind == KindOffer {
				cons.SendRelease(ctx, m.Offer.Seq)
			}
		}
	}()
	released := make(chan int)
	go func() {
		var m Message
		n := 0
		for n < senders*each && prod.Recv(ctx, &m) == nil {
			n += len(m.Seqs)
		}
		released <- n
	}()
	var wg sync.WaitGroup
	for range senders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := testOffer()
			for range each {
				seq.Lock()
				o.Seq = next
				next++
				seq.Unlock()
				if err := prod.SendOffer(ctx, &o); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if n := <-released; n != senders*each {
		t.Fatalf("%d releases, want %d", n, senders*each)
	}
}

func TestConfigValidation(t *testing.T) {
	for name, cfg := range map[string]Config{
		"no role":          {},
		"frame too small":  {Role: RoleProducer, MaxFrameSize: 100},
		"frame too large":  {Role: RoleProducer, MaxFrameSize: MaxFrameSizeLimit + 1},
		"queue too small":  {Role: RoleProducer, MaxQueued: 10},
		"too many devices": {Role: RoleProducer, Devices: make([]UUID, MaxDevices+1)},
		"credits":          {Role: RoleConsumer, Credits: MaxWindow + 1},
		"negative timeout": {Role: RoleConsumer, WriteTimeout: -1},
	} {
		if _, err := Listen(context.Background(), socketDir(t)+"/sock", cfg); err == nil {
			t.Errorf("%s: Listen accepted the config", name)
		}
		if _, err := Dial(context.Background(), "/nonexistent", cfg); err == nil || strings.Contains(err.Error(), "nonexistent") {
			t.Errorf("%s: Dial did not check the config first: %v", name, err)
		}
	}
}

// TestShutdownWhilePeerWrites proves a goodbye is not lost when the peer
// writes after the sender closed: the peer's failed write does not stop it
// reading what arrived before, goodbye and clean end included.
func TestShutdownWhilePeerWrites(t *testing.T) {
	prod, cons := pair(t, testConfig(RoleProducer, nil), testConfig(RoleConsumer, nil))
	ctx := testCtx(t)
	o := testOffer()
	if err := prod.SendOffer(ctx, &o); err != nil {
		t.Fatal(err)
	}
	if err := prod.Shutdown(ctx, "leaving"); err != nil {
		t.Fatal(err)
	}
	// The consumer writes into the closed connection until it notices.
	var err error
	for err == nil {
		if err = cons.SendCredit(ctx, 1); err == nil {
			err = cons.Flush(ctx)
		}
	}
	if !errors.Is(err, ErrDisconnected) {
		t.Fatalf("writing to a closed peer: %v, want ErrDisconnected", err)
	}
	var m Message
	if err := cons.Recv(ctx, &m); err != nil || m.Kind != KindOffer {
		t.Fatalf("recv: %v %v, want the offer", m.Kind, err)
	}
	if err := cons.Recv(ctx, &m); err != nil || m.Kind != KindGoodbye || m.Reason != "leaving" {
		t.Fatalf("recv: %v %v, want the goodbye", m.Kind, err)
	}
	if err := cons.Recv(ctx, &m); err != io.EOF {
		t.Fatalf("recv after the goodbye: %v, want io.EOF", err)
	}
}

// TestSocketFullKeepsOrder fills the socket while the consumer is not
// reading, so that writes come up short and the rest is queued behind
// them, and proves every offer still arrives whole and in order.
func TestSocketFullKeepsOrder(t *testing.T) {
	ccfg := testConfig(RoleConsumer, nil)
	ccfg.Credits = 4096
	prod, cons := pair(t, testConfig(RoleProducer, nil), ccfg)
	ctx := testCtx(t)
	const n = 3000 // about 3 MB, well past the socket's buffer
	sent := make(chan error, 1)
	go func() {
		o := testOffer()
		for i := range uint64(n) {
			o.Seq = i
			o.Meta = mustMarshal(strings.Repeat(string(rune('a'+i%26)), 900))
			if err := prod.SendOffer(ctx, &o); err != nil {
				sent <- err
				return
			}
			if i%500 == 0 {
				time.Sleep(time.Millisecond) // let the writer goroutine run dry now and then
			}
		}
		sent <- prod.Flush(ctx)
	}()
	time.Sleep(100 * time.Millisecond)
	var m Message
	for i := range uint64(n) {
		if err := cons.Recv(ctx, &m); err != nil {
			t.Fatal(err)
		}
		want := mustMarshal(strings.Repeat(string(rune('a'+i%26)), 900))
		if m.Kind != KindOffer || m.Offer.Seq != i || string(m.Offer.Meta) != string(want) {
			t.Fatalf("message %d: %v seq %d, meta %d bytes", i, m.Kind, m.Offer.Seq, len(m.Offer.Meta))
		}
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
}
