// Command vmmcost measures what sharing one allocation costs on each of
// cudashare's two paths, legacy CUDA IPC and VMM allocations exported as
// file descriptors, on whatever driver is loaded (a GPU, else the
// simulator; CUDASHARE_DRIVER overrides it):
//
//	op      ipc                               vmm
//	alloc   cuMemAlloc                        cuMemCreate (exportable) + reserve, map, set access
//	export  cuIpcGetMemHandle                 cuMemExportToShareableHandle (a POSIX fd)
//	import  cuIpcOpenMemHandle (child)        cuMemImportFromShareableHandle (child)
//	map     -                                 reserve, map, set access (child)
//	open    import (child)                    import + map (child): what a consumer pays
//	close   cuIpcCloseMemHandle (child)       unmap + release (child)
//	free    cuMemFree                         unmap + release
//
// The import side runs in a second process, this program re-executed, on
// -consumer-device; handles go over a Unix socketpair, the fd with
// SCM_RIGHTS, as cudashare sends it. Each rep allocates, exports, has the
// child open and close, and frees, for each size in -sizes (default the
// allocations of the benchmark's rows: a ring of 8 x 1 MiB is one 8 MiB
// allocation, an arena of 8 x 64 MiB one of 512 MiB).
//
// Then the first offer through cudashare, for a ring of 8 x 1 MiB and an
// arena of 8 x 64 MiB, each path: an exporter forced to the path makes the
// ring or arena (setup), a fresh consumer process dials and takes two leases;
// it reports dial (Dial returned) and first_lease and second_lease (Next
// returned), each from the start of Dial; the producer reports its first
// and second Offer (the first to a consumer carries the allocation: for
// VMM, its fd).
//
// One JSON line per measurement (row cost-PATH-OP-SIZE or
// first-offer-PATH-ring|arena-METRIC): n, median_us, min_us, max_us,
// first_us (the first rep, which may pay one-time costs), or error. A
// failing measurement does not stop the others; exit 1 if any failed, 3
// if there is no driver.
//
//	vmmcost -reps 10 -first-reps 3
//	vmmcost -device 0 -consumer-device 1
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/share"
)

const childEnv = "VMMCOST_CHILD"

type line struct {
	Impl           string  `json:"impl"`
	Row            string  `json:"row"`
	Driver         string  `json:"driver"`
	Path           string  `json:"path"`
	Op             string  `json:"op"`
	What           string  `json:"what"`
	Size           uint64  `json:"size"`
	Device         int     `json:"device"`
	ConsumerDevice int     `json:"consumer_device"`
	N              int     `json:"n"`
	Median         float64 `json:"median_us"`
	Min            float64 `json:"min_us"`
	Max            float64 `json:"max_us"`
	First          float64 `json:"first_us"`
	Error          string  `json:"error,omitempty"`
}

var (
	backendName string
	dev, cdev   int
	failed      int
	enc         = json.NewEncoder(os.Stdout)
)

func emit(path, op, what string, size uint64, samples []time.Duration, err error) {
	l := line{Impl: "vmmcost", Driver: backendName, Path: path, Op: op, What: what, Size: size,
		Device: dev, ConsumerDevice: cdev, N: len(samples)}
	l.Row = fmt.Sprintf("cost-%s-%s-%s", path, op, sizeName(size))
	if strings.HasPrefix(op, "first-offer") {
		l.Row = strings.Replace(op, "first-offer", "first-offer-"+path, 1)
	}
	if len(samples) > 0 {
		us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
		l.First = us(samples[0])
		s := append([]time.Duration(nil), samples...)
		sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
		l.Min, l.Max, l.Median = us(s[0]), us(s[len(s)-1]), us(s[len(s)/2])
	}
	if err != nil {
		l.Error = err.Error()
		failed++
	} else if len(samples) == 0 {
		l.Error = "no samples"
		failed++
	}
	enc.Encode(l)
}

