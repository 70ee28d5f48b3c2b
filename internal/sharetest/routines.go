//go:build linux

package sharetest

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/share"
	"github.com/seed743c36cf/cudashare/transport"
)

// Parameters of the child routines, passed as environment entries.
const (
	ParamPath      = "SHARE_PATH"          // socket path
	ParamDevice    = "SHARE_DEVICE"        // device ordinal of the child's context (0)
	ParamCredits   = "SHARE_CREDITS"       // consumer: credits (8)
	ParamHold      = "SHARE_HOLD"          // consumer: hold this many leases, print HELD, release on "release" (0)
	ParamSleep     = "SHARE_SLEEP_US"      // consumer: per lease; producer: per offer (0)
	ParamMax       = "SHARE_MAX"           // consumer: stop after this many leases (0: until the producer ends)
	ParamStream    = "SHARE_STREAM"        // "1": events and a stream
	ParamRing      = "SHARE_RING"          // producer: ring buffers (4)
	ParamSize      = "SHARE_SIZE"          // producer: buffer size (4096)
	ParamCount     = "SHARE_COUNT"         // producer: offers (0: until stdin closes)
	ParamConsumers = "SHARE_CONSUMERS"     // producer: consumers to wait for (1)
	ParamRetire    = "SHARE_RETIRE_AT"     // producer: retire the ring after this many offers, go on with a new one (0)
	ParamBroadcast = "SHARE_BROADCAST"     // producer: "1" broadcasts
	ParamVerify    = "SHARE_VERIFY"        // consumer: "0" skips reading back each lease's bytes
	ParamAfter     = "SHARE_RELEASE_AFTER" // consumer: "1" copies each lease on its stream, releases stream-ordered, then checks the copy
	ParamProfile   = "SHARE_CPUPROFILE"    // any child: write a CPU profile to this file
	ParamSharing   = "SHARE_SHARING"       // producer: "ipc", "vmm" or "auto" (auto)
	ParamLinger    = "SHARE_LINGER"        // consumer: "1": once its connection ends, stay (and keep what it mapped) until stdin closes
)

// ChildEnv is what a routine gets.
type ChildEnv struct {
	D   *driver.Driver
	Ctx *driver.Context
	In  *bufio.Reader
	Log *slog.Logger
}

var routines = map[string]func(*ChildEnv) error{
	"producer":    producer,
	"consumer":    consumer,
	"rawproducer": rawProducer,
	"rawconsumer": rawConsumer,
	"freeonbye":   freeOnGoodbye,
	"export":      exportHandle,
	"holder":      holder,
	"grabber":     grabber,
}

