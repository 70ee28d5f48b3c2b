//go:build linux

package sharetest

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/transport"
)

// The routines of this file speak the protocol by hand (transport, driver) to
// do what share never would: offer lies, grab and hang up, hand a connection
// to another process, free on goodbye.

// rawListen listens at ParamPath as a producer of ce's device, and says
// LISTENING.
func rawListen(ctx context.Context, ce *ChildEnv) (*transport.Listener, transport.UUID, error) {
	dev := ce.Ctx.Device().UUID()
	cfg := transport.DefaultConfig(transport.RoleProducer)
	cfg.Devices = []transport.UUID{dev}
	ln, err := transport.Listen(ctx, os.Getenv(ParamPath), cfg)
	if err != nil {
		return nil, dev, err
	}
	fmt.Println("LISTENING")
	return ln, dev, nil
}

// rawAcceptOne is rawListen for a routine that serves one consumer: it
// returns that consumer's connection and stops listening.
func rawAcceptOne(ctx context.Context, ce *ChildEnv) (*transport.Conn, transport.UUID, error) {
	ln, dev, err := rawListen(ctx, ce)
	if err != nil {
		return nil, dev, err
	}
	defer ln.Close()
	conn, err := ln.Accept(ctx)
	return conn, dev, err
}

// exportedSize is the size of the allocations the raw routines export.
const exportedSize = 1 << 20

// exportedAlloc allocates exportedSize bytes and returns them with their
// legacy IPC handle; with a batch number other than 0, their first 4096
// bytes hold its pattern (Fill).
func exportedAlloc(ce *ChildEnv, batch uint64) (driver.DevicePtr, driver.IpcMemHandle, error) {
	p, err := ce.Ctx.Alloc(exportedSize)
	if err != nil {
		return 0, driver.IpcMemHandle{}, err
	}
	h, err := ce.Ctx.IpcGetMemHandle(p)
	if err != nil {
		return 0, driver.IpcMemHandle{}, err
	}
	if batch != 0 {
		if err := Fill(ce.Ctx, p, 4096, batch); err != nil {
			return 0, driver.IpcMemHandle{}, err
		}
	}
	return p, h, nil
}

// rawProducer speaks the protocol by hand to offer what share.Exporter
// never would: the handle of allocation 1 under allocation id 2 (a handle
// that names another allocation than the one mapped under it), and
// allocation 1 under another handle. Then it retires allocation 1, waits
// for closed, and frees it: the free must not be early.
func rawProducer(ce *ChildEnv) error {
	ctx, cancel := context.WithTimeout(context.Background(), ExpectTimeout)
	defer cancel()
	conn, dev, err := rawAcceptOne(ctx, ce)
	if err != nil {
		return err
	}
	defer conn.Close()
	p, h, err := exportedAlloc(ce, 7)
	if err != nil {
		return err
	}
	other := transport.Handle(h)
	other[20] ^= 0xff
	offers := []transport.Offer{
		{Seq: 1, AllocID: 1, Handle: transport.Handle(h)},
		{Seq: 2, AllocID: 2, Handle: transport.Handle(h)}, // same handle, another allocation
		{Seq: 3, AllocID: 1, Handle: other},               // same allocation, another handle
	}
	for i := range offers {
		o := &offers[i]
		o.AllocSize, o.Size, o.Device, o.Meta = exportedSize, 4096, dev, Meta(7)
	}
	rep, err := offerThenRetire(ctx, conn, offers, 1)
	if err != nil {
		return err
	}
	if err := ce.Ctx.Free(p); err != nil {
		rep.FreeErr = err.Error()
	}
	conn.Shutdown(ctx, "raw producer done")
	report(rep)
	return nil
}

// exportHandle allocates 1 MiB, prints "HANDLE <hex>" and frees it once
// stdin closes.
func exportHandle(ce *ChildEnv) error {
	p, h, err := exportedAlloc(ce, 0)
	if err != nil {
		return err
	}
	fmt.Printf("HANDLE %s %d\n", hex.EncodeToString(h[:]), exportedSize)
	io.Copy(io.Discard, ce.In)
	return ce.Ctx.Free(p)
}

