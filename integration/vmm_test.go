package integration

import (
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/app"
)

// TestVMMStuckConsumerDoesNotPin: with VMM sharing, a consumer stopped
// while it holds leases (SIGSTOP) is dropped at the lease deadline and no
// longer pins anything: the producer gives up the buffers it held (it never
// writes them again), puts fresh memory in the ring, keeps serving the
// others, and at the end frees everything and exits 0, while the stopped
// process still maps the old memory. Compare
// TestDefectShutdownTimeoutStuckConsumer, where legacy IPC must leave that
// memory allocated until the stuck process exits.
func TestVMMStuckConsumerDoesNotPin(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-sharing", "vmm", "-ring", "8", "-size", "64KiB", "-consumers", "3",
		"-lease-timeout", "2s", "-shutdown-timeout", "10s", "-v")
	a := e.consumer("a", "-work", "1ms", "-report-every", "100ms")
	b := e.consumer("b", "-report-every", "100ms")
	stuck := e.consumer("stuck", "-credits", "2", "-work", "1ms", "-report-every", "100ms")
	defer stuck.cmd.Process.Kill()
	connected(t, prod, 3)
	stuck.servedPast(20, 20*time.Second)
	stuck.signal(syscall.SIGSTOP)
	// Past the lease deadline, the others are still served: the stopped
	// consumer's buffers were replaced.
	time.Sleep(3 * time.Second)
	a.servedPast(a.handoffs()+200, 20*time.Second)
	b.servedPast(b.handoffs()+200, 20*time.Second)

	prod.signal(syscall.SIGTERM)
	for _, c := range []*proc{a, b} {
		if r := c.consumerDone(30 * time.Second); r.End != "producer said goodbye" || r.VerifyErrors != 0 {
			t.Errorf("%s ended by %q with %d wrong batches", c.name, r.End, r.VerifyErrors)
		}
	}
	pr := prod.producerDone(30 * time.Second)
	if pr.Sharing != "vmm" || pr.AllocationsLeft != 0 || pr.ConsumersDropped != 1 || pr.Abandoned == 0 || pr.Replaced == 0 {
		t.Errorf("producer: sharing %s, %d allocations left, %d dropped, %d buffers abandoned, %d allocations replaced; want vmm, 0, 1, >0, >0",
			pr.Sharing, pr.AllocationsLeft, pr.ConsumersDropped, pr.Abandoned, pr.Replaced)
	}
	// The stopped consumer wakes to find itself dropped; what it held
	// still reads right (its batches were verified before it stopped, and
	// its mapping stays valid until it unmaps).
	stuck.signal(syscall.SIGCONT)
	if code := stuck.wait(30 * time.Second); code != app.ExitDropped {
		t.Errorf("the stuck consumer exited %d, want %d (dropped); stderr:\n%s", code, app.ExitDropped, stuck.stderr.String())
	}
}

// TestVMMStuckConsumerArena: the same with fresh buffers from an arena
// (-fresh) of one buffer (2 MiB, the VMM granularity of the simulator and
// of the H100 and H200), which the stuck consumer holds (-work 10s) past
// the lease deadline. An arena cannot put fresh memory in place of the
// range it gives up to the lost consumer; with that range the whole arena
// is gone, and Arena.Alloc says so (ErrAbandoned) instead of waiting for
// ever: the producer makes a new arena, retires the old one, and the other
// consumer is served again.
func TestVMMStuckConsumerArena(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-sharing", "vmm", "-fresh", "-ring", "1", "-size", "2MiB", "-consumers", "2",
		"-lease-timeout", "2s", "-shutdown-timeout", "10s", "-v")
	a := e.consumer("a", "-report-every", "100ms")
	stuck := e.consumer("stuck", "-credits", "1", "-work", "10s", "-report-every", "100ms")
	defer stuck.cmd.Process.Kill()
	connected(t, prod, 2)
	// Past the lease deadline of whatever the stuck consumer took first.
	time.Sleep(3 * time.Second)
	a.servedPast(a.handoffs()+200, 20*time.Second)

	prod.signal(syscall.SIGTERM)
	if r := a.consumerDone(30 * time.Second); r.End != "producer said goodbye" || r.VerifyErrors != 0 {
		t.Errorf("a ended by %q with %d wrong batches", r.End, r.VerifyErrors)
	}
	pr := prod.producerDone(30 * time.Second)
	if pr.Sharing != "vmm" || pr.AllocationsLeft != 0 || pr.ConsumersDropped != 1 || pr.Abandoned != 1 || pr.ArenasReplaced != 1 {
		t.Errorf("producer: sharing %s, %d allocations left, %d dropped, %d buffers abandoned, %d arenas replaced; want vmm, 0, 1, 1, 1",
			pr.Sharing, pr.AllocationsLeft, pr.ConsumersDropped, pr.Abandoned, pr.ArenasReplaced)
	}
}
