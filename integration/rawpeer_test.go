package integration

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/seed743c36cf/cudashare/driver"
)

// The hostile kinds of the defect tests (defects_test.go), which need more
// than one message: a raw consumer that maps buffers the way the share
// package does, floods of handshaken or silent connections, a connection
// handed to a child process. envHostileN sets the size of a flood.
const envHostileN = "CUDASHARE_INTEGRATION_N"

// envHandoffParent tells the handoff child its parent's pid.
const envHandoffParent = "CUDASHARE_INTEGRATION_PARENT"

var hostileKinds = map[string]func(path string) int{
	"closed-while-leased": hostileClosedWhileLeased,
	"release-twice":       func(path string) int { return hostileBadRelease(path, true) },
	"release-never-sent":  func(path string) int { return hostileBadRelease(path, false) },
	"silent-refresh":      hostileSilentRefresh,
	"idle-flood":          hostileIdleFlood,
	"hello-close":         hostileHelloClose,
	"handoff-parent":      hostileHandoffParent,
	"handoff-child":       hostileHandoffChild,
}

// rawPeer is a consumer speaking the protocol by hand.
type rawPeer struct{ c net.Conn }

// dialRaw connects and handshakes with credits; it exits the process on a
// failure, printing what came back.
func dialRaw(path string, credits uint64) *rawPeer {
	c, err := net.Dial("unix", path)
	if err != nil {
		fmt.Println("FAIL dial:", err)
		os.Exit(1)
	}
	c.Write(frame(hello(1, roleConsumer, credits)))
	if got := readReply(c); got != "GOT hello-ack" {
		fmt.Println(got)
		os.Exit(0)
	}
	return &rawPeer{c: c}
}

// next reads one message, waiting up to timeout.
func (p *rawPeer) next(timeout time.Duration) ([]any, error) {
	p.c.SetReadDeadline(time.Now().Add(timeout))
	var hdr [4]byte
	if _, err := io.ReadFull(p.c, hdr[:]); err != nil {
		return nil, err
	}
	body := make([]byte, binary.BigEndian.Uint32(hdr[:]))
	if _, err := io.ReadFull(p.c, body); err != nil {
		return nil, err
	}
	var msg []any
	if err := msgpack.Unmarshal(body, &msg); err != nil || len(msg) == 0 {
		return nil, fmt.Errorf("undecodable %x", body)
	}
	return msg, nil
}

// rawOffer is what a raw consumer keeps of an offer.
type rawOffer struct {
	seq, alloc uint64
	handle     driver.IpcMemHandle
	device     driver.UUID
}

// offers reads until it has n offers, skipping other messages; it exits the
// process (printing what came instead) if they do not come.
func (p *rawPeer) offers(n int) []rawOffer {
	var got []rawOffer
	for len(got) < n {
		msg, err := p.next(10 * time.Second)
		if err != nil {
			fmt.Printf("FAIL waiting for offer %d of %d: %v\n", len(got)+1, n, err)
			os.Exit(1)
		}
		switch toUint(msg[0]) {
		case kindOffer:
			if len(msg) < 12 {
				fmt.Println("FAIL short offer", msg)
				os.Exit(1)
			}
			o := rawOffer{seq: toUint(msg[1]), alloc: toUint(msg[2])}
			h, _ := msg[4].([]byte)
			d, _ := msg[8].([]byte)
			copy(o.handle[:], h)
			copy(o.device[:], d)
			got = append(got, o)
		case kindError:
			fmt.Printf("FAIL error instead of an offer: %v\n", msg)
			os.Exit(1)
		}
	}
	return got
}

func (p *rawPeer) release(seq uint64) {
	p.c.Write(frame(appendUint([]byte{0x92, kindRelease, 0x91}, seq)))
}

func (p *rawPeer) closed(alloc uint64) {
	p.c.Write(frame(appendUint([]byte{0x92, kindClosed}, alloc)))
}

