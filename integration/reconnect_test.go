package integration

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/app"
)

// pythonConsumer starts `python -m cudashare consume` on the test's
// socket, with the repository's package, or skips the test without a
// Python that has msgpack.
func (e *env) pythonConsumer(name string, args ...string) *proc {
	e.t.Helper()
	py := pythonWithMsgpack()
	if py == "" {
		e.t.Skip("no Python with the msgpack package (Debian: apt-get install python3-msgpack)")
	}
	// Tests run in their package's directory, here and on the GPU
	// machine (.gpu/run.sh).
	pkg, err := filepath.Abs(filepath.Join("..", "python"))
	if err != nil {
		e.t.Fatal(err)
	}
	if pp := os.Getenv("PYTHONPATH"); pp != "" {
		pkg += ":" + pp // a msgpack of its own (the GPU machine's .gpu/pylib)
	}
	return e.start(name, py, []string{"PYTHONPATH=" + pkg}, append([]string{"-m", "cudashare", "consume", "--socket", e.sock}, args...)...)
}

// pyVerifyMode is the Python consumer's -verify: "full", except on the
// simulated driver with legacy IPC, whose memory the Python consumer's
// simulated backend cannot read (its leases raise NotSupported for their
// data): "none" there.
func pyVerifyMode() string {
	if os.Getenv("CUDASHARE_DRIVER") != "cuda" && os.Getenv("CUDASHARE_SHARING") == "ipc" {
		return "none"
	}
	return "full"
}

// pyReport is what the tests read of the Python consumer's report.
type pyReport struct {
	Handoffs     uint64 `json:"handoffs"`
	Verified     uint64 `json:"verified"`
	VerifyErrors uint64 `json:"verify_errors"`
	Errors       uint64 `json:"errors"`
	Reconnects   uint64 `json:"reconnects"`
	End          string `json:"end"`
	Error        string `json:"error"`
	Exit         int    `json:"exit"`
}

// lastProgress is the last consumer-progress line the Go consumer printed.
func lastProgress(p *proc) (app.ConsumerProgress, bool) {
	var last app.ConsumerProgress
	found := false
	sc := bufio.NewScanner(bytes.NewReader(p.stdout.Bytes()))
	for sc.Scan() {
		var r app.ConsumerProgress
		if json.Unmarshal(sc.Bytes(), &r) == nil && r.Role == "consumer-progress" {
			last, found = r, true
		}
	}
	return last, found
}

// countDir counts the entries of /proc/<pid>/<what> (fd: descriptors,
// task: threads).
func countDir(t *testing.T, p *proc, what string) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/" + strconv.Itoa(p.cmd.Process.Pid) + "/" + what)
	if err != nil {
		t.Fatalf("%s: %v", p.name, err)
	}
	return len(ents)
}

