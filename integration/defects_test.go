package integration

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/internal/app"
)

// The tests of this file reproduce, one each, the defects that adversarial
// testing found (issue 8), at the level of processes: real producers and
// consumers, and hostile clients re-run from this test binary
// (rawpeer_test.go). Each says what must hold; none times anything, and
// each uses short -lease-timeout, -write-timeout and -shutdown-timeout
// values so that it runs past them in seconds.

// hostile starts this test binary as the hostile client kind against the
// test's socket; extraEnv adds "K=V" entries.
func (e *env) hostile(kind string, extraEnv ...string) *proc {
	e.t.Helper()
	exe, err := os.Executable()
	if err != nil {
		e.t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(append(os.Environ(), envHostile+"="+kind, envHostileSocket+"="+e.sock), extraEnv...)
	return e.startCmd("hostile "+kind, cmd)
}

// line waits up to timeout for the child to print a line starting with
// prefix and returns it; the test fails if the child exits first.
func (p *proc) line(prefix string, timeout time.Duration) string {
	p.t.Helper()
	var got string
	waitFor(p.t, p.name+" to print "+strconv.Quote(prefix), timeout, func() bool {
		for l := range strings.Lines(p.stdout.String()) {
			if strings.HasPrefix(l, prefix) {
				got = strings.TrimSpace(l)
				return true
			}
		}
		if !p.running() {
			p.t.Fatalf("%s exited (%d) without printing %q\nstdout:\n%s\nstderr:\n%s", p.name, p.code, prefix, p.stdout.String(), p.stderr.String())
		}
		return false
	})
	return got
}

// handoffs is the consumer's latest count of batches, from the progress
// lines it prints with -report-every.
func (p *proc) handoffs() uint64 {
	var n uint64
	sc := bufio.NewScanner(bytes.NewReader(p.stdout.Bytes()))
	for sc.Scan() {
		var pr app.ConsumerProgress
		if json.Unmarshal(sc.Bytes(), &pr) == nil && pr.Role == "consumer-progress" {
			n = pr.Handoffs
		}
	}
	return n
}

// servedPast waits until the consumer (run with -report-every) reports
// more than n batches: it is being served. The timeout is a watchdog; a
// consumer that exits meanwhile fails the test at once.
func (p *proc) servedPast(n uint64, timeout time.Duration) uint64 {
	p.t.Helper()
	var got uint64
	waitFor(p.t, fmt.Sprintf("%s to be served past %d batches", p.name, n), timeout, func() bool {
		if !p.running() {
			p.t.Fatalf("%s exited (%d) after %d batches, want it served past %d\nstdout (end):\n%s\nstderr:\n%s", p.name, p.code, p.handoffs(), n, tail(p.stdout.String(), 3), p.stderr.String())
		}
		got = p.handoffs()
		return got > n
	})
	return got
}

// tail is the last n lines of s: a progress-printing child's output is
// long, and its end says what happened.
func tail(s string, n int) string {
	lines := strings.SplitAfter(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "")
}

// fds counts the process's open descriptors.
func (p *proc) fds() int {
	p.t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p.cmd.Process.Pid))
	if err != nil {
		p.t.Fatalf("%s: %v", p.name, err)
	}
	return len(ents)
}

// goroutines is the producer's goroutine count from its latest progress
// line (it must run with -report-every). Goroutines, not OS threads: the
// Go runtime keeps the threads a burst of work made it start, so their
// count says nothing of a leak.
func (p *proc) goroutines() int {
	p.t.Helper()
	n := -1
	var pr app.ProducerProgress
	waitFor(p.t, p.name+"'s progress line", 20*time.Second, func() bool {
		sc := bufio.NewScanner(bytes.NewReader(p.stdout.Bytes()))
		for sc.Scan() {
			if json.Unmarshal(sc.Bytes(), &pr) == nil && pr.Role == "producer-progress" {
				n = pr.Goroutines
			}
		}
		return n >= 0
	})
	return n
}

// limitFDs lowers the process's descriptor limit (soft and hard) to n, as
// a machine with the common default of 1024 would have it; a Go program
// raises its soft limit to the hard one, so the hard one is what counts.
func (p *proc) limitFDs(n uint64) {
	p.t.Helper()
	if err := unix.Prlimit(p.cmd.Process.Pid, unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: n, Max: n}, nil); err != nil {
		p.t.Fatalf("limit %s's descriptors: %v", p.name, err)
	}
}

