package integration

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/seed743c36cf/cudashare/internal/app"
)

// A hostile client is this test binary re-run with envHostile naming what
// it does to the producer at envHostileSocket. It prints what came back:
// "GOT error <code> <message>", "GOT hello-ack", "GOT eof" or "GOT nothing",
// and exits 0 (1 if it could not even connect).
const (
	envHostile       = "CUDASHARE_INTEGRATION_HOSTILE"
	envHostileSocket = "CUDASHARE_INTEGRATION_SOCKET"
)

// Wire constants of PROTOCOL.md, written out here on purpose: a hostile
// client does not use the transport package.
const (
	kindHello    = 1
	kindHelloAck = 2
	kindOffer    = 3
	kindRelease  = 4
	kindRetire   = 5
	kindClosed   = 6
	kindError    = 9
	roleProducer = 1
	roleConsumer = 2
)

func runHostile(kind, path string) int {
	dial := func() net.Conn {
		c, err := net.Dial("unix", path)
		if err != nil {
			fmt.Println("FAIL dial:", err)
			os.Exit(1)
		}
		return c
	}
	if f, ok := hostileKinds[kind]; ok {
		return f(path)
	}
	switch kind {
	case "flood":
		// More connections than the producer handshakes at once, all silent.
		var cs []net.Conn
		for range 40 {
			if c, err := net.Dial("unix", path); err == nil {
				cs = append(cs, c)
			}
		}
		time.Sleep(500 * time.Millisecond)
		for _, c := range cs {
			c.Close()
		}
		fmt.Println("GOT nothing", len(cs), "connections")
		return 0
	case "silent":
		c := dial()
		time.Sleep(300 * time.Millisecond)
		c.Close()
		fmt.Println("GOT nothing")
		return 0
	case "half-frame":
		c := dial()
		c.Write([]byte{0, 0, 0, 100, 0x98, 1, 1, 2})
		c.Close()
		fmt.Println("GOT nothing")
		return 0
	}

	c := dial()
	defer c.Close()
	var out []byte
	switch kind {
	case "garbage":
		body := make([]byte, 4092)
		rand.Read(body)
		body[0] = 0xc1 // never valid msgpack, whatever the rest
		out = frame(body)
	case "garbage-stream":
		out = make([]byte, 4096)
		rand.Read(out) // the length prefix too: most likely far past the cap
	case "oversized":
		out = binary.BigEndian.AppendUint32(nil, 0x7fffffff)
		out = append(out, 0x98, 1, 1, 2)
	case "zero-length":
		out = []byte{0, 0, 0, 0}
	case "version":
		out = frame(hello(2, roleConsumer, 8))
	case "role":
		out = frame(hello(1, roleProducer, 0))
	case "unknown-kind":
		out = frame([]byte{0x92, 42, 0})
	case "early-offer":
		out = frame([]byte{0x91, kindOffer})
	case "credits-overflow":
		out = frame(hello(1, roleConsumer, 1<<30))
	case "garbage-after-handshake", "release-unheld":
		// A well-behaved handshake with no credits, so that no buffer is
		// ever offered to this process, then a protocol violation.
		c.Write(frame(hello(1, roleConsumer, 0)))
		if got := readReply(c); got != "GOT hello-ack" {
			fmt.Println(got)
			return 0
		}
		if kind == "release-unheld" {
			out = frame([]byte{0x92, kindRelease, 0x91, 7})
		} else {
			out = frame([]byte{0xc1, 0xc1, 0xc1})
		}
	default:
		fmt.Println("FAIL unknown hostile kind", kind)
		return 1
	}
	c.Write(out)
	fmt.Println(readReply(c))
	return 0
}

// hello is a hello message: [1, version, role, pid, instance_id, devices,
// capabilities, credits].
func hello(version, role, credits uint64) []byte {
	b := []byte{0x98, kindHello}
	b = appendUint(b, version)
	b = appendUint(b, role)
	b = appendUint(b, uint64(os.Getpid()))
	id := make([]byte, 16)
	rand.Read(id)
	b = append(append(b, 0xc4, 16), id...)
	// No devices; the vmm capability, so that a producer sharing by vmm
	// memory serves it. A hostile peer that maps nothing reads with plain
	// reads, which make the kernel close the descriptors that arrive.
	b = append(b, 0x90, 1)
	return appendUint(b, credits)
}

func appendUint(b []byte, v uint64) []byte {
	switch {
	case v < 128:
		return append(b, byte(v))
	case v < 1<<8:
		return append(b, 0xcc, byte(v))
	case v < 1<<16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(v))
	case v < 1<<32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), v)
}

