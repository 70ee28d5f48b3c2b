package integration

import (
	"encoding/json"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/share"
)

// top runs `cudashare top -once -json` against the test's producer and
// returns its snapshot.
func (e *env) top() share.ExporterSnapshot {
	e.t.Helper()
	out, err := exec.Command(bins.cudashare, "top", "-once", "-json", e.sock).Output()
	if err != nil {
		msg := ""
		if ee, ok := err.(*exec.ExitError); ok {
			msg = string(ee.Stderr)
		}
		e.t.Fatalf("cudashare top: %v\n%s", err, msg)
	}
	var s share.ExporterSnapshot
	if err := json.Unmarshal(out, &s); err != nil {
		e.t.Fatalf("cudashare top -json: %v\n%s", err, out)
	}
	return s
}

// TestTopNamesStuckConsumer: a consumer that holds leases and is then
// stopped (SIGSTOP) is named by `cudashare top -once -json`: its pid, the
// leases it holds, the oldest's age and buffer; top is not counted as a
// consumer, and the other consumer keeps being served meanwhile.
func TestTopNamesStuckConsumer(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-ring", "8", "-size", "64KiB", "-consumers", "2", "-lease-timeout", "10m", "-max-leases", "4", "-v")
	victim := e.consumer("stopped", "-credits", "4", "-work", "50ms", "-report-every", "100ms")
	other := e.consumer("other", "-credits", "4", "-report-every", "100ms")
	connected(t, prod, 2)
	victim.servedPast(4, 20*time.Second)
	victim.signal(syscall.SIGSTOP)
	// What it holds when stopped stays held: the other is served past it.
	other.servedPast(other.handoffs()+200, 20*time.Second)

	s := e.top()
	find := func(s *share.ExporterSnapshot) *share.ConsumerSnapshot {
		for i := range s.Consumers {
			if s.Consumers[i].PID == int32(victim.cmd.Process.Pid) {
				return &s.Consumers[i]
			}
		}
		return nil
	}
	if s.Stats.Consumers != 2 || len(s.Consumers) != 2 {
		t.Fatalf("top lists %d consumers (%d counted), want the 2 consumers and not itself: %+v", len(s.Consumers), s.Stats.Consumers, s.Consumers)
	}
	pid := victim.cmd.Process.Pid
	v := find(&s)
	if v == nil {
		t.Fatalf("top does not name the stopped consumer, pid %d: %+v", pid, s.Consumers)
	}
	if v.Leases < 1 || v.OldestLease <= 0 || v.OldestSize != 64<<10 || v.LeasedBytes < 64<<10 || v.Comm == "" {
		t.Errorf("the stopped consumer: %+v; want its leases, the oldest's age and buffer, its executable", *v)
	}
	// Its oldest lease ages while it is stopped; the snapshot after shows more.
	other.servedPast(other.handoffs()+200, 20*time.Second)
	s2 := e.top()
	if v2 := find(&s2); v2 == nil || v2.OldestLease <= v.OldestLease || v2.Leases != v.Leases {
		t.Errorf("the second snapshot does not show pid %d's %d leases, the oldest older than %v: %+v", pid, v.Leases, v.OldestLease, s2.Consumers)
	}
	victim.signal(syscall.SIGCONT)
	prod.signal(syscall.SIGTERM)
	for _, c := range []*proc{victim, other} {
		if r := c.consumerDone(30 * time.Second); r.End != "producer said goodbye" {
			t.Errorf("%s ended by %q", c.name, r.End)
		}
	}
	prod.producerDone(30 * time.Second)
}
