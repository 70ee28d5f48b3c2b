//go:build linux

// Package sharetest is the test support of the share and pool packages,
// in the manner of net/http/httptest: a TestMain that runs the tests or,
// re-run as a child, a producer or consumer routine; children driven
// through stdin and stdout with a watchdog; leak checks for descriptors
// and goroutines; and the check that the strict simulated driver recorded
// no lifetime violation. It is for tests only; its API follows the needs
// of those tests.
//
// A multi-process test re-runs its own test binary as the other process,
// in the manner of x/sys/unix's TestPassFD: the environment variable
// EnvChild names the routine; the routine prints lines ("READY", "HELD 2",
// "REPORT {json}") that the parent waits for, and reads commands from
// stdin. Every process shares the simulator's state directory
// (CUDASHARE_SIM_DIR), which Main creates when it is not set.
//
// Tests run on whichever backend driver.Open picks: the simulator without
// a GPU, the real driver with CUDASHARE_DRIVER=cuda. Only the violation
// assertion is skipped on the real driver (it records none).
package sharetest

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/driver"

	"github.com/seed743c36cf/cudashare/internal/testutil"
)

// EnvChild names the routine a child process runs.
const EnvChild = "CUDASHARE_SHARE_CHILD"

// childWatchdog ends a child that outlives any reasonable test.
const childWatchdog = 2 * time.Minute

// ExpectTimeout bounds the wait for a line from a child.
const ExpectTimeout = 30 * time.Second

// Env is what every test of the process shares.
type Env struct {
	D   *driver.Driver
	Ctx *driver.Context // primary context of device 0
}

var (
	env     *Env
	pkgMark string // what marks a goroutine of the package under test
)

// Main is the TestMain of a package: it runs routine mode when the
// process is a child, else the tests, and fails the run if they leave a
// descriptor open or a goroutine whose stack mentions pkg (such as
// "cudashare/share.") running.
func Main(m *testing.M, pkg string) {
	if mode := os.Getenv(EnvChild); mode != "" {
		os.Exit(runChild(mode))
	}
	pkgMark = pkg
	os.Exit(mainParent(m))
}

func mainParent(m *testing.M) int {
	if os.Getenv("CUDASHARE_SIM_DIR") == "" {
		dir, err := os.MkdirTemp("", "cudashare-share-sim-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		os.Setenv("CUDASHARE_SIM_DIR", dir)
	}
	d, err := driver.Open(driver.Config{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "open driver:", err)
		return 1
	}
	dev, err := d.Device(0)
	if err != nil {
		fmt.Fprintln(os.Stderr, "device 0:", err)
		return 1
	}
	ctx, err := dev.RetainPrimaryContext()
	if err != nil {
		fmt.Fprintln(os.Stderr, "primary context:", err)
		return 1
	}
	env = &Env{D: d, Ctx: ctx}
	fmt.Fprintf(os.Stderr, "tests on backend %s (%s)\n", d.Backend(), d.Reason())
	// Descriptors the runtime keeps once networking starts are not leaks.
	if ln, err := net.Listen("unix", "@cudashare-share-warmup-"+strconv.Itoa(os.Getpid())); err == nil {
		ln.Close()
	}
	before := testutil.OpenFDs()
	code := m.Run()
	if err := ctx.Close(); err != nil && code == 0 {
		fmt.Fprintln(os.Stderr, "FAIL: release the primary context:", err)
		code = 1
	}
	if code == 0 {
		if msg := leaks(before, 5*time.Second); msg != "" {
			fmt.Fprintln(os.Stderr, "FAIL: leak after the tests:\n"+msg)
			code = 1
		}
	}
	return code
}

// Setup returns the shared environment and arms the checks of one test:
// at its end (after its children have exited), no new lifetime violation,
// no descriptor and no goroutine of the package left.
func Setup(t testing.TB) *Env {
	t.Helper()
	if env == nil {
		t.Fatal("sharetest: Main did not run")
	}
	violations := CountViolations(t)
	before := testutil.OpenFDs()
	t.Cleanup(func() {
		if t.Failed() {
			return
		}
		if msg := leaks(before, 3*time.Second); msg != "" {
			t.Errorf("leak:\n%s", msg)
		}
		NoNewViolations(t, violations)
	})
	return env
}

// Sim reports whether the tests run on the simulator.
func (e *Env) Sim() bool { return e.D.Backend() == driver.BackendSim }

// NeedDevices skips t when fewer than n devices are visible.
func (e *Env) NeedDevices(t testing.TB, n int) {
	t.Helper()
	got, err := e.D.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	if got < n {
		t.Skipf("needs %d devices (%d visible)", n, got)
	}
}

// Context retains the primary context of device ordinal for t.
func (e *Env) Context(t testing.TB, ordinal int) *driver.Context {
	t.Helper()
	if ordinal == 0 {
		return e.Ctx
	}
	dev, err := e.D.Device(ordinal)
	if err != nil {
		t.Fatal(err)
	}
	c, err := dev.RetainPrimaryContext()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// CountViolations returns how many violations are recorded now, or -1 on
// a backend that records none.
func CountViolations(t testing.TB) int {
	t.Helper()
	v, err := env.D.Violations()
	if errors.Is(err, driver.ErrStrictUnsupported) {
		return -1
	}
	if err != nil {
		t.Fatal(err)
	}
	return len(v)
}

// NoNewViolations fails t if violations were recorded since before (a
// count from CountViolations). On the real driver it checks nothing.
func NoNewViolations(t testing.TB, before int) {
	t.Helper()
	v, err := env.D.Violations()
	if errors.Is(err, driver.ErrStrictUnsupported) {
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	if len(v) > before {
		for _, x := range v[before:] {
			t.Errorf("violation %s by pid %d: %s", x.Kind, x.PID, x.Detail)
		}
	}
}

// SocketPath returns a fresh socket path in a private directory short
// enough for sun_path.
func SocketPath(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "csh")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "sock")
}

// Ctx returns a context bounded for a test.
func Ctx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// Logger returns a logger that writes through t.Log while the test runs
// and drops what comes after.
func Logger(t testing.TB) *slog.Logger {
	w := &testWriter{t: t}
	t.Cleanup(func() {
		w.mu.Lock()
		w.done = true
		w.mu.Unlock()
	})
	return slog.New(slog.NewTextHandler(w, nil))
}

type testWriter struct {
	mu   sync.Mutex
	t    testing.TB
	done bool
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimSuffix(string(p), "\n"))
	}
	return len(p), nil
}