// counts parses "KEY a=1 b=2" lines of the hostile clients.
func counts(t *testing.T, line string) map[string]int {
	t.Helper()
	m := map[string]int{}
	for _, f := range strings.Fields(line)[1:] {
		k, v, ok := strings.Cut(f, "=")
		n, err := strconv.Atoi(v)
		if !ok || err != nil {
			t.Fatalf("cannot parse %q", line)
		}
		m[k] = n
	}
	return m
}

// TestDefectWriteDeadlineCleared (defect 1): a write deadline set for one
// write must not stay armed for the next. With -write-timeout 1s on both
// sides, a consumer that works 20 ms per batch runs for 9 s, and the
// producer is stopped for 2 s in the middle: the consumer, whose connection
// has been quiet past the write timeout in both directions, keeps being
// served after the producer resumes and ends with the producer's goodbye,
// not with exit 5. The steady part lasts 3 s, three write timeouts.
func TestDefectWriteDeadlineCleared(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-ring", "8", "-size", "64KiB", "-fill=false", "-duration", "9s", "-write-timeout", "1s", "-consumers", "1")
	c := e.consumer("consumer", "-workers", "1", "-work", "20ms", "-verify", "none", "-write-timeout", "1s", "-report-every", "100ms")
	// Steady work past both write timeouts.
	n := c.servedPast(0, 20*time.Second)
	time.Sleep(3 * time.Second)
	c.servedPast(n, 10*time.Second)

	prod.signal(syscall.SIGSTOP)
	time.Sleep(2 * time.Second)
	prod.signal(syscall.SIGCONT)
	c.servedPast(c.handoffs()+10, 20*time.Second)

	cr := c.consumerDone(30 * time.Second)
	pr := prod.producerDone(30 * time.Second)
	if cr.End != "producer said goodbye" || pr.End != "duration" {
		t.Errorf("the consumer ended by %q, the producer by %q; want the goodbye after the duration", cr.End, pr.End)
	}
	if pr.ConsumersDropped != 0 || pr.ConsumersLost != 0 {
		t.Errorf("the producer dropped %d and lost %d consumers; the consumer was well behaved", pr.ConsumersDropped, pr.ConsumersLost)
	}
}

// TestDefectStoppedConsumerStarvesOthers (defect 2): a stopped consumer
// must not take the whole ring from the others.
//
//   - one-to-one: ring 8, two consumers of 8 credits, -max-leases 4 and
//     -lease-timeout 2s; one is stopped: the other keeps being served while
//     it is stopped; after the lease timeout the stopped one is dropped
//     (ConsumersDropped >= 1) and, resumed, exits 8 saying it held a batch
//     past the lease timeout, not that the producer vanished.
//   - broadcast: one of three consumers (4 credits, ring 8) is stopped: the
//     other two keep receiving every batch it misses, and the producer
//     reports the misses (BroadcastMissed > 0).
func TestDefectStoppedConsumerStarvesOthers(t *testing.T) {
	t.Run("one-to-one", func(t *testing.T) {
		e := newEnv(t, "")
		prod := e.producer("-ring", "8", "-size", "64KiB", "-consumers", "2", "-lease-timeout", "2s", "-max-leases", "4", "-v")
		victim := e.consumer("stopped", "-credits", "8", "-work", "1ms", "-report-every", "100ms")
		other := e.consumer("other", "-credits", "8", "-report-every", "100ms")
		connected(t, prod, 2)
		victim.servedPast(20, 20*time.Second)
		other.servedPast(20, 20*time.Second)

		victim.signal(syscall.SIGSTOP)
		// Served while the victim is stopped, before and after its drop.
		other.servedPast(other.handoffs()+500, 20*time.Second)
		// Twice the lease timeout: the drop has happened by then, and
		// what the producer sent the victim waits in its socket.
		time.Sleep(4 * time.Second)
		other.servedPast(other.handoffs()+500, 20*time.Second)
		victim.signal(syscall.SIGCONT)
		victim.expectExit(app.ExitDropped, 20*time.Second)
		mustContain(t, "the dropped consumer's error", victim.stderr.String(),
			"the producer dropped this consumer for a timeout", "longer than the producer's lease timeout")
		if strings.Contains(victim.stderr.String(), "went away without saying goodbye") {
			t.Errorf("the dropped consumer blames a vanished producer:\n%s", victim.stderr.String())
		}

		prod.signal(syscall.SIGTERM)
		or := other.consumerDone(30 * time.Second)
		pr := prod.producerDone(30 * time.Second)
		if pr.ConsumersDropped < 1 || or.End != "producer said goodbye" {
			t.Errorf("producer dropped %d consumer(s), want the stopped one; the other ended by %q", pr.ConsumersDropped, or.End)
		}
	})

	t.Run("broadcast", func(t *testing.T) {
		e := newEnv(t, "")
		prod := e.producer("-broadcast", "-ring", "8", "-size", "64KiB", "-consumers", "3", "-v")
		victim := e.consumer("stopped", "-credits", "4", "-work", "1ms", "-report-every", "100ms")
		a := e.consumer("a", "-report-every", "100ms")
		b := e.consumer("b", "-report-every", "100ms")
		connected(t, prod, 3)
		victim.servedPast(20, 20*time.Second)

		victim.signal(syscall.SIGSTOP)
		a.servedPast(a.handoffs()+300, 20*time.Second)
		b.servedPast(b.handoffs()+300, 20*time.Second)
		victim.signal(syscall.SIGCONT)

		prod.signal(syscall.SIGTERM)
		for _, c := range []*proc{a, b, victim} {
			if r := c.consumerDone(30 * time.Second); r.End != "producer said goodbye" {
				t.Errorf("%s ended by %q", c.name, r.End)
			}
		}
		pr := prod.producerDone(30 * time.Second)
		if pr.BroadcastMissed == 0 {
			t.Errorf("the producer reports no broadcast missed, with a consumer stopped while %d batches went out", pr.Batches)
		}
	})
}