func main() {
	switch os.Getenv(childEnv) {
	case "import":
		os.Exit(childImport())
	case "first":
		os.Exit(childFirst())
	}
	flag.IntVar(&dev, "device", 0, "GPU of the exporter")
	flag.IntVar(&cdev, "consumer-device", -1, "GPU of the importing process (default: -device)")
	reps := flag.Int("reps", 10, "reps of each cost measurement")
	firstReps := flag.Int("first-reps", 3, "reps of each first-offer measurement (a consumer process each)")
	sizesS := flag.String("sizes", "8MiB,512MiB", "allocation sizes, comma-separated")
	pathsS := flag.String("paths", "ipc,vmm", "sharing paths, comma-separated")
	timeout := flag.Duration("timeout", 3*time.Minute, "give up on the whole run after this long")
	flag.Parse()
	if cdev < 0 {
		cdev = dev
	}
	d, err := driver.Open(driver.Config{Backend: driver.BackendAuto})
	if err != nil {
		fmt.Fprintln(os.Stderr, "vmmcost:", err)
		enc.Encode(map[string]any{"impl": "vmmcost", "row": "vmmcost", "skipped": "no driver: " + err.Error()})
		os.Exit(3)
	}
	backendName = d.Backend()
	fmt.Fprintf(os.Stderr, "vmmcost: driver %s (%s)\n", backendName, d.Reason())
	device, err := d.Device(dev)
	if err != nil {
		fmt.Fprintln(os.Stderr, "vmmcost:", err)
		os.Exit(3)
	}
	dctx, err := device.RetainPrimaryContext()
	if err != nil {
		fmt.Fprintln(os.Stderr, "vmmcost:", err)
		os.Exit(1)
	}
	defer dctx.Close()
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()

	var sizes []uint64
	for _, s := range strings.Split(*sizesS, ",") {
		n, err := parseSize(s)
		if err != nil {
			fmt.Fprintln(os.Stderr, "vmmcost: -sizes:", err)
			os.Exit(2)
		}
		sizes = append(sizes, n)
	}
	paths := strings.Split(*pathsS, ",")
	for _, p := range paths {
		if p != "ipc" && p != "vmm" {
			fmt.Fprintf(os.Stderr, "vmmcost: -paths: %q is neither ipc nor vmm\n", p)
			os.Exit(2)
		}
	}
	if vs, err := device.VMMSupport(); err != nil || !vs.PosixFD {
		fmt.Fprintf(os.Stderr, "vmmcost: device %d: VMM POSIX-fd support %+v (%v): the vmm rows will fail\n", dev, vs, err)
	}

	for _, p := range paths {
		for _, sz := range sizes {
			costs(ctx, dctx, p, sz, *reps)
		}
	}
	for _, p := range paths {
		firstOffer(ctx, dctx, p, "ring", *firstReps)
		firstOffer(ctx, dctx, p, "arena", *firstReps)
	}
	if failed > 0 {
		fmt.Fprintf(os.Stderr, "vmmcost: %d measurement(s) failed\n", failed)
		os.Exit(1)
	}
}

// --- allocation, export, import, close, free ---

type request struct {
	Path   string `json:"path"`
	Size   uint64 `json:"size"`
	Handle []byte `json:"handle,omitempty"`
	Quit   bool   `json:"quit,omitempty"`
}

type reply struct {
	Import int64  `json:"import_ns"`
	Map    int64  `json:"map_ns"`
	Close  int64  `json:"close_ns"`
	Error  string `json:"error,omitempty"`
}

// child starts this program as a child of kind with one end of a
// SOCK_SEQPACKET socketpair as its fd 3, returning the other end.
func startChild(ctx context.Context, kind string, args ...string) (*exec.Cmd, int, error) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_SEQPACKET|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, -1, err
	}
	exe, err := os.Executable()
	if err != nil {
		syscall.Close(fds[0])
		syscall.Close(fds[1])
		return nil, -1, err
	}
	cmd := exec.CommandContext(ctx, exe, args...)
	cmd.Env = append(os.Environ(), childEnv+"="+kind, fmt.Sprintf("VMMCOST_DEVICE=%d", cdev))
	cmd.Stderr = os.Stderr
	theirs := os.NewFile(uintptr(fds[1]), "child")
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		theirs.Close()
		syscall.Close(fds[0])
		return nil, -1, err
	}
	theirs.Close()
	return cmd, fds[0], nil
}