// reply reads until an error message or the end of the connection,
// skipping offers and retires, and says what it was in readReply's words.
// It waits 5 seconds: an answer comes at once or not at all.
func (p *rawPeer) reply() string {
	for {
		msg, err := p.next(5 * time.Second)
		switch {
		case errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET):
			return "GOT eof"
		case err != nil:
			return "GOT read error: " + err.Error()
		case toUint(msg[0]) == kindError && len(msg) >= 3:
			return fmt.Sprintf("GOT error %d %v", toUint(msg[1]), msg[2])
		}
	}
}

// mapped is an allocation a raw consumer opened with the driver, as the
// share package's importer does.
type mapped struct {
	ctx *driver.Context
	ptr driver.DevicePtr
}

func mapOffer(o rawOffer) *mapped {
	d, err := driver.Open(driver.Config{})
	if err != nil {
		fmt.Println("FAIL driver:", err)
		os.Exit(1)
	}
	dev, err := d.DeviceByUUID(o.device)
	if err != nil {
		fmt.Println("FAIL device:", err)
		os.Exit(1)
	}
	ctx, err := dev.RetainPrimaryContext()
	if err != nil {
		fmt.Println("FAIL context:", err)
		os.Exit(1)
	}
	ptr, err := ctx.IpcOpenMemHandle(o.handle)
	if err != nil {
		fmt.Println("FAIL open the handle:", err)
		os.Exit(1)
	}
	return &mapped{ctx: ctx, ptr: ptr}
}

// unmap closes the mapping; the memory must still be there, unfreed.
func (m *mapped) unmap() {
	var b [1]byte
	if err := m.ctx.CopyDtoH(b[:], m.ptr); err != nil {
		fmt.Println("FAIL the mapped memory cannot be read:", err)
	}
	if err := m.ctx.IpcCloseMemHandle(m.ptr); err != nil {
		fmt.Println("FAIL close the mapping:", err)
	}
	m.ctx.Close()
}

// untilSIGTERM blocks until the test sends SIGTERM.
func untilSIGTERM() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	<-ctx.Done()
}

// hostileClosedWhileLeased (defect 5) maps an allocation, holds two leases
// in it, and says `closed` for it unasked: a producer that believed it
// would free the memory under the mapping. It prints the producer's
// answer, then holds the mapping until SIGTERM, releases the leases (a
// producer that trusted `closed` frees now), keeps the mapping a while
// longer, and only then closes it.
func hostileClosedWhileLeased(path string) int {
	p := dialRaw(path, 2)
	got := p.offers(2)
	m := mapOffer(got[0])
	fmt.Printf("MAPPED alloc %d seqs %d %d\n", got[0].alloc, got[0].seq, got[1].seq)
	p.closed(got[0].alloc)
	fmt.Println(p.reply())
	untilSIGTERM()
	p.release(got[0].seq)
	p.release(got[1].seq)
	time.Sleep(time.Second)
	m.unmap()
	fmt.Println("UNMAPPED")
	return 0
}

// hostileBadRelease holds two leases and releases one twice, or releases
// one and then a sequence number never sent: within the credits, so only
// the sharing layer can tell.
func hostileBadRelease(path string, twice bool) int {
	p := dialRaw(path, 2)
	got := p.offers(2)
	p.release(got[0].seq)
	if twice {
		p.release(got[0].seq)
	} else {
		p.release(got[0].seq + got[1].seq + 1000)
	}
	fmt.Println(p.reply())
	return 0
}

func floodSize(def int) int {
	if n, err := strconv.Atoi(os.Getenv(envHostileN)); err == nil && n > 0 {
		return n
	}
	return def
}

// hostileSilentRefresh (defect 3) keeps 48 silent connections open to the
// producer, replacing them with new ones every 2 seconds, before the
// producer's 5-second handshake timeout would close them: a producer with
// a fixed pool of pending handshakes is then full forever. It prints "OPEN
// n" once the first ones are open and runs until killed.
func hostileSilentRefresh(path string) int {
	n := floodSize(48)
	var old []net.Conn
	for round := 0; ; round++ {
		var cs []net.Conn
		for range n {
			if c, err := net.Dial("unix", path); err == nil {
				cs = append(cs, c)
			}
		}
		// The new ones are open before the old ones close: no moment
		// with free slots.
		for _, c := range old {
			c.Close()
		}
		old = cs
		if round == 0 {
			fmt.Println("OPEN", len(cs))
		}
		time.Sleep(2 * time.Second)
	}
}