// TestDefectSilentConnections (defect 3): 48 silent connections, replaced
// every 2 seconds so that none reaches the handshake timeout, must not keep
// a real consumer from connecting and being served.
func TestDefectSilentConnections(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-ring", "4", "-size", "64KiB", "-consumers", "1")
	e.waitSocket(prod)
	flood := e.hostile("silent-refresh")
	flood.line("OPEN", 20*time.Second)
	// Past one refresh, so that the consumer meets replaced connections.
	time.Sleep(2500 * time.Millisecond)
	c := e.consumer("consumer", "-count", "200")
	c.consumerDone(60 * time.Second)
	if !flood.running() {
		t.Fatalf("the flood ended before the consumer was served: the test proves nothing\n%s", flood.stdout.String())
	}
	flood.cmd.Process.Kill()
	prod.signal(syscall.SIGTERM)
	prod.producerDone(30 * time.Second)
}

// TestDefectIdleConnectionFlood (defect 4): one process must not exhaust
// the producer.
//
//   - 2,000 handshaken idle connections, against a producer limited to
//     1,024 descriptors: the flooder is refused with the limit error (code
//     12), the producer never runs out of descriptors, its consumer keeps
//     being served and a newcomer is served while the flood is held.
//   - then 2,000 handshakes each closed without a goodbye by one process
//     that stays alive: the producer's descriptor and goroutine counts
//     come back to what they were before both floods (16 descriptors and
//     8 goroutines of slack), while that process still lives.
func TestDefectIdleConnectionFlood(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-ring", "8", "-size", "64KiB", "-consumers", "1", "-v", "-report-every", "50ms")
	e.waitSocket(prod)
	prod.limitFDs(1024)
	good := e.consumer("good", "-report-every", "100ms")
	good.servedPast(50, 20*time.Second)
	fds0, gor0 := prod.fds(), prod.goroutines()

	flood := e.hostile("idle-flood", envHostileN+"=2000")
	got := counts(t, flood.line("FLOOD", 60*time.Second))
	t.Logf("idle flood of 2000: %v", got)
	if got["limit"] == 0 {
		t.Errorf("the flooder was never refused with the limit error (code 12): %v", got)
	}
	good.servedPast(good.handoffs()+300, 20*time.Second)
	probe := e.consumer("probe", "-count", "100")
	probe.consumerDone(30 * time.Second)
	flood.signal(syscall.SIGTERM)
	flood.expectExit(0, 20*time.Second)

	churn := e.hostile("hello-close", envHostileN+"=2000")
	got = counts(t, churn.line("DONE", 60*time.Second))
	t.Logf("2000 handshakes closed without a goodbye: %v", got)
	var fds, gor int
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if fds, gor = prod.fds(), prod.goroutines(); fds <= fds0+16 && gor <= gor0+8 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the producer holds %d descriptors and %d goroutines, %d and %d before the floods, 20s after 2000 closed connections", fds, gor, fds0, gor0)
		}
	}
	good.servedPast(good.handoffs()+100, 20*time.Second)
	churn.signal(syscall.SIGTERM)
	churn.expectExit(0, 20*time.Second)

	prod.signal(syscall.SIGTERM)
	good.consumerDone(30 * time.Second)
	prod.producerDone(30 * time.Second)
	if s := prod.stderr.String(); strings.Contains(s, "too many open files") {
		t.Errorf("the producer ran out of descriptors:\n%s", s)
	}
	t.Logf("producer: %d descriptors and %d goroutines before the floods, %d and %d after", fds0, gor0, fds, gor)
}