// FreeMemory returns the free memory of ctx's device, to compare before
// and after a test on the simulator, where only the processes of the test
// allocate. On the real driver it returns 0 and CheckMemory checks
// nothing.
func (e *Env) FreeMemory(t testing.TB) uint64 {
	t.Helper()
	if !e.Sim() {
		return 0
	}
	free, _, err := e.Ctx.MemInfo()
	if err != nil {
		t.Fatal(err)
	}
	return free
}

// CheckMemory fails t if the device's free memory is not what it was
// (FreeMemory) on the simulator: the test left an allocation behind.
func (e *Env) CheckMemory(t testing.TB, before uint64) {
	t.Helper()
	if now := e.FreeMemory(t); now != before {
		t.Errorf("device memory: %d bytes free, %d before: %d bytes left allocated", now, before, int64(before)-int64(now))
	}
}

// --- Leaks -----------------------------------------------------------------

// leaks waits up to wait for stragglers, then describes the descriptors
// not in before and the goroutines of the package under test.
func leaks(before map[int]string, wait time.Duration) string {
	var msg string
	for deadline := time.Now().Add(wait); ; {
		msg = ""
		var extra []string
		for fd, target := range testutil.OpenFDs() {
			// The simulator's registry file, and its presence file (proc-*:
			// how processes in other PID namespaces see this one alive),
			// are held by a Driver for its life: not leaks of the code
			// under test.
			base := filepath.Base(strings.TrimSuffix(target, " (deleted)"))
			if before[fd] != target && base != "registry" && !strings.HasPrefix(base, "proc-") {
				extra = append(extra, fmt.Sprintf("  descriptor %d -> %s", fd, target))
			}
		}
		slices.Sort(extra)
		if len(extra) > 0 {
			msg = strings.Join(extra, "\n") + "\n"
		}
		for _, g := range goroutines(pkgMark) {
			msg += "  goroutine:\n" + g + "\n"
		}
		if msg == "" || time.Now().After(deadline) {
			return msg
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// goroutines returns the stacks of goroutines running code whose name
// contains mark, other than the caller's and test runners.
func goroutines(mark string) []string {
	if mark == "" {
		return nil
	}
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for i, g := range strings.Split(string(buf), "\n\n") {
		if i == 0 || strings.Contains(g, "testing.tRunner") || strings.Contains(g, "testing.(*B)") {
			continue
		}
		if strings.Contains(g, mark) {
			out = append(out, g)
		}
	}
	return out
}

// --- Children --------------------------------------------------------------

// Child is a running child process.
type Child struct {
	t      testing.TB
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	stderr *SyncBuffer
	exited chan struct{}
	err    error // of Wait, once exited is closed
	killed bool
}

// Start runs routine mode in a child process with env entries
// ("KEY=VALUE") added. Its cleanup kills and reaps it.
func Start(t testing.TB, mode string, env ...string) *Child {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$", "-test.bench=^$")
	cmd.Env = append(append(os.Environ(), EnvChild+"="+mode), env...)
	if g := os.Getenv("GORACE"); !strings.Contains(g, "atexit_sleep_ms") {
		// A race-enabled child would sleep a second at exit.
		cmd.Env = append(cmd.Env, strings.TrimSpace("GORACE="+g+" atexit_sleep_ms=0"))
	}
	c := &Child{t: t, name: mode, cmd: cmd, lines: make(chan string, 1<<12), stderr: &SyncBuffer{}, exited: make(chan struct{})}
	cmd.Stderr = c.stderr
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
		sc := bufio.NewScanner(stdout)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
		c.err = cmd.Wait()
		close(c.exited)
	}()
	t.Cleanup(func() {
		c.stdin.Close()
		select {
		case <-c.exited:
		case <-time.After(10 * time.Second):
			t.Errorf("child %s did not exit; killing it\nstderr:\n%s", c.name, c.stderr)
			cmd.Process.Kill()
			<-c.exited
		}
	})
	return c
}

// PID is the child's process id.
func (c *Child) PID() int { return c.cmd.Process.Pid }

// Expect waits for a line that starts with prefix and returns the rest,
// trimmed. Lines before it are skipped. The test fails if the child ends
// or ExpectTimeout passes first.
func (c *Child) Expect(prefix string) string {
	c.t.Helper()
	timer := time.NewTimer(ExpectTimeout)
	defer timer.Stop()
	for {
		select {
		case line, ok := <-c.lines:
			if !ok {
				<-c.exited
				c.t.Fatalf("child %s ended (%v) before printing %q\nstderr:\n%s", c.name, c.err, prefix, c.stderr)
			}
			if strings.HasPrefix(line, "FAIL ") {
				c.t.Fatalf("child %s: %s\nstderr:\n%s", c.name, line, c.stderr)
			}
			if rest, ok := strings.CutPrefix(line, prefix); ok {
				return strings.TrimSpace(rest)
			}
		case <-timer.C:
			c.t.Fatalf("child %s: no %q within %v\nstderr:\n%s", c.name, prefix, ExpectTimeout, c.stderr)
		}
	}
}

// Report waits for the child's "REPORT {json}" line and decodes it.
func (c *Child) Report(v any) {
	c.t.Helper()
	if err := json.Unmarshal([]byte(c.Expect("REPORT ")), v); err != nil {
		c.t.Fatalf("child %s: report: %v", c.name, err)
	}
}

// Send writes a command line to the child's stdin.
func (c *Child) Send(line string) {
	c.t.Helper()
	if _, err := io.WriteString(c.stdin, line+"\n"); err != nil {
		c.t.Fatalf("child %s: send %q: %v", c.name, line, err)
	}
}

// Kill kills the child with SIGKILL and reaps it.
func (c *Child) Kill() {
	c.t.Helper()
	c.killed = true
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, os.ErrProcessDone) {
		c.t.Fatal(err)
	}
	<-c.exited
}

// Wait closes the child's stdin and waits for it to exit successfully.
func (c *Child) Wait() {
	c.t.Helper()
	c.stdin.Close()
	select {
	case <-c.exited:
	case <-time.After(ExpectTimeout):
		c.t.Fatalf("child %s did not exit\nstderr:\n%s", c.name, c.stderr)
	}
	if c.err != nil {
		c.t.Fatalf("child %s: %v\nstderr:\n%s", c.name, c.err, c.stderr)
	}
}

// Stderr is what the child wrote to stderr so far.
func (c *Child) Stderr() string { return c.stderr.String() }

// SyncBuffer is a bytes.Buffer safe for a logger and a test to share.
type SyncBuffer = testutil.SyncBuffer

// --- Data ------------------------------------------------------------------

// Meta encodes n as a msgpack uint 64.
func Meta(n uint64) []byte {
	b := make([]byte, 9)
	b[0] = 0xcf
	binary.BigEndian.PutUint64(b[1:], n)
	return b
}

// MetaInto encodes n into buf, which must hold 9 bytes, without
// allocating.
func MetaInto(buf []byte, n uint64) []byte {
	buf = buf[:9]
	buf[0] = 0xcf
	binary.BigEndian.PutUint64(buf[1:], n)
	return buf
}

// ParseMeta decodes what Meta encodes.
func ParseMeta(b []byte) (uint64, bool) {
	if len(b) != 9 || b[0] != 0xcf {
		return 0, false
	}
	return binary.BigEndian.Uint64(b[1:]), true
}

// Fill writes the pattern of n into the size bytes at p: n and ^n at the
// start, n at the end, so a consumer can tell the right bytes at the right
// offset. size must be at least 24.
func Fill(ctx *driver.Context, p driver.DevicePtr, size, n uint64) error {
	var head [16]byte
	binary.LittleEndian.PutUint64(head[0:], n)
	binary.LittleEndian.PutUint64(head[8:], ^n)
	if err := ctx.CopyHtoD(p, head[:]); err != nil {
		return err
	}
	return ctx.CopyHtoD(p+driver.DevicePtr(size-8), head[:8])
}

// Check reads back what Fill wrote.
func Check(ctx *driver.Context, p driver.DevicePtr, size, n uint64) error {
	var head [16]byte
	var tail [8]byte
	if err := ctx.CopyDtoH(head[:], p); err != nil {
		return err
	}
	if err := ctx.CopyDtoH(tail[:], p+driver.DevicePtr(size-8)); err != nil {
		return err
	}
	h0, h1 := binary.LittleEndian.Uint64(head[0:]), binary.LittleEndian.Uint64(head[8:])
	t := binary.LittleEndian.Uint64(tail[:])
	if h0 != n || h1 != ^n || t != n {
		return fmt.Errorf("buffer %d at %#x holds %d/%#x/%d", n, uint64(p), h0, h1, t)
	}
	return nil
}