// rawConsumer is a consumer on the bare transport, which can do what the
// Importer never does. With ParamCredits credits (the transport's default
// if unset), it takes ParamHold offers (1), mapping the first
// one's allocation (and checking its bytes), prints HELD n, then obeys
// lines on stdin: "closed" sends closed for that allocation, unasked;
// "bogus-release" releases a sequence number it was never sent;
// "release" releases what it holds; "handoff" hands the connection and
// the mapping to a new process (routine holder), prints HANDED pid, and
// returns; "disconnect" closes the connection without a goodbye; "exit"
// closes the mapping and returns. Each command is answered with its name
// in capitals once done.
func rawConsumer(ce *ChildEnv) error {
	ctx, cancel := context.WithTimeout(context.Background(), ExpectTimeout)
	defer cancel()
	cfg := transport.DefaultConfig(transport.RoleConsumer)
	cfg.Devices = []transport.UUID{ce.Ctx.Device().UUID()}
	cfg.AcceptVMM = true
	if n := Param(ParamCredits, 0); n > 0 {
		cfg.Credits = uint32(n)
	}
	before := socketFDs()
	conn, err := transport.Dial(ctx, os.Getenv(ParamPath), cfg)
	if err != nil {
		return err
	}
	defer conn.Close()
	fmt.Println("CONNECTED")
	var p driver.DevicePtr
	var vmm *vmmImport
	var first transport.Offer
	var seqs []uint64
	var held []transport.Offer
	var m transport.Message
	unmap := func() error {
		if vmm != nil {
			return vmm.close()
		}
		if p != 0 {
			return ce.Ctx.IpcCloseMemHandle(p)
		}
		return nil
	}
	for len(seqs) < Param(ParamHold, 1) {
		if err := conn.Recv(ctx, &m); err != nil {
			return err
		}
		if m.Kind != transport.KindOffer {
			continue
		}
		if len(seqs) == 0 {
			first = m.Offer
			first.Meta, first.FDs = nil, nil
			if m.Offer.HandleKind == transport.HandleVMM {
				if vmm, err = importFD(ce.Ctx, m.Offer); err != nil {
					return err
				}
				p = vmm.m.Ptr()
			} else if p, err = ce.Ctx.IpcOpenMemHandle(driver.IpcMemHandle(m.Offer.Handle)); err != nil {
				return err
			}
		} else if m.Offer.AllocID != first.AllocID {
			return fmt.Errorf("rawconsumer maps one allocation; offered allocation %d after %d", m.Offer.AllocID, first.AllocID)
		}
		closeAll(m.Offer.FDs)
		n, _ := ParseMeta(m.Offer.Meta)
		if err := Check(ce.Ctx, p+driver.DevicePtr(m.Offer.Offset), m.Offer.Size, n); err != nil {
			return err
		}
		o := m.Offer
		o.Meta = append([]byte(nil), o.Meta...)
		o.FDs = nil
		held = append(held, o)
		seqs = append(seqs, m.Offer.Seq)
	}
	fmt.Printf("HELD %d\n", len(seqs))
	for {
		line, err := ce.In.ReadString('\n')
		cmd := strings.TrimSpace(line)
		switch {
		case err != nil || cmd == "exit":
			return unmap()
		case cmd == "check":
			// What it held still reads right, whatever the producer did.
			for _, o := range held {
				n, _ := ParseMeta(o.Meta)
				if err = Check(ce.Ctx, p+driver.DevicePtr(o.Offset), o.Size, n); err != nil {
					break
				}
			}
		case cmd == "closed":
			err = conn.SendClosed(ctx, first.AllocID)
		case cmd == "bogus-release":
			err = conn.SendRelease(ctx, 1<<40|12345)
		case cmd == "release":
			err = conn.SendRelease(ctx, seqs...)
			seqs = nil
		case cmd == "disconnect":
			conn.Close()
		case cmd == "handoff":
			pid, err := handOff(conn, before, first)
			if err != nil {
				return err
			}
			// The holder maps the memory now; this process goes.
			fmt.Printf("HANDED %d\n", pid)
			return unmap()
		default:
			return fmt.Errorf("unknown command %q", cmd)
		}
		if err != nil {
			return err
		}
		if cmd == "disconnect" {
			cmd = "disconnected"
		}
		fmt.Println(strings.ToUpper(cmd))
	}
}

// grabber connects ParamCount times, each time waiting briefly for one
// offer and hanging up without a goodbye or a release: what it was offered
// stays leased while it lives, as it may map it. It prints GRABBED n (the
// offers it got), then waits for "exit".
func grabber(ce *ChildEnv) error {
	cfg := transport.DefaultConfig(transport.RoleConsumer)
	cfg.Devices = []transport.UUID{ce.Ctx.Device().UUID()}
	cfg.Credits = 1
	cfg.AcceptVMM = true
	got := 0
	var maps []*vmmImport // what it took with VMM, mapped until it exits
	defer func() {
		for _, v := range maps {
			v.close()
		}
	}()
	for range Param(ParamCount, 20) {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		conn, err := transport.Dial(ctx, os.Getenv(ParamPath), cfg)
		if err == nil {
			var m transport.Message
			for conn.Recv(ctx, &m) == nil {
				if m.Kind == transport.KindOffer {
					got++
					if m.Offer.HandleKind == transport.HandleVMM {
						if v, err := importFD(ce.Ctx, m.Offer); err == nil {
							maps = append(maps, v)
						}
					}
					closeAll(m.Offer.FDs)
					break
				}
			}
			conn.Close()
		}
		cancel()
	}
	fmt.Printf("GRABBED %d\n", got)
	ce.waitLine("exit")
	return nil
}