// TestDefectClosedWhileLeased (defect 5): a consumer that maps an
// allocation, holds two leases in it and says `closed` for it unasked is
// dropped with a protocol error; the producer frees nothing while that
// process maps the memory (no violation, checked at the end), keeps
// serving a good consumer, and frees everything once that process is gone.
func TestDefectClosedWhileLeased(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-sharing", "ipc", "-ring", "8", "-size", "64KiB", "-fill=false", "-consumers", "1", "-shutdown-timeout", "30s")
	// The good consumer starts once the socket is there: twice in about
	// fifteen full runs here, one started before it dialled ENOENT for its
	// whole -wait (979 tries over 20 s) while the socket existed; not
	// understood yet (see the closing note of issue 8).
	e.waitSocket(prod)
	good := e.consumer("good", "-verify", "none", "-work", "1ms")
	h := e.hostile("closed-while-leased")
	h.line("MAPPED", 20*time.Second)
	reply := h.line("GOT", 20*time.Second)
	if !strings.HasPrefix(reply, "GOT error 5 ") && !strings.HasPrefix(reply, "GOT error 7 ") {
		t.Errorf("the producer answered `closed` for a leased allocation with %q, want a protocol error (unexpected_message)", reply)
	}
	e.consumer("probe", "-count", "200", "-verify", "none").consumerDone(30 * time.Second)

	// Shutdown retires the ring while the hostile process maps it; the
	// process then releases its leases (a producer that trusted `closed`
	// frees now, under the mapping) and unmaps a second later.
	prod.signal(syscall.SIGTERM)
	h.signal(syscall.SIGTERM)
	h.expectExit(0, 20*time.Second)
	mustContain(t, "the hostile consumer", h.stdout.String(), "UNMAPPED")
	if strings.Contains(h.stdout.String(), "FAIL") {
		t.Errorf("hostile consumer:\n%s", h.stdout.String())
	}
	good.consumerDone(30 * time.Second)
	prod.producerDone(30 * time.Second)
}