func costs(ctx context.Context, dctx *driver.Context, path string, size uint64, reps int) {
	var alloc, mapT, export, imp, cmap, open, cls, free []time.Duration
	what := map[string]string{}
	if path == "ipc" {
		what = map[string]string{"alloc": "cuMemAlloc", "export": "cuIpcGetMemHandle",
			"import": "cuIpcOpenMemHandle, other process", "open": "what a consumer pays to open: import",
			"close": "cuIpcCloseMemHandle, other process", "free": "cuMemFree"}
	} else {
		what = map[string]string{"alloc": "cuMemCreate + reserve, map, set access",
			"map":    "reserve, map, set access (exporter)",
			"export": "cuMemExportToShareableHandle (fd)", "import": "cuMemImportFromShareableHandle, other process",
			"cmap": "reserve, map, set access, other process", "open": "what a consumer pays to open: import + map",
			"close": "unmap + release, other process", "free": "unmap + release"}
	}
	out := func(err error) {
		emit(path, "alloc", what["alloc"], size, alloc, err)
		if path == "vmm" {
			emit(path, "map", what["map"], size, mapT, err)
		}
		emit(path, "export", what["export"], size, export, err)
		emit(path, "import", what["import"], size, imp, err)
		if path == "vmm" {
			emit(path, "consumer-map", what["cmap"], size, cmap, err)
		}
		emit(path, "open", what["open"], size, open, err)
		emit(path, "close", what["close"], size, cls, err)
		emit(path, "free", what["free"], size, free, err)
	}
	cctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	cmd, sock, err := startChild(cctx, "import")
	if err != nil {
		out(fmt.Errorf("starting the importing process: %w", err))
		return
	}
	defer func() {
		b, _ := json.Marshal(request{Quit: true})
		sendmsg(sock, b, nil)
		syscall.Close(sock)
		cmd.Wait()
	}()
	var firstErr error
	for i := 0; i < reps && cctx.Err() == nil; i++ {
		var req request
		var fd = -1
		var release func() error
		req.Path, req.Size = path, size
		t0 := time.Now()
		if path == "ipc" {
			p, err := dctx.Alloc(size)
			if err != nil {
				firstErr = fmt.Errorf("cuMemAlloc: %w", err)
				break
			}
			t1 := time.Now()
			h, err := dctx.IpcGetMemHandle(p)
			t2 := time.Now()
			if err != nil {
				dctx.Free(p)
				firstErr = fmt.Errorf("cuIpcGetMemHandle: %w", err)
				break
			}
			alloc, export = append(alloc, t1.Sub(t0)), append(export, t2.Sub(t1))
			req.Handle = h[:]
			release = func() error { return dctx.Free(p) }
		} else {
			a, err := dctx.MemCreate(size, driver.MemCreateOptions{Exportable: true})
			if err != nil {
				firstErr = fmt.Errorf("cuMemCreate: %w", err)
				break
			}
			tc := time.Now()
			m, err := dctx.Map(a)
			if err != nil {
				a.Close()
				firstErr = fmt.Errorf("map: %w", err)
				break
			}
			t1 := time.Now()
			f, err := a.ExportFD()
			t2 := time.Now()
			if err != nil {
				m.Close()
				a.Close()
				firstErr = fmt.Errorf("cuMemExportToShareableHandle: %w", err)
				break
			}
			alloc, mapT, export = append(alloc, t1.Sub(t0)), append(mapT, t1.Sub(tc)), append(export, t2.Sub(t1))
			fd = int(f.Fd())
			release = func() error {
				f.Close()
				e1 := m.Close()
				e2 := a.Close()
				return errors.Join(e1, e2)
			}
		}
		b, _ := json.Marshal(req)
		var oob []byte
		if fd >= 0 {
			oob = syscall.UnixRights(fd)
		}
		rp, err := roundTrip(cctx, sock, b, oob)
		if err == nil && rp.Error != "" {
			err = errors.New(rp.Error)
		}
		tf := time.Now()
		ferr := release()
		if err == nil {
			free = append(free, time.Since(tf))
		}
		if err != nil || ferr != nil {
			firstErr = errors.Join(err, ferr)
			break
		}
		imp = append(imp, time.Duration(rp.Import))
		cmap = append(cmap, time.Duration(rp.Map))
		open = append(open, time.Duration(rp.Import+rp.Map))
		cls = append(cls, time.Duration(rp.Close))
	}
	if firstErr == nil && cctx.Err() != nil {
		firstErr = fmt.Errorf("timed out: %w", cctx.Err())
	}
	out(firstErr)
}

