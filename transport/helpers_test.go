//go:build linux

package transport

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/internal/testutil"
)

// socketDir returns a fresh private directory with a short path (socket
// paths are limited to 108 bytes, and t.TempDir's can be longer).
func socketDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "cst")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// testConfig returns a config for tests, logging into log if not nil.
func testConfig(role Role, log io.Writer) Config {
	cfg := DefaultConfig(role)
	if log == nil {
		log = io.Discard
	}
	cfg.Logger = slog.New(slog.NewTextHandler(log, nil))
	cfg.HandshakeTimeout = 2 * time.Second
	cfg.WriteTimeout = 2 * time.Second
	cfg.DisableShm = os.Getenv(socketModeEnv) != ""
	return cfg
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// listen starts a listener in a fresh directory, closed at cleanup.
func listen(t testing.TB, cfg Config) *Listener {
	t.Helper()
	l, err := Listen(testCtx(t), filepath.Join(socketDir(t), "sock"), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// pair returns a connected producer (listener side) and consumer (dialer).
func pair(t testing.TB, pcfg, ccfg Config) (prod, cons *Conn) {
	t.Helper()
	l := listen(t, pcfg)
	ctx := testCtx(t)
	cons, err := Dial(ctx, l.Addr(), ccfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cons.Close() })
	prod, err = l.Accept(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prod.Close() })
	return prod, cons
}

// rawPeer speaks the protocol by hand, to send what a Conn never would.
// It decodes with the vmihailenco library, independently of the package.
type rawPeer struct {
	t testing.TB
	c *net.UnixConn
}

func rawDial(t testing.TB, path string) *rawPeer {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawPeer{t: t, c: c}
}

func (p *rawPeer) write(b []byte) {
	p.t.Helper()
	p.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := p.c.Write(b); err != nil {
		p.t.Fatalf("raw write: %v", err)
	}
}

// send frames body and writes it.
func (p *rawPeer) send(body []byte) { p.t.Helper(); p.write(frame(body)) }

// sendMsg encodes the elements with msgpack and sends them as a message.
func (p *rawPeer) sendMsg(elems ...any) { p.t.Helper(); p.send(mustMarshal(elems)) }

// sendFDs sends body with descriptors attached.
func (p *rawPeer) sendFDs(body []byte, fds ...int) {
	p.t.Helper()
	if _, _, err := p.c.WriteMsgUnix(frame(body), unix.UnixRights(fds...), nil); err != nil {
		p.t.Fatalf("raw sendmsg: %v", err)
	}
}

// recv reads one message, or returns the read error.
func (p *rawPeer) recv() ([]any, error) {
	p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	var hdr [headerSize]byte
	if _, err := io.ReadFull(p.c, hdr[:]); err != nil {
		return nil, err
	}
	body := make([]byte, binary.BigEndian.Uint32(hdr[:]))
	if _, err := io.ReadFull(p.c, body); err != nil {
		return nil, err
	}
	dec := msgpack.NewDecoder(bytes.NewReader(body))
	dec.UseLooseInterfaceDecoding(true)
	var v []any
	if err := dec.Decode(&v); err != nil {
		p.t.Fatalf("raw peer got a message msgpack cannot read: %v", err)
	}
	normalize(v)
	return v, nil
}

// hello does the dialer's half of the handshake and returns the answer.
func (p *rawPeer) hello(role Role, credits uint64, caps Caps) []any {
	p.t.Helper()
	p.sendMsg(KindHello, Version, role, os.Getpid(), make([]byte, 16), []any{}, uint64(caps), credits)
	ack, err := p.recv()
	if err != nil {
		p.t.Fatalf("raw hello: %v", err)
	}
	if ack[0] != uint64(KindHelloAck) {
		p.t.Fatalf("raw hello: answer %v", ack)
	}
	return ack
}

// expectError reads until an error message arrives and checks its code;
// then it expects end of stream.
func (p *rawPeer) expectError(code uint64) {
	p.t.Helper()
	for {
		m, err := p.recv()
		if err != nil {
			p.t.Fatalf("want error message with code %d, got read error %v", code, err)
		}
		if m[0] == uint64(KindError) {
			if m[1] != code {
				p.t.Fatalf("error message %v, want code %d", m, code)
			}
			break
		}
	}
	if m, err := p.recv(); !errors.Is(err, io.EOF) && !errors.Is(err, unix.ECONNRESET) {
		p.t.Fatalf("after the error message: %v, %v; want end of stream", m, err)
	}
}

// listenRaw listens on path without the package, for a raw listener.
func listenRaw(path string) (*net.UnixListener, error) {
	return net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
}

// serveRaw listens at a fresh path without the package and runs script,
// in a goroutine, as the peer of the first connection, which it closes
// when script returns; done closes after that. The listener closes when
// the test ends, or earlier by the caller's ln.Close.
func serveRaw(t *testing.T, script func(p *rawPeer)) (path string, ln *net.UnixListener, done <-chan struct{}) {
	t.Helper()
	path = socketDir(t) + "/sock"
	ln, err := listenRaw(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		script(&rawPeer{t: t, c: c})
	}()
	return path, ln, ch
}

// waitLog waits for want to appear in log: a listener logs after it
// answers the peer.
func waitLog(t testing.TB, log *testutil.SyncBuffer, want string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(log.String(), want); {
		if time.Now().After(deadline) {
			t.Errorf("log lacks %q:\n%s", want, log.String())
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}
