package sim

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Helper processes: the test binary run again with envHelper naming a
// routine. A helper talks in lines: it writes "<word> <details>" to stdout
// and reads commands from stdin; "fail <why>" ends it. Both sides have a
// watchdog, so a hung helper fails the test instead of hanging it.
const (
	envHelper       = "CUDASHARE_SIM_TEST_HELPER"
	envHelperHandle = "CUDASHARE_SIM_TEST_HANDLE"
	envHelperDev    = "CUDASHARE_SIM_TEST_DEVICE"
	envHelperSize   = "CUDASHARE_SIM_TEST_SIZE"
	helperWatchdog  = 30 * time.Second
	replyTimeout    = 20 * time.Second
)

type child struct {
	t      *testing.T
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	stderr bytes.Buffer
	exited bool
}

// startHelper runs helper routine name on the machine in dir. The parent's
// own sim settings are not inherited; env adds the child's.
func startHelper(t *testing.T, name, dir string, env ...string) *child {
	t.Helper()
	return startHelperFiles(t, name, dir, nil, env...)
}

// startHelperFiles is startHelper with files passed to the child as its
// descriptors 3, 4 and so on.
func startHelperFiles(t *testing.T, name, dir string, files []*os.File, env ...string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.ExtraFiles = files
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); k != EnvDir && k != EnvTopology && k != EnvVisible && k != "GORACE" {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	// A race-enabled helper would sleep a second before exiting.
	cmd.Env = append(cmd.Env, envHelper+"="+name, EnvDir+"="+dir, "GORACE="+os.Getenv("GORACE")+" atexit_sleep_ms=0")
	cmd.Env = append(cmd.Env, env...)
	c := &child{t: t, cmd: cmd, lines: make(chan string, 16)}
	cmd.Stderr = &c.stderr
	var err error
	if c.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(c.lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		if !c.exited {
			_ = cmd.Process.Kill()
			c.wait()
		}
	})
	return c
}

// expect returns the details of the helper's next line, which must start
// with word.
func (c *child) expect(word string) string {
	c.t.Helper()
	select {
	case l, open := <-c.lines:
		if !open {
			c.t.Fatalf("helper exited before %q; stderr:\n%s", word, c.stderr.String())
		}
		got, rest, _ := strings.Cut(l, " ")
		if got != word {
			c.t.Fatalf("helper said %q, want %q", l, word)
		}
		return rest
	case <-time.After(replyTimeout):
		c.t.Fatalf("helper silent for %v waiting for %q", replyTimeout, word)
	}
	return ""
}

func (c *child) send(cmd string) {
	c.t.Helper()
	if _, err := io.WriteString(c.stdin, cmd+"\n"); err != nil {
		c.t.Fatalf("send %q: %v", cmd, err)
	}
}

// wait reaps the helper: drain its output, then Wait.
func (c *child) wait() error {
	timeout := time.After(replyTimeout)
	for open := true; open; {
		select {
		case _, open = <-c.lines:
		case <-timeout:
			_ = c.cmd.Process.Kill()
			timeout = nil
		}
	}
	c.exited = true
	_ = c.stdin.Close()
	return c.cmd.Wait()
}

func (c *child) finish() {
	c.t.Helper()
	c.send("exit")
	if err := c.wait(); err != nil {
		c.t.Fatalf("helper: %v; stderr:\n%s", err, c.stderr.String())
	}
}

func handleHex(h api.IpcMemHandle) string { return hex.EncodeToString(h.Reserved[:]) }