func roundTrip(ctx context.Context, sock int, b, oob []byte) (reply, error) {
	var rp reply
	if err := sendmsg(sock, b, oob); err != nil {
		return rp, fmt.Errorf("send to the importing process: %w", err)
	}
	dl := time.Now().Add(60 * time.Second)
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	tv := syscall.NsecToTimeval(time.Until(dl).Nanoseconds())
	syscall.SetsockoptTimeval(sock, syscall.SOL_SOCKET, syscall.SO_RCVTIMEO, &tv)
	buf := make([]byte, 4096)
	n, _, err := recvmsg(sock, buf, nil, 0)
	if err != nil {
		return rp, fmt.Errorf("reply of the importing process: %w", err)
	}
	if n == 0 {
		return rp, errors.New("the importing process went away (see its stderr)")
	}
	if err := json.Unmarshal(buf[:n], &rp); err != nil {
		return rp, fmt.Errorf("reply of the importing process: %w", err)
	}
	return rp, nil
}

func childDevice() (*driver.Context, error) {
	n, _ := strconv.Atoi(os.Getenv("VMMCOST_DEVICE"))
	d, err := driver.Open(driver.Config{Backend: driver.BackendAuto})
	if err != nil {
		return nil, err
	}
	device, err := d.Device(n)
	if err != nil {
		return nil, err
	}
	return device.RetainPrimaryContext()
}

func childImport() int {
	dctx, err := childDevice()
	if err != nil {
		fmt.Fprintln(os.Stderr, "vmmcost child:", err)
		return 1
	}
	defer dctx.Close()
	sock := 3
	buf := make([]byte, 4096)
	oob := make([]byte, syscall.CmsgSpace(4*4))
	for {
		n, oobn, err := recvmsg(sock, buf, oob, syscall.MSG_CMSG_CLOEXEC)
		if err != nil || n == 0 {
			return 0
		}
		var fds []int
		if msgs, err := syscall.ParseSocketControlMessage(oob[:oobn]); err == nil {
			for _, m := range msgs {
				if f, err := syscall.ParseUnixRights(&m); err == nil {
					fds = append(fds, f...)
				}
			}
		}
		var req request
		var rp reply
		if err := json.Unmarshal(buf[:n], &req); err != nil {
			rp.Error = "child: " + err.Error()
		} else if req.Quit {
			return 0
		} else {
			rp = importOnce(dctx, req, fds)
		}
		for _, fd := range fds {
			syscall.Close(fd)
		}
		b, _ := json.Marshal(rp)
		if err := sendmsg(sock, b, nil); err != nil {
			return 1
		}
	}
}

func importOnce(dctx *driver.Context, req request, fds []int) (rp reply) {
	if req.Path == "ipc" {
		var h driver.IpcMemHandle
		copy(h[:], req.Handle)
		t0 := time.Now()
		p, err := dctx.IpcOpenMemHandle(h)
		rp.Import = int64(time.Since(t0))
		if err != nil {
			rp.Error = "cuIpcOpenMemHandle in the other process: " + err.Error()
			return
		}
		t1 := time.Now()
		if err := dctx.IpcCloseMemHandle(p); err != nil {
			rp.Error = "cuIpcCloseMemHandle in the other process: " + err.Error()
		}
		rp.Close = int64(time.Since(t1))
		return
	}
	if len(fds) != 1 {
		rp.Error = fmt.Sprintf("child: %d fds received, want 1", len(fds))
		return
	}
	t0 := time.Now()
	a, err := dctx.ImportFD(fds[0], req.Size)
	t1 := time.Now()
	rp.Import = int64(t1.Sub(t0))
	if err != nil {
		rp.Error = "cuMemImportFromShareableHandle in the other process: " + err.Error()
		return
	}
	m, err := dctx.Map(a)
	rp.Map = int64(time.Since(t1))
	if err != nil {
		a.Close()
		rp.Error = "map in the other process: " + err.Error()
		return
	}
	t2 := time.Now()
	e1 := m.Close()
	e2 := a.Close()
	rp.Close = int64(time.Since(t2))
	if err := errors.Join(e1, e2); err != nil {
		rp.Error = "unmap + release in the other process: " + err.Error()
	}
	return
}