// socketFDs returns the socket descriptors this process has open.
func socketFDs() map[int]bool {
	fds := map[int]bool{}
	ents, _ := os.ReadDir("/proc/self/fd")
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(l, "socket:") {
			n, _ := strconv.Atoi(e.Name())
			fds[n] = true
		}
	}
	return fds
}

// handOff starts a holder process with the connection's descriptor (the
// socket opened since before) and the offer's handle, and returns its pid
// once it has mapped the allocation.
func handOff(conn *transport.Conn, before map[int]bool, o transport.Offer) (int, error) {
	fd := -1
	for n := range socketFDs() {
		if !before[n] {
			fd = n
		}
	}
	if fd < 0 {
		return 0, errors.New("cannot find the connection's descriptor")
	}
	exe, err := os.Executable()
	if err != nil {
		return 0, err
	}
	cmd := exec.Command(exe, "-test.run=^$", "-test.bench=^$")
	cmd.Env = append(os.Environ(), EnvChild+"=holder", "SHARE_HANDLE="+hex.EncodeToString(o.Handle[:]))
	cmd.ExtraFiles = []*os.File{os.NewFile(uintptr(fd), "conn")}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return 0, err
	}
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	line, _ := bufio.NewReader(out).ReadString('\n')
	if strings.TrimSpace(line) != "MAPPED" {
		cmd.Process.Kill()
		return 0, fmt.Errorf("holder: %q", line)
	}
	return cmd.Process.Pid, nil
}

// holder holds a consumer connection it was handed (descriptor 3) and a
// mapping of the handle in SHARE_HANDLE, reading nothing: on SIGUSR1 it
// closes the connection (keeping the mapping), on SIGTERM it closes the
// mapping and exits.
func holder(ce *ChildEnv) error {
	var h driver.IpcMemHandle
	if _, err := hex.Decode(h[:], []byte(os.Getenv("SHARE_HANDLE"))); err != nil {
		return err
	}
	p, err := ce.Ctx.IpcOpenMemHandle(h)
	if err != nil {
		return err
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGUSR1, syscall.SIGTERM)
	conn := os.NewFile(3, "conn")
	fmt.Println("MAPPED")
	for sig := range sigs {
		if sig == syscall.SIGUSR1 {
			conn.Close()
			continue
		}
		break
	}
	return ce.Ctx.IpcCloseMemHandle(p)
}

// FreeOnGoodbyeReport is what freeOnGoodbye reports.
type FreeOnGoodbyeReport struct {
	Rounds   int
	FreeErrs []string
}

// freeOnGoodbye takes ParamCount consumers one after the other; each gets
// one offer of a fresh allocation, and the allocation is freed the moment
// the consumer's goodbye is read, as a producer may: a consumer must have
// closed its mapping before saying goodbye.
func freeOnGoodbye(ce *ChildEnv) error {
	ctx, cancel := context.WithTimeout(context.Background(), ExpectTimeout)
	defer cancel()
	ln, dev, err := rawListen(ctx, ce)
	if err != nil {
		return err
	}
	defer ln.Close()
	var rep FreeOnGoodbyeReport
	for range Param(ParamCount, 1) {
		if err := freeOnGoodbyeRound(ctx, ce, ln, dev, &rep); err != nil {
			return err
		}
		rep.Rounds++
	}
	report(rep)
	return nil
}