// TestProcessShare: a child maps the parent's allocation; bytes go both
// ways; after the child closes, the parent frees.
func TestProcessShare(t *testing.T) {
	lockThread(t)
	dir := t.TempDir()
	d := newDriver(t, Config{Dir: dir})
	primary(t, d, 0)
	p := alloc(t, d, 1<<20)
	pattern := make([]byte, 256)
	for i := range pattern {
		pattern[i] = byte(i * 7)
	}
	write(t, d, p, pattern)
	c := startHelper(t, "hold", dir, envHelperHandle+"="+handleHex(exportHandle(t, d, p)))
	c.expect("info")
	if got := c.expect("opened"); got != "0 "+hex.EncodeToString(pattern) {
		t.Fatalf("child read %q", got)
	}
	c.send("write")
	c.expect("wrote")
	if got := read(t, d, p+1000, 14); string(got) != "child was here" {
		t.Errorf("parent read %q", got)
	}
	c.send("close")
	c.expect("closed")
	c.finish()
	ok(t, "MemFree", d.MemFree(p))
	if vs := violations(t, d); len(vs) != 0 {
		t.Errorf("violations %+v", vs)
	}
}

// startHolder allocates size bytes in a fresh state directory and starts a
// "hold" child, which opens them from their IPC handle; it returns once the
// child has.
func startHolder(t *testing.T, size uint64) (*Driver, api.DevicePtr, *child) {
	lockThread(t)
	dir := t.TempDir()
	d := newDriver(t, Config{Dir: dir})
	primary(t, d, 0)
	p := alloc(t, d, size)
	c := startHelper(t, "hold", dir, envHelperHandle+"="+handleHex(exportHandle(t, d, p)))
	c.expect("info")
	c.expect("opened")
	return d, p, c
}

// TestProcessFreeWhileMapped: the parent's free is refused while a live
// child maps the memory, which stays intact; the child's access after its
// close is recorded under its pid.
func TestProcessFreeWhileMapped(t *testing.T) {
	d, p, c := startHolder(t, 4096)
	check(t, "MemFree while the child maps", d.MemFree(p), api.ErrorIllegalState)
	vs := violations(t, d)
	if len(vs) != 1 || vs[0].Kind != kindFreeWhileMapped || vs[0].PID != os.Getpid() ||
		!strings.Contains(vs[0].Detail, strconv.Itoa(c.cmd.Process.Pid)) {
		t.Fatalf("violations %+v", vs)
	}
	c.send("write")
	c.expect("wrote")
	if got := read(t, d, p+1000, 14); string(got) != "child was here" {
		t.Errorf("parent read %q after the refused free", got)
	}
	c.send("close")
	c.expect("closed")
	c.send("touch")
	if got := c.expect("touched"); got != api.ErrorInvalidValue.Name() {
		t.Errorf("child's access after close: %s", got)
	}
	ok(t, "MemFree after the child closed", d.MemFree(p))
	c.finish()
	vs = violations(t, d)
	if len(vs) != 2 || vs[1].Kind != kindAccessAfterClose || vs[1].PID != c.cmd.Process.Pid {
		t.Errorf("violations %+v", vs)
	}
}

// TestProcessClosePendingWork: a process that closes its IPC mapping of
// another process's memory after it queued a copy from it, with no host
// wait since, is a "close-with-pending-work" violation; after any host
// wait it is not, including the ways a correct program waits that a
// stricter rule once accused (an independent review's cases): a chain of
// streams joined by an event, a destroyed stream and cuCtxSynchronize, an
// event recorded on the legacy default stream.
func TestProcessClosePendingWork(t *testing.T) {
	for _, tc := range []struct {
		mode    string
		pending bool
	}{
		{"none", true},
		{"stream", false},
		{"event", false},
		{"ctx", false},
		{"legacy", false},
		{"legacy-nonblocking", false}, // generous: CUDA would not promise it
		{"chain", false},
		{"destroy-ctx", false},
		{"default-event", false},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			d, p, c := startHolder(t, 4096)
			c.send("queue " + tc.mode)
			c.expect("queued")
			c.send("close")
			c.expect("closed")
			c.finish()
			ok(t, "MemFree", d.MemFree(p))
			vs := violations(t, d)
			switch {
			case tc.pending && (len(vs) != 1 || vs[0].Kind != kindClosePending || vs[0].PID != c.cmd.Process.Pid ||
				!strings.Contains(vs[0].Detail, "cuIpcCloseMemHandle")):
				t.Errorf("violations %+v, want one %s by the child", vs, kindClosePending)
			case !tc.pending && len(vs) != 0:
				t.Errorf("violations %+v, want none", vs)
			}
		})
	}
}