// --- the first offer through cudashare ---

type firstReport struct {
	Dial   int64  `json:"dial_ns"`
	First  int64  `json:"first_lease_ns"`
	Second int64  `json:"second_lease_ns"`
	Error  string `json:"error,omitempty"`
}

func firstOffer(ctx context.Context, dctx *driver.Context, path, kind string, reps int) {
	var setup, offer1, offer2, dial, first, second []time.Duration
	size := uint64(1 << 20)
	if kind == "arena" {
		size = 64 << 20
	}
	var firstErr error
	for i := 0; i < reps && ctx.Err() == nil && firstErr == nil; i++ {
		s, o1, o2, rep, err := firstOfferOnce(ctx, dctx, path, kind, size)
		if err != nil {
			firstErr = err
			break
		}
		setup, offer1, offer2 = append(setup, s), append(offer1, o1), append(offer2, o2)
		dial = append(dial, time.Duration(rep.Dial))
		first = append(first, time.Duration(rep.First))
		second = append(second, time.Duration(rep.Second))
	}
	if firstErr == nil && ctx.Err() != nil {
		firstErr = fmt.Errorf("timed out: %w", ctx.Err())
	}
	kindWhat := "ring of 8 x 1 MiB"
	newWhat := "NewRing(8, 1 MiB)"
	if kind == "arena" {
		kindWhat, newWhat = "arena of 8 x 64 MiB", "NewArena(512 MiB)"
	}
	p := "first-offer-" + kind
	emit(path, p+"-setup", kindWhat+": "+newWhat+" (allocate, prepare sharing)", size*8, setup, firstErr)
	emit(path, p+"-dial", kindWhat+": consumer's Dial, returned", size, dial, firstErr)
	emit(path, p+"-first-lease", kindWhat+": consumer's first lease, from the start of Dial", size, first, firstErr)
	emit(path, p+"-second-lease", kindWhat+": consumer's second lease, from the start of Dial", size, second, firstErr)
	emit(path, p+"-offer1", kindWhat+": producer's first Offer to the consumer (carries the allocation)", size, offer1, firstErr)
	emit(path, p+"-offer2", kindWhat+": producer's second Offer, same allocation", size, offer2, firstErr)
}

func firstOfferOnce(ctx context.Context, dctx *driver.Context, path, kind string, size uint64) (setup, o1, o2 time.Duration, rep firstReport, err error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	dir, err := os.MkdirTemp("", "vmmcost")
	if err != nil {
		return
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "s")
	sh, err := share.ParseSharing(path)
	if err != nil {
		return
	}
	e, err := share.NewExporter(ctx, dctx, sock, share.ExporterConfig{Sharing: sh})
	if err != nil {
		err = fmt.Errorf("NewExporter: %w", err)
		return
	}
	defer e.Close()
	if got, why := e.Sharing(); got.String() != path {
		err = fmt.Errorf("asked for %s sharing, got %s: %s", path, got, why)
		return
	}
	t0 := time.Now()
	var take func() (*share.Buffer, error)
	var retire func() error
	if kind == "ring" {
		r, rerr := e.NewRing(8, size)
		if rerr != nil {
			err = fmt.Errorf("NewRing: %w", rerr)
			return
		}
		take = func() (*share.Buffer, error) { return r.Acquire(ctx) }
		retire = func() error { return r.Retire(ctx) }
	} else {
		a, aerr := e.NewArena(8 * size)
		if aerr != nil {
			err = fmt.Errorf("NewArena: %w", aerr)
			return
		}
		take = func() (*share.Buffer, error) { return a.Alloc(ctx, size) }
		retire = func() error { return a.Retire(ctx) }
	}
	setup = time.Since(t0)
	cmd := exec.CommandContext(ctx, mustExe(), sock)
	cmd.Env = append(os.Environ(), childEnv+"=first", fmt.Sprintf("VMMCOST_DEVICE=%d", cdev))
	cmd.Stderr = os.Stderr
	var out strings.Builder
	cmd.Stdout = &out
	cmd.WaitDelay = 5 * time.Second
	if err = cmd.Start(); err != nil {
		return
	}
	defer func() {
		werr := cmd.Wait()
		if err == nil {
			if werr != nil {
				err = fmt.Errorf("consumer process: %w", werr)
			} else if jerr := json.Unmarshal([]byte(strings.TrimSpace(out.String())), &rep); jerr != nil {
				err = fmt.Errorf("consumer process's report %q: %w", out.String(), jerr)
			} else if rep.Error != "" {
				err = errors.New(rep.Error)
			}
		}
		if err == nil {
			sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer scancel()
			if rerr := retire(); rerr != nil {
				err = fmt.Errorf("retire: %w", rerr)
			} else if serr := e.Shutdown(sctx); serr != nil {
				err = fmt.Errorf("shutdown: %w", serr)
			}
		}
	}()
	if err = e.WaitConsumers(ctx, 1); err != nil {
		return
	}
	for i := 0; i < 2; i++ {
		b, terr := take()
		if terr != nil {
			err = fmt.Errorf("buffer %d: %w", i, terr)
			return
		}
		t := time.Now()
		if err = e.Offer(ctx, b, share.OfferOptions{}); err != nil {
			return
		}
		if i == 0 {
			o1 = time.Since(t)
		} else {
			o2 = time.Since(t)
		}
	}
	return
}