// Param returns the integer parameter name, or def.
func Param(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// Env returns "name=value" for Start.
func EnvParam(name string, value any) string { return fmt.Sprintf("%s=%v", name, value) }

func runChild(mode string) int {
	time.AfterFunc(childWatchdog, func() {
		fmt.Fprintln(os.Stderr, "child watchdog fired")
		os.Exit(3)
	})
	f, ok := routines[mode]
	if !ok {
		fmt.Printf("FAIL unknown routine %q\n", mode)
		return 2
	}
	if path := os.Getenv(ParamProfile); path != "" {
		if f, err := os.Create(path); err == nil {
			pprof.StartCPUProfile(f)
			defer func() { pprof.StopCPUProfile(); f.Close() }()
		}
	}
	err := func() error {
		d, err := driver.Open(driver.Config{})
		if err != nil {
			return err
		}
		dev, err := d.Device(Param(ParamDevice, 0))
		if err != nil {
			return err
		}
		ctx, err := dev.RetainPrimaryContext()
		if err != nil {
			return err
		}
		log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		err = f(&ChildEnv{D: d, Ctx: ctx, In: bufio.NewReader(os.Stdin), Log: log})
		return errors.Join(err, ctx.Close())
	}()
	if err != nil {
		fmt.Printf("FAIL %s: %v\n", mode, strings.ReplaceAll(err.Error(), "\n", "; "))
		return 1
	}
	return 0
}

func report(v any) {
	b, _ := json.Marshal(v)
	fmt.Printf("REPORT %s\n", b)
}

// waitLine reads stdin until a line equal to want, or EOF.
func (ce *ChildEnv) waitLine(want string) {
	for {
		line, err := ce.In.ReadString('\n')
		if strings.TrimSpace(line) == want || err != nil {
			return
		}
	}
}

// ProducerReport is what the producer routine reports.
type ProducerReport struct {
	Offers      int
	Stats       share.ExporterStats
	RetireErr   string
	ShutdownErr string
}

// producer offers ring buffers filled with Fill's pattern, numbered from
// 0, with their number as metadata; then shuts down. With ParamCount 0 it
// offers until stdin closes (or it is killed).
func producer(ce *ChildEnv) error {
	ctx := context.Background()
	sharing := share.SharingAuto
	if v := os.Getenv(ParamSharing); v != "" {
		var err error
		if sharing, err = share.ParseSharing(v); err != nil {
			return err
		}
	}
	e, err := share.NewExporter(ctx, ce.Ctx, os.Getenv(ParamPath), share.ExporterConfig{Logger: ce.Log, Sharing: sharing})
	if err != nil {
		return err
	}
	defer e.Close()
	fmt.Println("LISTENING")
	wctx, cancel := context.WithTimeout(ctx, ExpectTimeout)
	defer cancel()
	if err := e.WaitConsumers(wctx, Param(ParamConsumers, 1)); err != nil {
		return err
	}
	n, size := Param(ParamRing, 4), uint64(Param(ParamSize, 4096))
	count, retireAt := Param(ParamCount, 0), Param(ParamRetire, 0)
	sleep := time.Duration(Param(ParamSleep, 0)) * time.Microsecond
	broadcast := os.Getenv(ParamBroadcast) == "1"
	var opts share.OfferOptions
	if os.Getenv(ParamStream) == "1" {
		// A blocking stream: its work is ordered after work on the legacy NULL
		// stream, where Fill's and Check's synchronous copies run (a copy from
		// pageable memory may return before its DMA lands), so the event the
		// producer records on it, and the consumer's wait on it, order those
		// copies. A non-blocking stream lost the tail of a batch on an H200.
		s, err := ce.Ctx.NewStream(false)
		if err != nil {
			return err
		}
		defer s.Close()
		opts.Stream = s
	}
	ring, err := e.NewRing(n, size)
	if err != nil {
		return err
	}
	loop, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		io.Copy(io.Discard, ce.In)
		stop()
	}()
	var rep ProducerReport
	var retiring sync.WaitGroup
	for i := 0; count == 0 || i < count; i++ {
		// With a stream, consumers' stream-ordered releases are waited
		// for on it; without, on the host.
		b, err := ring.AcquireOn(loop, opts.Stream)
		if err != nil {
			if loop.Err() != nil {
				break
			}
			return err
		}
		if err := Fill(ce.Ctx, b.Ptr(), b.Size(), uint64(i)); err != nil {
			return err
		}
		opts.Meta = Meta(uint64(i))
		if broadcast {
			_, err = e.Broadcast(loop, b, opts)
		} else {
			err = e.Offer(loop, b, opts)
		}
		if err != nil {
			if loop.Err() != nil {
				break
			}
			return err
		}
		rep.Offers++
		if i == 0 {
			fmt.Println("OFFERED")
		}
		if retireAt > 0 && i+1 == retireAt {
			old := ring
			if ring, err = e.NewRing(n, size); err != nil {
				return err
			}
			retiring.Add(1)
			go func() {
				defer retiring.Done()
				if err := old.Retire(ctx); err != nil {
					rep.RetireErr = err.Error()
				}
			}()
			fmt.Println("RETIRING")
		}
		if sleep > 0 {
			time.Sleep(sleep)
		}
	}
	retiring.Wait()
	fmt.Println("DONE")
	sctx, cancel2 := context.WithTimeout(ctx, ExpectTimeout)
	defer cancel2()
	if err := e.Shutdown(sctx); err != nil {
		rep.ShutdownErr = err.Error()
	}
	rep.Stats = e.Stats()
	report(rep)
	return nil
}