// TestProcessKilledMapper: a child killed with SIGKILL counts as unmapped as
// soon as it is a zombie, before anyone reaps it.
func TestProcessKilledMapper(t *testing.T) {
	lockThread(t)
	dir := t.TempDir()
	d := newDriver(t, Config{Dir: dir})
	primary(t, d, 0)
	p := alloc(t, d, 4096)
	c := startHelper(t, "hold", dir, envHelperHandle+"="+handleHex(exportHandle(t, d, p)))
	c.expect("info")
	c.expect("opened")
	check(t, "MemFree while the child maps", d.MemFree(p), api.ErrorIllegalState)
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(replyTimeout)
	for !isZombie(c.cmd.Process.Pid) {
		if time.Now().After(deadline) {
			t.Fatal("the killed child never became a zombie")
		}
		time.Sleep(time.Millisecond)
	}
	ok(t, "MemFree after the child died", d.MemFree(p))
	if err := c.wait(); err == nil {
		t.Error("killed child exited cleanly")
	}
}

func isZombie(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	return len(f) > 0 && f[0] == "Z"
}

// TestProcessExitFreesMemory: what a process allocated counts against the
// device until it exits, without freeing.
func TestProcessExitFreesMemory(t *testing.T) {
	lockThread(t)
	dir := t.TempDir()
	d := newDriver(t, Config{Dir: dir})
	primary(t, d, 0)
	c := startHelper(t, "alloc", dir, envHelperSize+"="+strconv.Itoa(3<<30))
	c.expect("allocated")
	check(t, "MemAlloc beside the child's", d.MemAlloc(new(api.DevicePtr), 2<<30), api.ErrorOutOfMemory)
	var free, total uint64
	ok(t, "MemGetInfo", d.MemGetInfo(&free, &total))
	if free != total-3<<30 {
		t.Errorf("free %d with the child's 3 GiB out of %d", free, total)
	}
	c.finish()
	ok(t, "MemAlloc after the child exited", d.MemAlloc(new(api.DevicePtr), 2<<30))
}

// TestProcessExporterExit: the handle of a process that has exited no longer
// opens: CUDA_ERROR_INVALID_HANDLE, as on the real driver.
func TestProcessExporterExit(t *testing.T) {
	lockThread(t)
	dir := t.TempDir()
	d := newDriver(t, Config{Dir: dir})
	primary(t, d, 0)
	c := startHelper(t, "export", dir)
	raw, err := hex.DecodeString(c.expect("handle"))
	if err != nil {
		t.Fatal(err)
	}
	c.finish()
	var h api.IpcMemHandle
	copy(h.Reserved[:], raw)
	var q api.DevicePtr
	check(t, "open the handle of an exited process", d.IpcOpenMemHandle(&q, h, 1), api.ErrorInvalidHandle)
	if n := buffers(t, dir); n != 0 {
		t.Errorf("%d buffer files left by the exited process", n)
	}
}

// TestProcessVisibleDevices: CUDA_VISIBLE_DEVICES=1 makes host device 1 the
// child's device 0, and the child still opens memory of host device 0.
func TestProcessVisibleDevices(t *testing.T) {
	lockThread(t)
	dir := t.TempDir()
	d := newDriver(t, Config{Dir: dir})
	primary(t, d, 0)
	p := alloc(t, d, 4096)
	write(t, d, p, []byte{0xca, 0xfe})
	var u1 api.UUID
	ok(t, "DeviceGetUuid", d.DeviceGetUuid(&u1, 1))
	c := startHelper(t, "hold", dir, envHelperHandle+"="+handleHex(exportHandle(t, d, p)), EnvVisible+"=1")
	if got := c.expect("info"); got != "1 "+hex.EncodeToString(u1[:]) {
		t.Errorf("child devices %q, want 1 device, host device 1", got)
	}
	if got := c.expect("opened"); !strings.HasPrefix(got, "0 cafe") {
		t.Errorf("child opened %q", got)
	}
	c.send("close")
	c.expect("closed")
	c.finish()
}