// TestReconnectThroughRestarts: a Go consumer running a pool and a Python
// consumer keep going while their producer is SIGKILLed and started again
// 10 times, and restarted on purpose (SIGHUP) 10 times: they never exit,
// every batch they got was right (checked again after each -work, so that
// leases held across a kill are checked after it), the simulator records
// no violation and holds no memory at the end (newEnv), and their
// descriptors, threads and goroutines do not grow with the restarts. At
// the end the producer's goodbye ends both cleanly, each having
// reconnected 20 times.
func TestReconnectThroughRestarts(t *testing.T) {
	const kills, hups = 10, 10
	e := newEnv(t, "")
	prodArgs := []string{"-ring", "8", "-size", "64KiB", "-consumers", "2", "-v", "-report-every", "20ms"}
	prod := e.producer(prodArgs...)
	// With two GPUs or more, the Python consumer maps the producer's
	// memory from another GPU across every restart.
	pyDev := "0"
	if devs, err := e.d.Devices(); err == nil && len(devs) >= 2 {
		pyDev = "1"
	}
	// On the simulator with ipc the Python consumer checks the offers
	// only (pyVerifyMode), and the Go consumer every byte.
	pyVerify := pyVerifyMode()
	t.Logf("the Go consumer on GPU 0, the Python consumer on GPU %s", pyDev)
	goc := e.consumer("go", "-reconnect", "60s", "-workers", "2", "-work", "2ms", "-report-every", "20ms")
	pyc := e.pythonConsumer("python", "--reconnect", "60", "--verify", pyVerify, "--wait", "20", "--device", pyDev)

	// served waits until p has served both consumers (its n-th and
	// n+1-th arrivals logged) and offered batches since: both are
	// connected to this producer and taking its batches.
	served := func(p *proc, arrivals int) {
		t.Helper()
		connected(t, p, arrivals)
		mark := strings.Count(p.stdout.String(), "producer-progress")
		waitFor(t, "batches after the restart", 20*time.Second, func() bool {
			if !goc.running() || !pyc.running() {
				t.Fatalf("a consumer exited during the restarts\ngo:\n%s\n%s\npython:\n%s\n%s",
					goc.stdout.String(), goc.stderr.String(), pyc.stdout.String(), pyc.stderr.String())
			}
			out := p.stdout.String()
			return strings.Count(out, "producer-progress") > mark+2 && strings.Contains(out[strings.LastIndex(out, "{"):], `"consumers":2`)
		})
	}
	type sample struct{ goFDs, goThreads, goRoutines, pyFDs, pyThreads int }
	measure := func() sample {
		pr, _ := lastProgress(goc)
		return sample{countDir(t, goc, "fd"), countDir(t, goc, "task"), pr.Goroutines, countDir(t, pyc, "fd"), countDir(t, pyc, "task")}
	}
	served(prod, 2)
	var first, last sample
	for i := range kills + hups {
		if i%2 == 0 {
			// Killed while the Go consumer's workers hold leases
			// (-work): they finish with the right bytes (recheck).
			prod.cmd.Process.Kill()
			prod.wait(10 * time.Second)
			prod = e.producer(prodArgs...)
			served(prod, 2)
		} else {
			before := strings.Count(prod.stderr.String(), "consumer connected")
			prod.signal(syscall.SIGHUP)
			served(prod, before+2)
		}
		s := measure()
		if i == 1 {
			first = s
		}
		last = s
	}
	t.Logf("after the first restarts: %+v; after the last: %+v", first, last)
	// Each restart leaves nothing behind: what grew by a restart's worth
	// each time would have grown by 18 since the first sample. A little
	// slack for what is in flight when sampled (a release, a dial).
	const slack = 4
	if last.goFDs > first.goFDs+slack || last.pyFDs > first.pyFDs+slack {
		t.Errorf("descriptors grew with the restarts: go %d -> %d, python %d -> %d", first.goFDs, last.goFDs, first.pyFDs, last.pyFDs)
	}
	if last.goThreads > first.goThreads+slack || last.pyThreads > first.pyThreads+slack {
		t.Errorf("threads grew with the restarts: go %d -> %d, python %d -> %d", first.goThreads, last.goThreads, first.pyThreads, last.pyThreads)
	}
	if last.goRoutines > first.goRoutines+2*slack {
		t.Errorf("goroutines grew with the restarts: %d -> %d", first.goRoutines, last.goRoutines)
	}

	prod.signal(syscall.SIGTERM)
	gr := goc.consumerDone(60 * time.Second)
	pr := prod.producerDone(60 * time.Second)
	if gr.Reconnects != kills+hups || gr.End != "producer said goodbye" {
		t.Errorf("go consumer: %d reconnections, ended %q; want %d, the producer's goodbye", gr.Reconnects, gr.End, kills+hups)
	}
	if pr.Restarts != 1 {
		// Killed last before the last SIGHUP: the last process restarted once.
		t.Errorf("the last producer process restarted %d times, want 1", pr.Restarts)
	}
	pyc.expectExit(0, 60*time.Second)
	var py pyReport
	pyc.report(&py)
	if py.VerifyErrors != 0 || py.Errors != 0 || (py.Verified != py.Handoffs && pyVerify != "none") || py.Reconnects != kills+hups || py.End != "producer said goodbye" {
		t.Errorf("python consumer: %d handoffs, %d verified, %d wrong, %d unreadable, %d reconnections, ended %q; want all verified, %d reconnections, the producer's goodbye",
			py.Handoffs, py.Verified, py.VerifyErrors, py.Errors, py.Reconnects, py.End, kills+hups)
	}
	t.Logf("go consumer: %d batches, %d verified, %d wrong, %d reconnections, %d releases dropped; python: %d batches, %d verified, %d wrong, %d reconnections",
		gr.Handoffs, gr.Verified, gr.VerifyErrors, gr.Reconnects, gr.ReleasesDropped, py.Handoffs, py.Verified, py.VerifyErrors, py.Reconnects)
}