// ConsumerReport is what the consumer routine reports.
type ConsumerReport struct {
	Leases         int
	Bad            []string // leases whose bytes were wrong
	Errors         []string // errors from Next other than the end
	Gone           string   // the ErrProducerGone that ended it, if not a goodbye
	EOF            bool     // the producer said goodbye
	Stats          share.ImporterStats
	Registry       share.RegistryStats // after Shutdown
	ShutdownErr    string
	AllocsPerLease float64
	CPUPerLease    float64 // nanoseconds of process CPU time (user and system) per lease
}

// consumer takes leases, checks their bytes against their metadata and
// releases them, until the producer ends or ParamMax leases; then shuts
// down and reports.
func consumer(ce *ChildEnv) error {
	ctx := context.Background()
	cfg := share.ImporterConfig{Credits: uint32(Param(ParamCredits, 8)), Logger: ce.Log}
	if os.Getenv(ParamStream) == "1" {
		// A blocking stream: its work is ordered after work on the legacy NULL
		// stream, where Fill's and Check's synchronous copies run (a copy from
		// pageable memory may return before its DMA lands), so the event the
		// producer records on it, and the consumer's wait on it, order those
		// copies. A non-blocking stream lost the tail of a batch on an H200.
		s, err := ce.Ctx.NewStream(false)
		if err != nil {
			return err
		}
		defer s.Close()
		cfg.Stream = s
	}
	dctx, cancel := context.WithTimeout(ctx, ExpectTimeout)
	defer cancel()
	im, err := share.Dial(dctx, os.Getenv(ParamPath), ce.Ctx, cfg)
	if err != nil {
		return err
	}
	defer im.Close()
	fmt.Println("CONNECTED")
	hold, max, verify := Param(ParamHold, 0), Param(ParamMax, 0), Param(ParamVerify, 1) != 0
	after := os.Getenv(ParamAfter) == "1"
	var busy, scratch driver.DevicePtr
	if after {
		if cfg.Stream == nil {
			return errors.New("SHARE_RELEASE_AFTER needs SHARE_STREAM=1")
		}
		var err error
		if ce.D.Backend() == driver.BackendSim {
			busySize = 64 << 10 // the sim's work is synchronous: delaying proves nothing
		}
		if busy, err = ce.Ctx.Alloc(busySize); err != nil {
			return err
		}
		defer ce.Ctx.Free(busy)
		if scratch, err = ce.Ctx.Alloc(1 << 20); err != nil {
			return err
		}
		defer ce.Ctx.Free(scratch)
	}
	sleep := time.Duration(Param(ParamSleep, 0)) * time.Microsecond
	var rep ConsumerReport
	var held []*share.Lease
	var ms runtime.MemStats
	var mallocs uint64
	var cpu0 time.Duration
	for {
		l, err := im.Next(ctx)
		if err != nil {
			switch {
			case errors.Is(err, io.EOF):
				rep.EOF = true
			case errors.Is(err, share.ErrProducerGone):
				rep.Gone = err.Error()
			default:
				rep.Errors = append(rep.Errors, err.Error())
				fmt.Printf("NEXTERR %v\n", err)
				if errors.Is(err, share.ErrPeerAccessUnsupported) && errors.Is(err, driver.ErrPeerAccessUnsupported) {
					fmt.Printf("PEERERR %v\n", err)
				}
				continue
			}
			break
		}
		rep.Leases++
		if rep.Leases == 1 {
			runtime.ReadMemStats(&ms)
			mallocs = ms.Mallocs
			cpu0 = CPUTime()
		}
		n, ok := ParseMeta(l.Meta())
		if !ok {
			rep.Bad = append(rep.Bad, fmt.Sprintf("lease %d: metadata %x", l.Seq(), l.Meta()))
		} else if verify {
			if err := Check(ce.Ctx, l.Ptr(), l.Size(), n); err != nil {
				rep.Bad = append(rep.Bad, err.Error())
			}
		}
		if sleep > 0 {
			time.Sleep(sleep)
		}
		if after {
			// The copy runs after busy work on the stream, so that a
			// producer that did not wait for it would overwrite the
			// buffer first; the check of the copy would then fail.
			if err := releaseAfterCopy(ce.Ctx, l, busy, scratch, n, &rep); err != nil {
				return err
			}
			if max > 0 && rep.Leases >= max {
				break
			}
			continue
		}
		if len(held) < hold {
			held = append(held, l)
			if len(held) == hold {
				fmt.Printf("HELD %d\n", hold)
				ce.waitLine("release")
				for _, h := range held {
					h.Release()
				}
				fmt.Println("RELEASED")
				hold = 0
			}
			continue
		}
		l.Release()
		if max > 0 && rep.Leases >= max {
			break
		}
	}
	if Param(ParamLinger, 0) == 1 {
		// A process that outlives its connection, as a lost consumer
		// that may still read what it mapped does, until the test ends.
		io.Copy(io.Discard, ce.In)
	}
	if rep.Leases > 1 {
		runtime.ReadMemStats(&ms)
		rep.AllocsPerLease = float64(ms.Mallocs-mallocs) / float64(rep.Leases-1)
		rep.CPUPerLease = float64(CPUTime()-cpu0) / float64(rep.Leases-1)
	}
	for _, h := range held {
		h.Release()
	}
	sctx, cancel2 := context.WithTimeout(ctx, ExpectTimeout)
	defer cancel2()
	if err := im.Shutdown(sctx); err != nil {
		rep.ShutdownErr = err.Error()
	}
	rep.Stats = im.Stats()
	rep.Registry = im.Registry().Stats()
	report(rep)
	return nil
}