// TestProcessEvent: an interprocess event opens in another process and is
// usable there.
func TestProcessEvent(t *testing.T) {
	lockThread(t)
	dir := t.TempDir()
	d := newDriver(t, Config{Dir: dir})
	primary(t, d, 0)
	var e api.Event
	ok(t, "EventCreate", d.EventCreate(&e, api.EventDisableTiming|api.EventInterprocess))
	ok(t, "EventRecord", d.EventRecord(e, 0))
	var h api.IpcEventHandle
	ok(t, "IpcGetEventHandle", d.IpcGetEventHandle(&h, e))
	c := startHelper(t, "event", dir, envHelperHandle+"="+hex.EncodeToString(h.Reserved[:]))
	if got := c.expect("event"); got != "ok" {
		t.Errorf("child: %s", got)
	}
	c.finish()
}

// helperMain runs in the helper process.
func helperMain(name string) int {
	time.AfterFunc(helperWatchdog, func() {
		fmt.Fprintln(os.Stderr, "helper: watchdog fired")
		os.Exit(3)
	})
	runtime.LockOSThread()
	if err := runHelper(name); err != nil {
		fmt.Printf("fail %v\n", err)
		return 1
	}
	return 0
}

func runHelper(name string) error {
	d, err := New()
	if err != nil {
		return err
	}
	// No Deinit: the helper ends as a process does, by exiting.
	must := func(what string, r api.Result) error {
		if r != api.Success {
			return fmt.Errorf("%s: %s", what, r.Name())
		}
		return nil
	}
	dev, _ := strconv.Atoi(os.Getenv(envHelperDev))
	var ctx api.Context
	if err := errors.Join(must("Init", d.Init(0)), must("retain", d.DevicePrimaryCtxRetain(&ctx, api.Device(dev))),
		must("set current", d.CtxSetCurrent(ctx))); err != nil {
		return err
	}
	in := bufio.NewScanner(os.Stdin)
	next := func() string {
		if !in.Scan() {
			return "exit"
		}
		return in.Text()
	}
	raw, _ := hex.DecodeString(os.Getenv(envHelperHandle))
	switch name {
	case "hold":
		var n int32
		var u api.UUID
		if err := errors.Join(must("count", d.DeviceGetCount(&n)), must("uuid", d.DeviceGetUuid(&u, 0))); err != nil {
			return err
		}
		fmt.Printf("info %d %x\n", n, u[:])
		var h api.IpcMemHandle
		copy(h.Reserved[:], raw)
		var q api.DevicePtr
		if err := must("IpcOpenMemHandle", d.IpcOpenMemHandle(&q, h, api.IpcMemLazyEnablePeerAccess)); err != nil {
			return err
		}
		var ord int32
		b := make([]byte, 256)
		if err := errors.Join(must("ordinal", d.PointerGetAttribute(unsafe.Pointer(&ord), api.PointerAttrDeviceOrdinal, q)),
			must("read", d.MemcpyDtoH(unsafe.Pointer(&b[0]), q, 256))); err != nil {
			return err
		}
		fmt.Printf("opened %d %x\n", ord, b)
		for {
			switch cmd := next(); cmd {
			case "write":
				msg := []byte("child was here")
				if err := must("write", d.MemcpyHtoD(q+1000, unsafe.Pointer(&msg[0]), uint64(len(msg)))); err != nil {
					return err
				}
				fmt.Println("wrote")
			case "close":
				if err := must("close", d.IpcCloseMemHandle(q)); err != nil {
					return err
				}
				fmt.Println("closed")
			case "touch":
				fmt.Println("touched", d.MemsetD8(q, 0, 1).Name())
			case "queue none", "queue stream", "queue event", "queue ctx", "queue legacy", "queue legacy-nonblocking",
				"queue chain", "queue destroy-ctx", "queue default-event":
				// A copy from the mapping queued on a stream of its own,
				// then the host wait the command names (or none).
				mode := strings.TrimPrefix(cmd, "queue ")
				flags := uint32(0)
				if mode == "legacy-nonblocking" {
					flags = api.StreamNonBlocking
				}
				var s, s2 api.Stream
				var local api.DevicePtr
				var ev, ev2 api.Event
				var one [1]byte
				err := errors.Join(must("StreamCreate", d.StreamCreate(&s, flags)), must("MemAlloc", d.MemAlloc(&local, 256)),
					must("EventCreate", d.EventCreate(&ev, api.EventDisableTiming)),
					must("MemcpyDtoDAsync", d.MemcpyDtoDAsync(local, q, 256, s)))
				switch mode {
				case "stream":
					err = errors.Join(err, must("StreamSynchronize", d.StreamSynchronize(s)))
				case "event":
					err = errors.Join(err, must("EventRecord", d.EventRecord(ev, s)), must("EventSynchronize", d.EventSynchronize(ev)))
				case "ctx":
					err = errors.Join(err, must("CtxSynchronize", d.CtxSynchronize()))
				case "legacy", "legacy-nonblocking":
					err = errors.Join(err, must("MemcpyDtoH", d.MemcpyDtoH(unsafe.Pointer(&one[0]), local, 1)))
				case "chain":
					// Another stream waits for the copy's; a wait on that
					// stream's later event covers the copy.
					err = errors.Join(err, must("EventRecord", d.EventRecord(ev, s)), must("StreamCreate", d.StreamCreate(&s2, api.StreamNonBlocking)),
						must("StreamWaitEvent", d.StreamWaitEvent(s2, ev, 0)), must("EventCreate", d.EventCreate(&ev2, api.EventDisableTiming)),
						must("EventRecord", d.EventRecord(ev2, s2)), must("EventSynchronize", d.EventSynchronize(ev2)))
				case "destroy-ctx":
					err = errors.Join(err, must("StreamDestroy", d.StreamDestroy(s)), must("CtxSynchronize", d.CtxSynchronize()))
				case "default-event":
					// An event on the legacy default stream comes after the
					// work of the blocking streams.
					err = errors.Join(err, must("EventRecord", d.EventRecord(ev, 0)), must("EventSynchronize", d.EventSynchronize(ev)))
				}
				if err != nil {
					return err
				}
				fmt.Println("queued")
			case "exit":
				return nil
			default:
				return fmt.Errorf("unknown command %q", cmd)
			}
		}
	case "export":
		var p api.DevicePtr
		var h api.IpcMemHandle
		if err := errors.Join(must("MemAlloc", d.MemAlloc(&p, 4096)), must("IpcGetMemHandle", d.IpcGetMemHandle(&h, p))); err != nil {
			return err
		}
		fmt.Println("handle", handleHex(h))
		next()
		return nil
	case "vmm-send":
		return helperVMMSend(d, next)
	case "alloc":
		size, _ := strconv.ParseUint(os.Getenv(envHelperSize), 10, 64)
		var p api.DevicePtr
		if err := must("MemAlloc", d.MemAlloc(&p, size)); err != nil {
			return err
		}
		fmt.Println("allocated")
		next()
		return nil
	case "event":
		var h api.IpcEventHandle
		copy(h.Reserved[:], raw)
		var e api.Event
		if err := errors.Join(must("IpcOpenEventHandle", d.IpcOpenEventHandle(&e, h)),
			must("StreamWaitEvent", d.StreamWaitEvent(0, e, 0)), must("EventQuery", d.EventQuery(e)),
			must("EventSynchronize", d.EventSynchronize(e)), must("EventRecord", d.EventRecord(e, 0)),
			must("EventDestroy", d.EventDestroy(e))); err != nil {
			return err
		}
		h.Reserved[3] ^= 0xff
		if r := d.IpcOpenEventHandle(&e, h); r != api.ErrorMapFailed {
			return fmt.Errorf("garbage event handle: %s", r.Name())
		}
		fmt.Println("event ok")
		next()
		return nil
	}
	return fmt.Errorf("unknown helper %q", name)
}
