package integration

import (
	"bytes"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/app"
)

// PID namespaces (containers). Every process here shares the test's mount
// namespace's view of the socket directory and of the simulator's state
// directory: unshare --mount-proc gives each namespace a private /proc and
// nothing else of its own. The placements are those GPU.md measured on the
// real driver: legacy CUDA IPC handles open between a namespace and its
// child, either way, and fail between siblings (two containers) with
// CUDA_ERROR_INVALID_CONTEXT; VMM allocations passed as file descriptors
// import anywhere.

// nsPlacement says where the producer and the consumer run, relative to
// the test's PID namespace.
type nsPlacement struct {
	name               string
	producer, consumer bool // run under an unshare of its own
}

var nsPlacements = []nsPlacement{
	{name: "same"}, // both in the test's namespace
	{name: "consumer-in-child", consumer: true},        // the consumer's namespace is a child of the producer's
	{name: "producer-in-child", producer: true},        // the producer's namespace is a child of the consumer's
	{name: "siblings", producer: true, consumer: true}, // each in a namespace of its own: two containers
}

// unshareArgs runs a command as the first process of a new PID namespace,
// with a /proc of its own. --kill-child: the command dies with unshare,
// which is what the test's watchdog and cleanup kill.
var unshareArgs = []string{"--pid", "--fork", "--mount-proc", "--kill-child"}

// needUnshare skips the test where new PID namespaces cannot be made: no
// unshare command, or a kernel (or container runtime) that refuses the
// unshare(2) with EPERM, as it does for a process without CAP_SYS_ADMIN.
func needUnshare(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("no unshare command (util-linux): cannot make PID namespaces")
	}
	cmd := exec.Command("unshare", append(unshareArgs, "true")...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		// unshare prints "unshare: unshare failed: Operation not
		// permitted" and exits 1 when the kernel says EPERM.
		if strings.Contains(stderr.String(), "Operation not permitted") {
			t.Skipf("the kernel refuses new PID namespaces here (EPERM; not root, or a container without CAP_SYS_ADMIN): %s", strings.TrimSpace(stderr.String()))
		}
		t.Fatalf("unshare %s true: %v: %s", strings.Join(unshareArgs, " "), err, stderr.String())
	}
}

// startNS runs bin like start, under its own unshare if ns.
func (e *env) startNS(name string, ns bool, bin string, args ...string) *proc {
	e.t.Helper()
	if !ns {
		return e.start(name, bin, nil, args...)
	}
	cmd := exec.Command("unshare", append(append(append([]string{}, unshareArgs...), bin), args...)...)
	// A process group of its own, so that signalGroup reaches the command
	// too: unshare itself passes no signal on.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return e.startCmd(name, cmd)
}

// signalGroup signals p's process group: the command under unshare (which
// has a handler for the signal, else the kernel does not deliver it to
// the first process of a namespace) and unshare, which blocks it while
// it waits for the command.
func (p *proc) signalGroup(sig syscall.Signal) {
	p.t.Helper()
	if err := syscall.Kill(-p.cmd.Process.Pid, sig); err != nil {
		p.t.Fatalf("signal %v to %s's process group: %v", sig, p.name, err)
	}
}

// TestPIDNamespaces runs a producer and two consumers in each placement of
// nsPlacements (each consumer under an unshare of its own where the
// placement puts consumers in a namespace: the two are siblings of each
// other, which matters to no one), once with VMM sharing and once with
// legacy IPC. One consumer verifies every batch after the producer's event
// (or the host's wait), the other copies each batch on its own stream and
// releases stream-ordered (-verify async), so interprocess events go both
// ways. With VMM every placement works: every batch verified, the producer
// frees everything. With legacy IPC the siblings fail, and each consumer
// says why and what to do: run the producer with -sharing vmm. Each case
// runs with the consumers on the producer's GPU and, where there are two,
// on the other one (peer access: lazy for legacy handles, cuMemSetAccess
// for the consumer's device with VMM).
func TestPIDNamespaces(t *testing.T) {
	needUnshare(t)
	for _, sharing := range []string{"vmm", "ipc"} {
		for _, gpu := range []string{"same-gpu", "across-gpus"} {
			for _, pl := range nsPlacements {
				t.Run(sharing+"/"+gpu+"/"+pl.name, func(t *testing.T) {
					testPIDNamespace(t, sharing, gpu == "across-gpus", pl)
				})
			}
		}
	}
}