func mustExe() string {
	exe, err := os.Executable()
	if err != nil {
		return os.Args[0]
	}
	return exe
}

func childFirst() int {
	var rep firstReport
	defer func() { json.NewEncoder(os.Stdout).Encode(rep) }()
	if len(os.Args) < 2 {
		rep.Error = "child: no socket"
		return 1
	}
	dctx, err := childDevice()
	if err != nil {
		rep.Error = "consumer process: " + err.Error()
		return 1
	}
	defer dctx.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	t0 := time.Now()
	im, err := share.Dial(ctx, os.Args[1], dctx, share.ImporterConfig{Credits: 8, DialWait: 10 * time.Second})
	rep.Dial = int64(time.Since(t0))
	if err != nil {
		rep.Error = "Dial: " + err.Error()
		return 1
	}
	defer im.Close()
	var leases []*share.Lease
	for i := 0; i < 2; i++ {
		l, err := im.Next(ctx)
		if err != nil {
			rep.Error = fmt.Sprintf("lease %d: %v", i+1, err)
			return 1
		}
		if i == 0 {
			rep.First = int64(time.Since(t0))
		} else {
			rep.Second = int64(time.Since(t0))
		}
		leases = append(leases, l)
	}
	for _, l := range leases {
		l.Release()
	}
	sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer scancel()
	if err := im.Shutdown(sctx); err != nil && !errors.Is(err, share.ErrClosed) {
		rep.Error = "Shutdown: " + err.Error()
		return 1
	}
	return 0
}

func parseSize(s string) (uint64, error) {
	m := regexp.MustCompile(`^(\d+)\s*([KMGkmg]?)(i?[Bb]?)$`).FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return 0, fmt.Errorf("size %q", s)
	}
	n, err := strconv.ParseUint(m[1], 10, 64)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("size %q", s)
	}
	return n << map[string]uint{"": 0, "k": 10, "m": 20, "g": 30}[strings.ToLower(m[2])], nil
}

func sizeName(n uint64) string {
	for _, u := range []struct {
		shift uint
		name  string
	}{{30, "GiB"}, {20, "MiB"}, {10, "KiB"}} {
		if n >= 1<<u.shift && n%(1<<u.shift) == 0 {
			return fmt.Sprintf("%d%s", n>>u.shift, u.name)
		}
	}
	return fmt.Sprintf("%dB", n)
}

// recvmsg and sendmsg retry what a signal interrupted: the Go runtime
// preempts goroutines with signals, and the raw calls on this blocking
// socket do not restart by themselves.
func recvmsg(sock int, p, oob []byte, flags int) (n, oobn int, err error) {
	for {
		n, oobn, _, _, err = syscall.Recvmsg(sock, p, oob, flags)
		if err != syscall.EINTR {
			return n, oobn, err
		}
	}
}

func sendmsg(sock int, p, oob []byte) error {
	for {
		if err := syscall.Sendmsg(sock, p, oob, nil, 0); err != syscall.EINTR {
			return err
		}
	}
}
