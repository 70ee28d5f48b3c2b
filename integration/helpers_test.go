package integration

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/internal/app"

	"github.com/seed743c36cf/cudashare/internal/testutil"
)

// childWatchdog kills a child that outlives any reasonable test, so that a
// hang fails the test instead of the whole run.
const childWatchdog = 2 * time.Minute

// env is one test's machine: its own simulator state directory (so its
// violations and memory are its own) and its own private socket directory.
type env struct {
	t       *testing.T
	d       *driver.Driver
	sockDir string
	sock    string // the default socket path of the test
	simDir  string
}

// onCUDA reports whether the tests run on the real driver: then there are
// no violations to read, and other processes use GPU memory too.
func (e *env) onCUDA() bool { return e.d.Backend() == driver.BackendCUDA }

// newEnv prepares a test: topology, if not "", is the simulated machine
// (CUDASHARE_SIM_TOPOLOGY). At the end of the test, after its children have
// exited, it checks that the simulator recorded no violation and that no
// device memory is left allocated.
func newEnv(t *testing.T, topology string) *env {
	t.Helper()
	e := &env{t: t}
	e.simDir = t.TempDir()
	t.Setenv("CUDASHARE_SIM_DIR", e.simDir)
	if topology != "" {
		t.Setenv("CUDASHARE_SIM_TOPOLOGY", topology)
	} else {
		t.Setenv("CUDASHARE_SIM_TOPOLOGY", "")
	}
	d, err := driver.Open(driver.Config{})
	if err != nil {
		t.Fatalf("open the driver: %v", err)
	}
	e.d = d
	if e.onCUDA() && topology != "" {
		t.Skip("needs a simulated topology (" + topology + "); on the real driver the machine is what it is")
	}
	dir, err := os.MkdirTemp("", "csit-") // short: sun_path has 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	e.sockDir = dir
	e.sock = filepath.Join(dir, "p.sock")
	// Registered first, so it runs last: after every child is reaped.
	t.Cleanup(func() {
		os.RemoveAll(dir)
		if !t.Failed() {
			e.checkMachine()
		}
	})
	return e
}

// checkMachine asserts what must hold once every process of the test is
// gone: no lifetime violation, no device memory in use.
func (e *env) checkMachine() {
	t := e.t
	t.Helper()
	v, err := e.d.Violations()
	switch {
	case errors.Is(err, driver.ErrStrictUnsupported):
		return // the real driver records none, and other processes use its memory
	case err != nil:
		t.Errorf("read violations: %v", err)
	}
	for _, x := range v {
		t.Errorf("violation %s by pid %d: %s", x.Kind, x.PID, x.Detail)
	}
	devs, err := e.d.Devices()
	if err != nil {
		t.Fatal(err)
	}
	for _, dev := range devs {
		ctx, err := dev.RetainPrimaryContext()
		if err != nil {
			t.Fatal(err)
		}
		free, total, err := ctx.MemInfo()
		ctx.Close()
		if err != nil {
			t.Fatal(err)
		}
		if free != total {
			t.Errorf("device %d: %d bytes still allocated after every process exited", dev.Ordinal(), total-free)
		}
	}
}

// proc is a child process: a producer, a consumer or a hostile client.
type proc struct {
	t      *testing.T
	name   string
	cmd    *exec.Cmd
	stdout testutil.SyncBuffer
	stderr testutil.SyncBuffer
	done   chan struct{}
	code   int       // exit code, or 128+signal; valid once done is closed
	ended  time.Time // when Wait returned
}

// start runs bin with args; extraEnv entries ("K=V") are added to the
// environment. The child is killed by its watchdog, and at the end of the
// test if it still runs.
func (e *env) start(name, bin string, extraEnv []string, args ...string) *proc {
	e.t.Helper()
	cmd := exec.Command(bin, args...)
	if len(extraEnv) > 0 {
		cmd.Env = append(os.Environ(), extraEnv...)
	}
	return e.startCmd(name, cmd)
}