// TestDefectConnectionHandedToChild (defect 6): a consumer hands its
// connection to a child process and exits; the child maps the buffers and
// holds two leases. While the connection is open the producer must not
// reclaim or free them (the producer's SO_PEERCRED pid is dead, the memory
// is mapped): no violation. Once the child unmaps and exits, everything is
// freed and the producer shuts down cleanly.
func TestDefectConnectionHandedToChild(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-sharing", "ipc", "-ring", "8", "-size", "64KiB", "-fill=false", "-consumers", "1", "-shutdown-timeout", "30s", "-v")
	// The good consumer starts once the socket is there: twice in about
	// fifteen full runs here, one started before it dialled ENOENT for its
	// whole -wait (979 tries over 20 s) while the socket existed; not
	// understood yet (see the closing note of issue 8).
	e.waitSocket(prod)
	good := e.consumer("good", "-verify", "none", "-work", "1ms")
	parent := e.hostile("handoff-parent")
	child, err := strconv.Atoi(strings.Fields(parent.line("CHILD", 20*time.Second))[1])
	if err != nil {
		t.Fatal(err)
	}
	// The child shares the parent's stdout, which stays open until the
	// child exits.
	t.Cleanup(func() { syscall.Kill(child, syscall.SIGKILL) })
	parent.line("PARENT GONE", 20*time.Second)
	parent.line("HOLDING", 20*time.Second)

	e.consumer("probe", "-count", "200", "-verify", "none").consumerDone(30 * time.Second)
	// Shutdown retires the ring while the child maps it: it must wait
	// (and the good consumer with it, for its goodbye).
	prod.signal(syscall.SIGTERM)
	time.Sleep(time.Second)
	if !prod.running() {
		t.Errorf("the producer finished its shutdown while the child still held leases and a mapping")
	}
	syscall.Kill(child, syscall.SIGTERM)
	parent.expectExit(0, 20*time.Second) // its stdout closes with the child
	mustContain(t, "the child", parent.stdout.String(), "UNMAPPED")
	if strings.Contains(parent.stdout.String(), "FAIL") {
		t.Errorf("hostile child:\n%s", parent.stdout.String())
	}
	good.consumerDone(30 * time.Second)
	prod.producerDone(30 * time.Second)
}

// TestDefectShutdownTimeoutStuckConsumer (defects 7 and 8): one consumer is
// stopped holding leases, with a lease timeout (30 s) longer than the
// producer's -shutdown-timeout (2 s). The producer's Shutdown times out:
// the good consumers still get a goodbye and exit 0; the producer exits 1
// saying what happened and why (the shutdown timeout, memory left to the
// driver) and does not destroy memory that is still mapped. Once the stuck
// consumer is killed, everything is freed with no violation.
func TestDefectShutdownTimeoutStuckConsumer(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-sharing", "ipc", "-ring", "8", "-size", "64KiB", "-consumers", "3", "-lease-timeout", "30s", "-shutdown-timeout", "2s", "-v")
	a := e.consumer("a", "-work", "1ms", "-report-every", "100ms")
	b := e.consumer("b", "-report-every", "100ms")
	stuck := e.consumer("stuck", "-credits", "2", "-work", "1ms", "-report-every", "100ms")
	connected(t, prod, 3)
	stuck.servedPast(20, 20*time.Second)
	stuck.signal(syscall.SIGSTOP)
	a.servedPast(a.handoffs()+100, 20*time.Second)

	prod.signal(syscall.SIGTERM)
	for _, c := range []*proc{a, b} {
		if r := c.consumerDone(30 * time.Second); r.End != "producer said goodbye" {
			t.Errorf("%s ended by %q", c.name, r.End)
		}
	}
	prod.expectExit(app.ExitFailure, 30*time.Second)
	var pr app.ProducerReport
	prod.report(&pr)
	mustContain(t, "the producer's error", prod.stderr.String(),
		"within -shutdown-timeout 2s", "were not freed", "without destroying its CUDA context")
	if pr.AllocationsLeft == 0 {
		t.Errorf("the producer reports no allocation left, with a stopped consumer mapping its ring")
	}
	stuck.cmd.Process.Kill()
	stuck.wait(10 * time.Second)
}

// TestDefectReleaseNotHeld: releasing a sequence number twice, or one that
// was never sent, within the credits (so that only the sharing layer can
// tell), drops the peer with a protocol error (unexpected_message); the
// producer keeps serving.
func TestDefectReleaseNotHeld(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-sharing", "ipc", "-ring", "8", "-size", "64KiB", "-fill=false", "-consumers", "1")
	// Started once the socket is there (see TestDefectClosedWhileLeased).
	e.waitSocket(prod)
	good := e.consumer("good", "-verify", "none", "-work", "1ms")
	for _, kind := range []string{"release-twice", "release-never-sent"} {
		h := e.hostile(kind)
		h.expectExit(0, 30*time.Second)
		if got := strings.TrimSpace(h.stdout.String()); !strings.HasPrefix(got, "GOT error 5 ") {
			t.Errorf("hostile %s: got %q, want the unexpected_message error (code 5)", kind, got)
		}
	}
	e.consumer("probe", "-count", "200", "-verify", "none").consumerDone(30 * time.Second)
	prod.signal(syscall.SIGTERM)
	good.consumerDone(30 * time.Second)
	prod.producerDone(30 * time.Second)
}