// hostileIdleFlood (defect 4) opens many handshaken connections (credits 0,
// so nothing is ever offered) and keeps them idle. It prints one line, "FLOOD
// acks=A limit=L errors=E eof=F noanswer=N dialfail=D", then holds them
// until SIGTERM.
func hostileIdleFlood(path string) int {
	n := floodSize(2000)
	var cs []net.Conn
	dialFail := 0
	for range n {
		c, err := net.Dial("unix", path)
		if err != nil {
			dialFail++
			continue
		}
		c.Write(frame(hello(1, roleConsumer, 0)))
		cs = append(cs, c)
	}
	deadline := time.Now().Add(15 * time.Second)
	acks, limit, errs, eof, none := 0, 0, 0, 0, 0
	for _, c := range cs {
		switch got := readReplyBy(c, deadline); {
		case got == "GOT hello-ack":
			acks++
		case strings.HasPrefix(got, "GOT error 12 "):
			limit++
		case strings.HasPrefix(got, "GOT error "):
			errs++
		case got == "GOT eof":
			eof++
		default:
			none++
		}
		c.SetReadDeadline(time.Time{})
	}
	fmt.Printf("FLOOD acks=%d limit=%d errors=%d eof=%d noanswer=%d dialfail=%d\n", acks, limit, errs, eof, none, dialFail)
	untilSIGTERM()
	return 0
}

// hostileHelloClose (defect 4) handshakes and hangs up without a goodbye,
// many times over, from one live process. It prints "DONE acks=A other=O"
// and then stays alive until SIGTERM: what the producer keeps for a peer
// whose process is alive is what leaks.
func hostileHelloClose(path string) int {
	n := floodSize(2000)
	acks, other := 0, 0
	for range n {
		c, err := net.Dial("unix", path)
		if err != nil {
			other++
			continue
		}
		c.Write(frame(hello(1, roleConsumer, 0)))
		if readReply(c) == "GOT hello-ack" {
			acks++
		} else {
			other++
		}
		c.Close()
	}
	fmt.Printf("DONE acks=%d other=%d\n", acks, other)
	untilSIGTERM()
	return 0
}

// hostileHandoffParent (defect 6) handshakes with two credits, hands the
// connection to a child process (this binary again, as handoff-child)
// and exits at once: the producer's SO_PEERCRED pid is then a dead process
// while the connection lives on in the child. The child shares this
// process's stdout.
func hostileHandoffParent(path string) int {
	p := dialRaw(path, 2)
	f, err := p.c.(*net.UnixConn).File()
	if err != nil {
		fmt.Println("FAIL dup the connection:", err)
		return 1
	}
	exe, err := os.Executable()
	if err != nil {
		fmt.Println("FAIL", err)
		return 1
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), envHostile+"=handoff-child", envHandoffParent+"="+strconv.Itoa(os.Getpid()))
	cmd.ExtraFiles = []*os.File{f}
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Start(); err != nil {
		fmt.Println("FAIL start the child:", err)
		return 1
	}
	fmt.Println("CHILD", cmd.Process.Pid)
	return 0
}

// hostileHandoffChild waits for its parent to exit, takes two offers on
// the inherited connection, maps them and holds them until SIGTERM; then
// it closes its mapping and exits without a goodbye or a release: its exit
// ends the connection.
func hostileHandoffChild(string) int {
	// From the environment: by the time the child looks, its parent may
	// have exited already.
	parent, _ := strconv.Atoi(os.Getenv(envHandoffParent))
	nc, err := net.FileConn(os.NewFile(3, "handed-over connection"))
	if err != nil {
		fmt.Println("FAIL", err)
		return 1
	}
	for os.Getppid() == parent {
		time.Sleep(5 * time.Millisecond)
	}
	fmt.Println("PARENT GONE")
	p := &rawPeer{c: nc}
	got := p.offers(2)
	m := mapOffer(got[0])
	fmt.Printf("HOLDING alloc %d seqs %d %d\n", got[0].alloc, got[0].seq, got[1].seq)
	untilSIGTERM()
	m.unmap()
	fmt.Println("UNMAPPED")
	return 0
}