func freeOnGoodbyeRound(ctx context.Context, ce *ChildEnv, ln *transport.Listener, dev transport.UUID, rep *FreeOnGoodbyeReport) error {
	conn, err := ln.Accept(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	p, h, err := exportedAlloc(ce, 1)
	if err != nil {
		return err
	}
	o := transport.Offer{Seq: 1, AllocID: 1, Handle: transport.Handle(h), AllocSize: exportedSize, Size: 4096, Device: dev, Meta: Meta(1)}
	if err := conn.SendOffer(ctx, &o); err != nil {
		return err
	}
	var m transport.Message
	for m.Kind != transport.KindGoodbye {
		if err := conn.Recv(ctx, &m); err != nil {
			return fmt.Errorf("waiting for the goodbye: %w", err)
		}
	}
	if err := ce.Ctx.Free(p); err != nil {
		rep.FreeErrs = append(rep.FreeErrs, err.Error())
		// Free it once the consumer is really done, to leave no garbage.
		for range 1000 {
			if ce.Ctx.Free(p) == nil {
				break
			}
			time.Sleep(time.Millisecond)
		}
	}
	return nil
}

// vmmImport is a vmm allocation imported and mapped by hand.
type vmmImport struct {
	a *driver.Allocation
	m *driver.Mapping
}

func importFD(ctx *driver.Context, o transport.Offer) (*vmmImport, error) {
	if len(o.FDs) != 1 {
		return nil, fmt.Errorf("first offer of vmm allocation %d with %d descriptors", o.AllocID, len(o.FDs))
	}
	a, err := ctx.ImportFD(o.FDs[0], o.AllocSize)
	if err != nil {
		return nil, err
	}
	m, err := ctx.Map(a)
	if err != nil {
		a.Close()
		return nil, err
	}
	return &vmmImport{a: a, m: m}, nil
}

func (v *vmmImport) close() error { return errors.Join(v.m.Close(), v.a.Close()) }

func closeAll(fds []int) {
	for _, fd := range fds {
		syscall.Close(fd)
	}
}

// unsealedProducer offers, as a hostile producer on the simulator may, a
// copy of a genuine allocation's memfd (its header, checksum and all) that
// is not sealed against shrinking: a consumer that mapped it could be made
// to fault (SIGBUS) by an ftruncate. Then it offers the genuine allocation,
// filled with batch 3, retires it once released and ends. It reports
// RawReport: Releases of both offers, Closed for the genuine one.
func unsealedProducer(ce *ChildEnv) error {
	ctx, cancel := context.WithTimeout(context.Background(), ExpectTimeout)
	defer cancel()
	conn, dev, err := rawAcceptOne(ctx, ce)
	if err != nil {
		return err
	}
	defer conn.Close()
	size, _, err := ce.Ctx.Device().AllocationGranularity()
	if err != nil {
		return err
	}
	a, err := ce.Ctx.MemCreate(size, driver.MemCreateOptions{Exportable: true})
	if err != nil {
		return err
	}
	defer a.Close()
	m, err := ce.Ctx.Map(a)
	if err != nil {
		return err
	}
	defer m.Close()
	if err := Fill(ce.Ctx, m.Ptr(), 4096, 3); err != nil {
		return err
	}
	f, err := a.ExportFD()
	if err != nil {
		return err
	}
	defer f.Close()
	forged, err := unsealedCopy(int(f.Fd()), size)
	if err != nil {
		return err
	}
	defer syscall.Close(forged)
	offers := []transport.Offer{
		{Seq: 1, AllocID: 1, FDs: []int{forged}},
		{Seq: 2, AllocID: 2, FDs: []int{int(f.Fd())}},
	}
	for i := range offers {
		o := &offers[i]
		o.Handle[0] = byte(o.AllocID)
		o.HandleKind, o.AllocSize, o.Size, o.Device, o.Meta = transport.HandleVMM, size, 4096, dev, Meta(3)
	}
	rep, err := offerThenRetire(ctx, conn, offers, 2)
	if err != nil {
		return err
	}
	conn.Shutdown(ctx, "unsealed producer done")
	report(rep)
	return nil
}

// unsealedCopy makes a memfd of the simulator's layout (PROTOCOL.md,
// section 4.1) with fd's header page and size bytes of memory, and no seal.
func unsealedCopy(fd int, size uint64) (int, error) {
	const header = 4096
	hdr := make([]byte, header)
	if _, err := syscall.Pread(fd, hdr, 0); err != nil {
		return -1, fmt.Errorf("read the header: %w", err)
	}
	forged, err := unix.MemfdCreate("cudashare-sim-vmm-unsealed", unix.MFD_CLOEXEC)
	if err != nil {
		return -1, err
	}
	if err := unix.Ftruncate(forged, int64(header+size)); err != nil {
		syscall.Close(forged)
		return -1, err
	}
	if _, err := syscall.Pwrite(forged, hdr, 0); err != nil {
		syscall.Close(forged)
		return -1, err
	}
	return forged, nil
}

// offerThenRetire sends offers, waits until the consumer has released
// every one it took, retires allocation retire and waits for its closed.
func offerThenRetire(ctx context.Context, conn *transport.Conn, offers []transport.Offer, retire uint64) (RawReport, error) {
	var rep RawReport
	for i := range offers {
		if err := conn.SendOffer(ctx, &offers[i]); err != nil {
			return rep, err
		}
	}
	var m transport.Message
	for rep.Releases < len(offers) {
		if err := conn.Recv(ctx, &m); err != nil {
			return rep, err
		}
		if m.Kind == transport.KindRelease {
			rep.Releases += len(m.Seqs)
		}
	}
	if err := conn.SendRetire(ctx, retire); err != nil {
		return rep, err
	}
	for !rep.Closed {
		if err := conn.Recv(ctx, &m); err != nil {
			return rep, err
		}
		rep.Closed = m.Kind == transport.KindClosed && m.AllocID == retire
	}
	return rep, nil
}