func frame(body []byte) []byte {
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
}

// readReply reads the producer's answer, within 10 seconds.
func readReply(c net.Conn) string { return readReplyBy(c, time.Now().Add(10*time.Second)) }

// readReplyBy reads the producer's answer until deadline.
func readReplyBy(c net.Conn, deadline time.Time) string {
	c.SetReadDeadline(deadline)
	var hdr [4]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
			return "GOT eof"
		}
		return "GOT read error: " + err.Error()
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n == 0 || n > 1<<16 {
		return fmt.Sprintf("GOT a frame of %d bytes", n)
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(c, body); err != nil {
		return "GOT a cut frame: " + err.Error()
	}
	var msg []any
	if err := msgpack.Unmarshal(body, &msg); err != nil || len(msg) == 0 {
		return fmt.Sprintf("GOT undecodable %x", body)
	}
	switch toUint(msg[0]) {
	case kindHelloAck:
		return "GOT hello-ack"
	case kindError:
		if len(msg) >= 3 {
			return fmt.Sprintf("GOT error %d %v", toUint(msg[1]), msg[2])
		}
	}
	return fmt.Sprintf("GOT message %v", msg)
}

func toUint(v any) uint64 {
	switch x := v.(type) {
	case int8:
		return uint64(x)
	case int16:
		return uint64(x)
	case int32:
		return uint64(x)
	case int64:
		return uint64(x)
	case uint8:
		return uint64(x)
	case uint16:
		return uint64(x)
	case uint32:
		return uint64(x)
	case uint64:
		return x
	}
	return 1 << 63
}

// TestHostileInput: processes that connect and send garbage, oversized
// frames, wrong versions and roles, protocol violations after a good
// handshake, floods of silent connections. Each is answered with the
// protocol's error (or dropped), the producer logs it, and the consumer
// already connected never notices; a newcomer is served afterwards.
func TestHostileInput(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-ring", "8", "-size", "64KiB", "-consumers", "1")
	good := e.consumer("good", "-work", "100us")
	e.waitSocket(prod)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		kind string
		want []string // any of these
	}{
		{"garbage", []string{"GOT error 3 ", "GOT eof"}},
		{"garbage-stream", []string{"GOT error 6 ", "GOT error 3 ", "GOT eof"}},
		{"oversized", []string{"GOT error 6 "}},
		{"zero-length", []string{"GOT error 3 "}},
		{"version", []string{"GOT error 1 "}},
		{"role", []string{"GOT error 8 "}},
		{"unknown-kind", []string{"GOT error 4 ", "GOT error 5 "}},
		{"early-offer", []string{"GOT error 5 ", "GOT error 3 "}},
		{"credits-overflow", []string{"GOT error 7 ", "GOT error 3 "}},
		{"garbage-after-handshake", []string{"GOT error 3 "}},
		{"release-unheld", []string{"GOT error 7 "}},
		{"half-frame", []string{"GOT nothing"}},
		{"silent", []string{"GOT nothing"}},
		{"flood", []string{"GOT nothing"}},
	}
	for _, tc := range cases {
		cmd := exec.Command(exe, "-test.run=^$")
		cmd.Env = append(os.Environ(), envHostile+"="+tc.kind, envHostileSocket+"="+e.sock)
		h := e.startCmd("hostile "+tc.kind, cmd)
		h.expectExit(0, 20*time.Second)
		got := strings.TrimSpace(h.stdout.String())
		ok := false
		for _, w := range tc.want {
			ok = ok || strings.HasPrefix(got, w)
		}
		if !ok {
			t.Errorf("hostile %s: got %q, want one of %q", tc.kind, got, tc.want)
		}
		if tc.kind == "version" {
			mustContain(t, "the version error", got, "1", "2")
		}
		if !prod.running() || !good.running() {
			t.Fatalf("after hostile %s: producer running %v, good consumer running %v\nproducer:\n%s", tc.kind, prod.running(), good.running(), prod.stderr.String())
		}
	}
	probe := e.consumer("probe", "-count", "200")
	probe.consumerDone(30 * time.Second)
	prod.signal(syscall.SIGTERM)
	gr := good.consumerDone(30 * time.Second)
	prod.producerDone(30 * time.Second)
	if gr.End != "producer said goodbye" {
		t.Errorf("the good consumer ended by %q", gr.End)
	}
	mustContain(t, "the producer's log", prod.stderr.String(), "handshake failed")
}