// TestReconnectEnds: consumers with -reconnect started before any
// producer wait for one and work; when that producer is killed and none
// comes back, they give up at their deadline, saying so, with exit code
// 5. Consumers without -reconnect exit 9 at a producer's restart on
// purpose, saying how to go on.
func TestReconnectEnds(t *testing.T) {
	e := newEnv(t, "")
	goc := e.start("go", bins.consumer, nil, "-socket", e.sock, "-json", "-reconnect", "3s")
	pyc := e.pythonConsumer("python", "--reconnect", "3", "--verify", pyVerifyMode())
	prod := e.producer("-ring", "8", "-size", "64KiB", "-consumers", "2", "-v", "-report-every", "20ms")
	connected(t, prod, 2)
	waitFor(t, "batches to both consumers", 20*time.Second, func() bool {
		// The producer offers to whichever holds fewer leases: after
		// a few dozen batches, both have had some.
		return strings.Count(prod.stdout.String(), "producer-progress") > 5 && !strings.HasSuffix(strings.TrimSpace(prod.stdout.String()), `"offers":0`)
	})
	prod.cmd.Process.Kill()
	prod.wait(10 * time.Second)
	goc.expectExit(app.ExitProducerGone, 30*time.Second)
	mustContain(t, "the Go consumer's stderr", goc.stderr.String(), "no producer came back within -reconnect")
	var gr app.ConsumerReport
	goc.report(&gr)
	if gr.Handoffs == 0 || gr.VerifyErrors != 0 || gr.End != "producer did not come back" {
		t.Errorf("go consumer: %d handoffs, %d wrong, ended %q", gr.Handoffs, gr.VerifyErrors, gr.End)
	}
	pyc.expectExit(app.ExitProducerGone, 30*time.Second)
	var py pyReport
	pyc.report(&py)
	if py.Handoffs == 0 || py.VerifyErrors != 0 || py.End != "producer did not come back" || !strings.Contains(py.Error, "none came back within") {
		t.Errorf("python consumer: %d handoffs, %d wrong, ended %q: %s", py.Handoffs, py.VerifyErrors, py.End, py.Error)
	}

	// Without -reconnect, a restart on purpose ends them with their own
	// status.
	prod = e.producer("-ring", "8", "-size", "64KiB", "-consumers", "2", "-v")
	goc = e.consumer("go")
	pyc = e.pythonConsumer("python", "--wait", "20")
	connected(t, prod, 2)
	prod.signal(syscall.SIGHUP)
	goc.expectExit(app.ExitRestarted, 30*time.Second)
	mustContain(t, "the Go consumer's stderr", goc.stderr.String(), "restarted", "-reconnect")
	pyc.expectExit(app.ExitRestarted, 30*time.Second)
	mustContain(t, "the Python consumer's stderr", pyc.stderr.String(), "restarted", "--reconnect")
	prod.signal(syscall.SIGTERM)
	prod.producerDone(30 * time.Second)
}