func testPIDNamespace(t *testing.T, sharing string, across bool, pl nsPlacement) {
	e := newEnv(t, "")
	cdev := "0"
	if across {
		e.needDevices(2)
		cdev = "1"
	}
	const batches = 300
	prod := e.startNS("producer", pl.producer, bins.producer,
		"-socket", e.sock, "-json", "-wait", "20s", "-v", "-consumers", "2", "-device", "0",
		"-sharing", sharing, "-ring", "4", "-size", "64KiB", "-count", itoa(batches),
		"-shutdown-timeout", "10s")
	var cons []*proc
	for _, verify := range []string{"every", "async"} {
		cons = append(cons, e.startNS("consumer "+verify, pl.consumer, bins.consumer,
			"-socket", e.sock, "-json", "-wait", "20s", "-v", "-verify", verify, "-device", cdev))
	}
	if sharing == "ipc" && pl.producer && pl.consumer {
		for _, c := range cons {
			code := c.wait(30 * time.Second)
			var r app.ConsumerReport
			c.report(&r)
			t.Logf("%s: exit %d, end %q: %s", c.name, code, r.End, r.Error)
			if code == app.ExitOK || r.Handoffs != 0 {
				t.Errorf("%s exited %d after %d batches with legacy IPC between sibling PID namespaces; want a failure before any batch\nstderr:\n%s",
					c.name, code, r.Handoffs, c.stderr.String())
			}
			mustContain(t, c.name+"'s error", r.Error, "sibling PID namespaces", "CUDA_ERROR_INVALID_CONTEXT", "-sharing vmm")
		}
		// The producer, with no consumer left, waits for
		// another: stop it; it must still free everything.
		prod.signalGroup(syscall.SIGTERM)
		pr := prod.producerDoneAnyEnd(30 * time.Second)
		t.Logf("producer: end %s, %d offers, %d consumers lost, %d dropped", pr.End, pr.Offers, pr.ConsumersLost, pr.ConsumersDropped)
		return
	}
	var total uint64
	for _, c := range cons {
		r := c.consumerDone(30 * time.Second)
		total += r.Handoffs
		if r.End != "producer said goodbye" || r.Handoffs == 0 || r.Verified != r.Handoffs {
			t.Errorf("%s: ended by %q after %d batches, %d verified; want the producer's goodbye, every batch verified",
				c.name, r.End, r.Handoffs, r.Verified)
		}
		if r.SameDevice == across {
			t.Errorf("%s on %s read memory on %s (same device %v), want across GPUs %v", c.name, r.DeviceUUID, r.ProducerDevice, r.SameDevice, across)
		}
	}
	pr := prod.producerDone(30 * time.Second)
	t.Logf("producer: sharing %s, %d batches, %d offers, %d allocations left; consumers: %d handoffs",
		pr.Sharing, pr.Batches, pr.Offers, pr.AllocationsLeft, total)
	if pr.Sharing != sharing {
		t.Errorf("producer shared by %s (%s), want %s", pr.Sharing, pr.SharingWhy, sharing)
	}
	if pr.End != "count" || pr.Batches != batches || total != batches {
		t.Errorf("producer: %d batches, ended by %s; consumers: %d handoffs; want %d, count, %d", pr.Batches, pr.End, total, batches, batches)
	}
	// With VMM an unwatchable consumer (pid 0: the producer's
	// namespace is below the consumer's, or beside it) is
	// nothing to warn about: no memory waits on the watch.
	// What each side's SO_PEERCRED pid of the other read.
	for _, line := range strings.Split(prod.stderr.String(), "\n") {
		if strings.Contains(line, "consumer connected") {
			t.Logf("producer: %s", line[strings.Index(line, "msg="):])
		}
	}
	for _, c := range cons {
		if strings.Contains(c.stderr.String(), "its pid reads 0 here") {
			t.Logf("%s: the producer's pid reads 0", c.name)
		}
	}
	for _, line := range strings.Split(prod.stderr.String(), "\n") {
		if sharing == "vmm" && strings.Contains(line, "level=WARN") && strings.Contains(line, "cannot be watched") {
			t.Errorf("the VMM producer warns that memory waits on a watch: %s", line)
		}
	}
	if t.Failed() {
		t.Logf("producer stderr:\n%s", prod.stderr.String())
		for _, c := range cons {
			t.Logf("%s stderr:\n%s", c.name, c.stderr.String())
		}
	}
}

// producerDoneAnyEnd waits for the producer to exit 0 however its batches
// ended, and checks that it freed everything.
func (p *proc) producerDoneAnyEnd(timeout time.Duration) app.ProducerReport {
	p.t.Helper()
	p.expectExit(app.ExitOK, timeout)
	var r app.ProducerReport
	p.report(&r)
	if r.AllocationsLeft != 0 || r.LeasesLeft != 0 {
		p.t.Errorf("producer left %d allocation(s) and %d lease(s) after shutdown", r.AllocationsLeft, r.LeasesLeft)
	}
	return r
}