// RawReport is what the raw producer reports.
type RawReport struct {
	Releases int
	Closed   bool
	FreeErr  string
}

// rawProducer speaks the protocol by hand to offer what share.Exporter
// never would: the handle of allocation 1 under allocation id 2 (a handle
// that names another allocation than the one mapped under it), and
// allocation 1 under another handle. Then it retires allocation 1, waits
// for closed, and frees it: the free must not be early.
func rawProducer(ce *ChildEnv) error {
	ctx, cancel := context.WithTimeout(context.Background(), ExpectTimeout)
	defer cancel()
	dev := ce.Ctx.Device().UUID()
	cfg := transport.DefaultConfig(transport.RoleProducer)
	cfg.Devices = []transport.UUID{dev}
	ln, err := transport.Listen(ctx, os.Getenv(ParamPath), cfg)
	if err != nil {
		return err
	}
	defer ln.Close()
	fmt.Println("LISTENING")
	conn, err := ln.Accept(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	const size = 1 << 20
	p, err := ce.Ctx.Alloc(size)
	if err != nil {
		return err
	}
	h, err := ce.Ctx.IpcGetMemHandle(p)
	if err != nil {
		return err
	}
	if err := Fill(ce.Ctx, p, 4096, 7); err != nil {
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
		o.AllocSize, o.Size, o.Device, o.Meta = size, 4096, dev, Meta(7)
		if err := conn.SendOffer(ctx, o); err != nil {
			return err
		}
	}
	var rep RawReport
	var m transport.Message
	for rep.Releases < len(offers) {
		if err := conn.Recv(ctx, &m); err != nil {
			return err
		}
		if m.Kind == transport.KindRelease {
			rep.Releases += len(m.Seqs)
		}
	}
	if err := conn.SendRetire(ctx, 1); err != nil {
		return err
	}
	for !rep.Closed {
		if err := conn.Recv(ctx, &m); err != nil {
			return err
		}
		rep.Closed = m.Kind == transport.KindClosed && m.AllocID == 1
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
	const size = 1 << 20
	p, err := ce.Ctx.Alloc(size)
	if err != nil {
		return err
	}
	h, err := ce.Ctx.IpcGetMemHandle(p)
	if err != nil {
		return err
	}
	fmt.Printf("HANDLE %s %d\n", hex.EncodeToString(h[:]), size)
	io.Copy(io.Discard, ce.In)
	return ce.Ctx.Free(p)
}

// rawConsumer is a consumer on the bare transport, which can do what the
// Importer never does. It takes ParamHold offers (1), mapping the first
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
	cfg.AcceptFDs = true
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
			if m.Offer.HandleKind == transport.HandleFD {
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
// offer and hanging up without a goodbye or a release: what it was lent
// stays leased while it lives, as it may map it. It prints GRABBED n (the
// offers it got), then waits for "exit".
func grabber(ce *ChildEnv) error {
	cfg := transport.DefaultConfig(transport.RoleConsumer)
	cfg.Devices = []transport.UUID{ce.Ctx.Device().UUID()}
	cfg.Credits = 1
	cfg.AcceptFDs = true
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
					if m.Offer.HandleKind == transport.HandleFD {
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

// busySize is the memset that delays a stream-ordered consumer's copy.
var busySize uint64 = 64 << 20

// releaseAfterCopy queues, on the lease's stream, busy work and then a copy
// of the lease into scratch, releases the lease stream-ordered, and checks
// the copy once the stream is done: it holds batch n's bytes only if the
// producer waited for the copy before it wrote the buffer again.
func releaseAfterCopy(ctx *driver.Context, l *share.Lease, busy, scratch driver.DevicePtr, n uint64, rep *ConsumerReport) error {
	s := l.Stream()
	if s == nil {
		return errors.New("a lease without a stream")
	}
	size := min(l.Size(), 1<<20)
	if err := ctx.MemsetAsync(busy, byte(n), busySize, s); err != nil {
		return err
	}
	if err := ctx.CopyDtoDAsync(scratch, l.Ptr(), size, s); err != nil {
		return err
	}
	if err := l.ReleaseAfter(s); err != nil {
		return err
	}
	if err := s.Synchronize(); err != nil {
		return err
	}
	if err := Check(ctx, scratch, size, n); err != nil {
		rep.Bad = append(rep.Bad, "after a stream-ordered release: "+err.Error())
	}
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

// CPUTime is the CPU time (user and system) this process has used.
func CPUTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
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
	dev := ce.Ctx.Device().UUID()
	cfg := transport.DefaultConfig(transport.RoleProducer)
	cfg.Devices = []transport.UUID{dev}
	ln, err := transport.Listen(ctx, os.Getenv(ParamPath), cfg)
	if err != nil {
		return err
	}
	defer ln.Close()
	fmt.Println("LISTENING")
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
	const size = 1 << 20
	p, err := ce.Ctx.Alloc(size)
	if err != nil {
		return err
	}
	h, err := ce.Ctx.IpcGetMemHandle(p)
	if err != nil {
		return err
	}
	if err := Fill(ce.Ctx, p, 4096, 1); err != nil {
		return err
	}
	o := transport.Offer{Seq: 1, AllocID: 1, Handle: transport.Handle(h), AllocSize: size, Size: 4096, Device: dev, Meta: Meta(1)}
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

// vmmImport is a posix_fd allocation imported and mapped by hand.
type vmmImport struct {
	a *driver.Allocation
	m *driver.Mapping
}

func importFD(ctx *driver.Context, o transport.Offer) (*vmmImport, error) {
	if len(o.FDs) != 1 {
		return nil, fmt.Errorf("first offer of posix_fd allocation %d with %d descriptors", o.AllocID, len(o.FDs))
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