// fakeProducer listens at path and answers the first hello with reply.
func fakeProducer(t *testing.T, path string, reply []byte) {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(20 * time.Second))
		var hdr [4]byte
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return
		}
		if _, err := io.CopyN(io.Discard, c, int64(binary.BigEndian.Uint32(hdr[:]))); err != nil {
			return
		}
		c.Write(frame(reply))
		io.Copy(io.Discard, c) // until the consumer hangs up
	}()
}

// TestConsumerRefused: a consumer that meets a producer of another
// protocol version, one that refuses its user, or something that is not a
// producer, exits 7 and says which.
func TestConsumerRefused(t *testing.T) {
	e := newEnv(t, "")
	ack := func(version, role uint64) []byte {
		b := hello(version, role, 0)
		b[1] = kindHelloAck
		return b
	}
	errMsg := func(code uint64, text string) []byte {
		b := append([]byte{0x93, kindError}, byte(code))
		return append(append(b, 0xa0|byte(len(text))), text...)
	}
	cases := []struct {
		name  string
		reply []byte
		says  []string
	}{
		{"hello-ack of version 2", ack(2, roleProducer), []string{"another version of the cudashare protocol", "version 1"}},
		{"version error", errMsg(1, "version 2 required"), []string{"another version of the cudashare protocol"}},
		{"user refused", errMsg(2, "uid 1000 is not allowed"), []string{"refused this user"}},
		{"another consumer", ack(1, roleConsumer), []string{"not a cudashare producer"}},
	}
	for i, tc := range cases {
		path := filepath.Join(e.sockDir, fmt.Sprintf("fake%d.sock", i))
		fakeProducer(t, path, tc.reply)
		p := e.start("consumer vs "+tc.name, bins.consumer, nil, "-socket", path)
		p.expectExit(app.ExitRefused, 20*time.Second)
		mustContain(t, "consumer vs "+tc.name, p.stderr.String(), tc.says...)
	}
}

// TestPeerOfAnotherUser: a consumer of another user (uid 65534) is refused
// with a clear error, whether the kernel stops it at the private socket
// directory or, with the directory opened up, the two refuse each other's
// credentials (SO_PEERCRED); the producer keeps serving its own user.
func TestPeerOfAnotherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skipf("needs root to start a process as uid 65534 (running as uid %d)", os.Geteuid())
	}
	e := newEnv(t, "")
	prod := e.producer("-ring", "4", "-size", "64KiB", "-consumers", "1")
	good := e.consumer("good", "-work", "100us")
	e.waitSocket(prod)

	// The other user needs a binary it can run and a simulator state
	// directory of its own (the test's is private to root).
	dir, err := os.MkdirTemp("", "csit-nobody-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	bin := filepath.Join(dir, "consumer")
	data, err := os.ReadFile(bins.consumer)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	sim := filepath.Join(dir, "sim")
	if err := os.Mkdir(sim, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(sim, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	nobody := func(name string) *proc {
		cmd := exec.Command(bin, "-socket", e.sock, "-json")
		cmd.Dir = dir
		// The refusal comes before any GPU work, so the other user runs
		// on a simulator of its own even next to a real GPU: it need not
		// be allowed to open the GPU device files.
		cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=" + dir, "CUDASHARE_DRIVER=sim", "CUDASHARE_SIM_DIR=" + sim}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		return e.startCmd(name, cmd)
	}

	p := nobody("uid 65534, private directory")
	p.expectExit(app.ExitRefused, 20*time.Second)
	mustContain(t, "the other user's error", p.stderr.String(), "permission denied", "same user")

	if err := os.Chmod(e.sockDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(e.sock, 0o666); err != nil {
		t.Fatal(err)
	}
	p = nobody("uid 65534, open directory")
	p.expectExit(app.ExitRefused, 20*time.Second)
	// Both sides refuse: the consumer's own credential check sees a
	// listener of another user (root) before any answer can arrive, and
	// says that it refused, not that the producer did.
	mustContain(t, "the other user's error", p.stderr.String(), "this consumer refused the process listening at", "this consumer is uid 65534")
	os.Chmod(e.sockDir, 0o700)

	probe := e.consumer("probe", "-count", "100")
	probe.consumerDone(30 * time.Second)
	prod.signal(syscall.SIGTERM)
	good.consumerDone(30 * time.Second)
	prod.producerDone(30 * time.Second)
	mustContain(t, "the producer's log", prod.stderr.String(), "refused peer", "uid=65534")
}
