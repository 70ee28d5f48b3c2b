package integration

import (
	"flag"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/internal/app"
)

var soak = flag.Bool("soak", false, "run TestSoak (also CUDASHARE_SOAK=1): 70 s of load under every timeout")

// TestSoak puts one producer under 70 seconds of mixed load, longer than
// every timeout it has, and checks that nothing wears out. It runs only
// with -soak or CUDASHARE_SOAK=1 (.ci/run runs it once).
//
// Producer: ring of 8 x 64 KiB, -lease-timeout 3s, -write-timeout 2s,
// -max-leases 4, -shutdown-timeout 15s. With CUDASHARE_SOAK_ARENA=1, fresh
// buffers instead, from an arena of 4 x 512 KiB (one VMM granule of 2 MiB):
// with VMM, what the dropped and the killed consumers held is given up to
// them, and the producer must replace an arena that can no longer serve. Consumers (-write-timeout 2s,
// -report-every 1s, -verify sample:25):
//   - steady: -work 2ms; slow: one worker, -work 20ms, on the other GPU
//     where there are two (peer access);
//   - pauser: stopped for 1.5 s (under the lease timeout) every 10 s, then
//     resumed: never dropped;
//   - dropped: stopped for 7 s from second 15 (over the lease timeout), then
//     resumed: exits 8 with the lease-timeout message;
//   - victim: SIGKILLed at second 20 and replaced by a new consumer, on
//     the other GPU where there are two.
//
// Hostile load: 48 silent connections replaced every 2 s from second 5 to
// the end; 300 handshaken idle connections held from second 25 to 55; 500
// handshakes closed without a goodbye at second 35 by a process that stays
// alive until second 55.
//
// Asserted: steady, slow, pauser and (from its start) the replacement each
// get more batches in every 10-second window; the producer's descriptor
// count at the end, once the floods are gone, is within 16 of its count
// after warm-up (second 5), and its goroutine count (its -report-every line) within 8; every good
// consumer ends with the producer's goodbye, every verified batch right;
// the producer exits 0 having dropped at least the stopped consumer; and,
// as after every test, no simulator violation and no memory left.
func TestSoak(t *testing.T) {
	if !*soak && os.Getenv("CUDASHARE_SOAK") != "1" {
		t.Skip("a 70-second soak: run with -soak or CUDASHARE_SOAK=1")
	}
	const seconds = 70
	e := newEnv(t, "")
	buffers := []string{"-ring", "8", "-size", "64KiB"}
	if os.Getenv("CUDASHARE_SOAK_ARENA") == "1" {
		buffers = []string{"-fresh", "-ring", "4", "-size", "512KiB"}
	}
	prod := e.producer(append(buffers, "-consumers", "5", "-lease-timeout", "3s", "-write-timeout", "2s",
		"-max-leases", "4", "-shutdown-timeout", "15s", "-v", "-report-every", "200ms")...)
	common := []string{"-write-timeout", "2s", "-report-every", "1s", "-verify", "sample:25"}
	cons := func(name string, args ...string) *proc { return e.consumer(name, append(args, common...)...) }
	other := "0" // the GPU of the slow consumer and the replacement
	if devs, err := e.d.Devices(); err == nil && len(devs) > 1 {
		other = "1"
	}
	steady := cons("steady", "-work", "2ms")
	slow := cons("slow", "-workers", "1", "-work", "20ms", "-device", other)
	pauser := cons("pauser", "-work", "1ms")
	dropped := cons("dropped", "-work", "1ms")
	victim := cons("victim", "-work", "1ms")
	connected(t, prod, 5)
	var replacement *proc

	good := []*proc{steady, slow, pauser}
	last := map[*proc]uint64{}
	var fds0, gor0 int
	var silent, idle, churn *proc
	for sec := 1; sec <= seconds; sec++ {
		time.Sleep(time.Second)
		if !prod.running() {
			t.Fatalf("the producer exited at second %d (%d)\n%s", sec, prod.code, tail(prod.stderr.String(), 20))
		}
		switch sec {
		case 5:
			fds0, gor0 = prod.fds(), prod.goroutines()
			silent = e.hostile("silent-refresh")
		case 15:
			dropped.signal(syscall.SIGSTOP)
		case 20:
			victim.cmd.Process.Kill()
			victim.wait(10 * time.Second)
			replacement = cons("replacement", "-work", "1ms", "-device", other)
		case 22:
			dropped.signal(syscall.SIGCONT)
		case 25:
			idle = e.hostile("idle-flood", envHostileN+"=300")
		case 35:
			churn = e.hostile("hello-close", envHostileN+"=500")
		case 55:
			idle.signal(syscall.SIGTERM)
			churn.signal(syscall.SIGTERM)
		}
		if sec%10 == 3 {
			pauser.signal(syscall.SIGSTOP)
		}
		if sec%10 == 4 {
			time.Sleep(500 * time.Millisecond)
			pauser.signal(syscall.SIGCONT)
		}
		if sec%10 == 0 {
			if sec == 30 {
				good = append(good, replacement)
			}
			for _, c := range good {
				if !c.running() {
					t.Fatalf("second %d: %s exited (%d)\n%s\n%s", sec, c.name, c.code, tail(c.stdout.String(), 2), c.stderr.String())
				}
				n := c.handoffs()
				if n <= last[c] {
					t.Errorf("second %d: %s got no batch in 10 s (%d, %d before)", sec, c.name, n, last[c])
				}
				last[c] = n
			}
		}
	}
	dropped.expectExit(app.ExitDropped, 20*time.Second)
	mustContain(t, "the dropped consumer's error", dropped.stderr.String(), "the producer dropped this consumer for a timeout", "longer than the producer's lease timeout")
	for _, h := range []*proc{idle, churn} {
		h.expectExit(0, 20*time.Second)
	}
	silent.cmd.Process.Kill()
	silent.wait(10 * time.Second)

	var fds, gor int
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if fds, gor = prod.fds(), prod.goroutines(); fds <= fds0+16 && gor <= gor0+8 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("the producer holds %d descriptors and %d goroutines after the floods, %d and %d after warm-up", fds, gor, fds0, gor0)
			break
		}
	}
	t.Logf("producer: %d descriptors and %d goroutines after warm-up, %d and %d at the end", fds0, gor0, fds, gor)

	prod.signal(syscall.SIGTERM)
	for _, c := range good {
		r := c.consumerDone(30 * time.Second)
		if r.End != "producer said goodbye" {
			t.Errorf("%s ended by %q", c.name, r.End)
		}
		if (c == slow || c == replacement) && r.SameDevice != (other == "0") {
			t.Errorf("%s on %s read memory on %s, want GPU %s", c.name, r.DeviceUUID, r.ProducerDevice, other)
		}
	}
	pr := prod.producerDone(30 * time.Second)
	t.Logf("producer: %d batches, %d consumers lost, %d dropped; %d buffers abandoned, %d ring allocations and %d arenas replaced",
		pr.Batches, pr.ConsumersLost, pr.ConsumersDropped, pr.Abandoned, pr.Replaced, pr.ArenasReplaced)
	if pr.ConsumersDropped < 1 {
		t.Errorf("the producer dropped no consumer; one was stopped past the lease timeout")
	}
}