func (e *env) startCmd(name string, cmd *exec.Cmd) *proc {
	e.t.Helper()
	p := &proc{t: e.t, name: name, cmd: cmd, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = &p.stdout, &p.stderr
	if err := cmd.Start(); err != nil {
		e.t.Fatalf("start %s: %v", name, err)
	}
	watchdog := time.AfterFunc(childWatchdog, func() {
		e.t.Errorf("%s ran past the %v watchdog: killed", name, childWatchdog)
		cmd.Process.Kill()
	})
	go func() {
		err := cmd.Wait()
		watchdog.Stop()
		p.ended = time.Now()
		p.code = exitCode(err)
		close(p.done)
	}()
	e.t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

func exitCode(err error) int {
	if err == nil {
		return 0
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return ee.ExitCode()
	}
	return -1
}

// producer starts the example producer on the test's socket with -json.
func (e *env) producer(args ...string) *proc {
	e.t.Helper()
	return e.start("producer", bins.producer, nil, append([]string{"-socket", e.sock, "-json", "-wait", "30s"}, args...)...)
}

// consumer starts the example consumer on the test's socket with -json,
// waiting for the producer's socket to appear.
func (e *env) consumer(name string, args ...string) *proc {
	e.t.Helper()
	return e.start(name, bins.consumer, nil, append([]string{"-socket", e.sock, "-json", "-wait", "20s"}, args...)...)
}

// wait waits up to timeout for the child to exit and returns its code; past
// the timeout the child is killed and the test fails.
func (p *proc) wait(timeout time.Duration) int {
	p.t.Helper()
	select {
	case <-p.done:
		return p.code
	case <-time.After(timeout):
		p.cmd.Process.Kill()
		<-p.done
		p.t.Fatalf("%s did not exit within %v: killed\nstderr:\n%s", p.name, timeout, p.stderr.String())
		return -1
	}
}

// expectExit waits for the child and fails the test unless it exits with want.
func (p *proc) expectExit(want int, timeout time.Duration) {
	p.t.Helper()
	if got := p.wait(timeout); got != want {
		p.t.Fatalf("%s exited with %d, want %d\nstdout:\n%s\nstderr:\n%s", p.name, got, want, p.stdout.String(), p.stderr.String())
	}
}

func (p *proc) signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("signal %v to %s: %v", sig, p.name, err)
	}
}

func (p *proc) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// report decodes the child's JSON line (the last line of its stdout that
// holds an object).
func (p *proc) report(v any) {
	p.t.Helper()
	var last []byte
	sc := bufio.NewScanner(bytes.NewReader(p.stdout.Bytes()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if b := bytes.TrimSpace(sc.Bytes()); len(b) > 0 && b[0] == '{' {
			last = append(last[:0], b...)
		}
	}
	if last == nil {
		p.t.Fatalf("%s printed no JSON report\nstdout:\n%s\nstderr:\n%s", p.name, p.stdout.String(), p.stderr.String())
	}
	if err := json.Unmarshal(last, v); err != nil {
		p.t.Fatalf("%s: report: %v: %s", p.name, err, last)
	}
}

// producerDone waits for a producer to exit 0 and checks that it freed
// everything it allocated: no allocation or lease left.
func (p *proc) producerDone(timeout time.Duration) app.ProducerReport {
	p.t.Helper()
	p.expectExit(app.ExitOK, timeout)
	var r app.ProducerReport
	p.report(&r)
	if r.AllocationsLeft != 0 || r.LeasesLeft != 0 {
		p.t.Errorf("producer left %d allocation(s) and %d lease(s) after shutdown", r.AllocationsLeft, r.LeasesLeft)
	}
	// Device memory is checked once every process of the test has exited
	// (checkMachine): device-wide, it counts consumers' own buffers too,
	// which -verify async consumers free only after the goodbye.
	if r.Releases != r.Offers {
		p.t.Errorf("producer: %d offers but %d leases ended", r.Offers, r.Releases)
	}
	return r
}

// consumerDone waits for a consumer to exit 0 and checks that every batch
// it verified was right.
func (p *proc) consumerDone(timeout time.Duration) app.ConsumerReport {
	p.t.Helper()
	p.expectExit(app.ExitOK, timeout)
	var r app.ConsumerReport
	p.report(&r)
	if r.VerifyErrors != 0 || r.Errors != 0 {
		p.t.Errorf("%s: %d wrong and %d unreadable batches", p.name, r.VerifyErrors, r.Errors)
	}
	if r.Verify == "every" && r.Verified != r.Handoffs {
		p.t.Errorf("%s: verified %d of %d batches with -verify every", p.name, r.Verified, r.Handoffs)
	}
	return r
}

// waitFor polls cond until it holds or timeout passes.
func waitFor(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitSocket waits for the producer to listen.
func (e *env) waitSocket(prod *proc) {
	e.t.Helper()
	waitFor(e.t, "the producer's socket", 20*time.Second, func() bool {
		if !prod.running() {
			e.t.Fatalf("producer exited (%d) before listening\nstderr:\n%s", prod.code, prod.stderr.String())
		}
		fi, err := os.Stat(e.sock)
		return err == nil && fi.Mode().Type() == os.ModeSocket
	})
}

// mustContain fails unless s contains every one of subs.
func mustContain(t *testing.T, what, s string, subs ...string) {
	t.Helper()
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			t.Errorf("%s does not say %q:\n%s", what, sub, s)
		}
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
