package integration

import (
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/internal/app"
)

// connected waits until the producer (started with -v) has logged n
// consumer arrivals.
func connected(t *testing.T, prod *proc, n int) {
	t.Helper()
	waitFor(t, itoa(n)+" consumer(s) connected", 20*time.Second, func() bool {
		if !prod.running() {
			t.Fatalf("producer exited (%d)\nstderr:\n%s", prod.code, prod.stderr.String())
		}
		return strings.Count(prod.stderr.String(), "consumer connected") >= n
	})
}

// TestKillConsumerAtRandomPoints SIGKILLs consumers at random moments of
// their life (starting, handshaking, mapping, holding buffers in work) while
// another consumer keeps working: the producer reclaims what each victim
// held once its process is gone, so a ring of 8 buffers keeps flowing
// although the victims together held far more than 8 at their deaths, and
// at the end it frees everything.
func TestKillConsumerAtRandomPoints(t *testing.T) {
	trials := 16
	if testing.Short() {
		trials = 6
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d (kill delays are drawn from it)", seed)
	rng := rand.New(rand.NewPCG(seed, 0))

	e := newEnv(t, "")
	// Delays span a consumer's life: starting, opening the driver (a CUDA
	// context takes a few hundred milliseconds on a GPU), handshaking,
	// mapping, working with buffers held.
	span := 250
	if e.onCUDA() {
		span = 800
	}
	prod := e.producer("-ring", "8", "-size", "64KiB", "-consumers", "1")
	steady := e.consumer("steady", "-credits", "2")
	for i := range trials {
		victim := e.consumer("victim "+itoa(i+1), "-credits", "3", "-work", "2ms")
		time.Sleep(time.Duration(rng.IntN(span)) * time.Millisecond)
		victim.cmd.Process.Kill()
		if code := victim.wait(10 * time.Second); code != 128+int(syscall.SIGKILL) {
			t.Fatalf("victim %d exited with %d before it was killed\nstderr:\n%s", i+1, code, victim.stderr.String())
		}
		if !prod.running() || !steady.running() {
			t.Fatalf("after victim %d: producer running %v, steady consumer running %v\nproducer:\n%s\nsteady:\n%s",
				i+1, prod.running(), steady.running(), prod.stderr.String(), steady.stderr.String())
		}
	}
	// The producer still serves, from a ring whose buffers came back.
	probe := e.consumer("probe", "-count", "300")
	probe.consumerDone(30 * time.Second)

	prod.signal(syscall.SIGTERM)
	sr := steady.consumerDone(30 * time.Second)
	pr := prod.producerDone(30 * time.Second)
	t.Logf("%d of %d victims had connected when killed; %d batches, steady consumer got %d", pr.ConsumersLost, trials, pr.Batches, sr.Handoffs)
	if pr.ConsumersLost > uint64(trials) {
		t.Errorf("producer lost %d consumers, only %d were killed\nproducer:\n%s", pr.ConsumersLost, trials, prod.stderr.String())
	}
	if sr.End != "producer said goodbye" {
		t.Errorf("steady consumer ended by %q", sr.End)
	}
}

// TestKillProducer: consumers of a producer that is SIGKILLed exit within
// a second with a clear error and exit code 5; the simulator then holds no
// memory and recorded no violation (checked by newEnv).
func TestKillProducer(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-ring", "8", "-size", "64KiB", "-consumers", "2", "-v")
	a := e.consumer("a", "-work", "1ms")
	b := e.consumer("b")
	connected(t, prod, 2)
	time.Sleep(200 * time.Millisecond) // batches in flight, buffers held
	killed := time.Now()
	prod.cmd.Process.Kill()
	prod.wait(10 * time.Second)
	for _, c := range []*proc{a, b} {
		c.expectExit(app.ExitProducerGone, 10*time.Second)
		d := c.ended.Sub(killed)
		t.Logf("%s exited %v after the producer was killed", c.name, d.Round(time.Millisecond))
		if d > time.Second {
			t.Errorf("%s exited %v after the producer was killed, want within a second", c.name, d)
		}
		mustContain(t, c.name+"'s stderr", c.stderr.String(), "went away without saying goodbye")
		var r app.ConsumerReport
		c.report(&r)
		if r.Handoffs == 0 || r.VerifyErrors != 0 {
			t.Errorf("%s: %d handoffs, %d wrong before the producer died", c.name, r.Handoffs, r.VerifyErrors)
		}
	}
}

// TestStalledConsumer: a consumer that stops reading (SIGSTOP) holds at
// most its credits; the producer offers to the others meanwhile. Killed,
// its buffers come back and the producer shuts down cleanly.
func TestStalledConsumer(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-ring", "8", "-size", "64KiB", "-consumers", "2", "-v")
	stalled := e.consumer("stalled", "-credits", "2", "-work", "1ms")
	other := e.consumer("other", "-credits", "4")
	connected(t, prod, 2)
	time.Sleep(100 * time.Millisecond)
	stalled.signal(syscall.SIGSTOP)
	probe := e.consumer("probe", "-count", "500")
	probe.consumerDone(30 * time.Second)
	if !other.running() || !prod.running() {
		t.Fatal("the producer or the other consumer stopped while one consumer was stalled")
	}
	stalled.cmd.Process.Kill()
	stalled.wait(10 * time.Second)
	prod.signal(syscall.SIGTERM)
	or := other.consumerDone(30 * time.Second)
	pr := prod.producerDone(30 * time.Second)
	if pr.ConsumersLost != 1 || or.Handoffs == 0 {
		t.Errorf("producer lost %d consumers (want the stalled one), the other consumer got %d batches", pr.ConsumersLost, or.Handoffs)
	}
}

// TestSocketRemoved: removing the socket file while the producer runs
// stops newcomers (with a clear error) but not the consumers connected.
func TestSocketRemoved(t *testing.T) {
	e := newEnv(t, "")
	const count = 3000
	prod := e.producer("-ring", "4", "-size", "64KiB", "-consumers", "1", "-count", itoa(count), "-v")
	a := e.consumer("a", "-work", "1ms")
	connected(t, prod, 1)
	if err := os.Remove(e.sock); err != nil {
		t.Fatal(err)
	}
	late := e.start("late consumer", bins.consumer, nil, "-socket", e.sock, "-json")
	late.expectExit(app.ExitSocket, 10*time.Second)
	mustContain(t, "the late consumer's error", late.stderr.String(), "no producer at "+e.sock, "start the producer first")
	if !prod.running() {
		t.Fatal("the producer finished its batches before the socket was removed: the test proves nothing; raise count")
	}
	ar := a.consumerDone(60 * time.Second)
	pr := prod.producerDone(30 * time.Second)
	if pr.Batches != count || ar.Handoffs != count {
		t.Errorf("producer offered %d and the consumer got %d batches, want %d", pr.Batches, ar.Handoffs, count)
	}
}

// TestProducerErrors: what a user gets wrong when starting a producer.
func TestProducerErrors(t *testing.T) {
	e := newEnv(t, "")
	prod := e.producer("-ring", "2", "-size", "4KiB")
	e.waitSocket(prod)

	second := e.start("second producer", bins.producer, nil, "-socket", e.sock)
	second.expectExit(app.ExitSocket, 10*time.Second)
	mustContain(t, "a second producer's error", second.stderr.String(), "another producer is already listening on "+e.sock)

	open, err := os.MkdirTemp("", "csit-open-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(open)
	if err := os.Chmod(open, 0o755); err != nil {
		t.Fatal(err)
	}
	unsafe := e.start("producer in an open directory", bins.producer, nil, "-socket", open+"/p.sock")
	unsafe.expectExit(app.ExitSocket, 10*time.Second)
	mustContain(t, "the unsafe directory error", unsafe.stderr.String(), "mode 0700")

	// A regular file where the socket should be is named as such, not
	// blamed on the directory (which is fine).
	file := e.sockDir + "/file.sock"
	if err := os.WriteFile(file, []byte("not a socket"), 0o600); err != nil {
		t.Fatal(err)
	}
	occupied := e.start("producer over a regular file", bins.producer, nil, "-socket", file)
	occupied.expectExit(app.ExitSocket, 10*time.Second)
	mustContain(t, "the regular file error", occupied.stderr.String(), "a regular file is there, not a socket")
	if strings.Contains(occupied.stderr.String(), "mode 0700") {
		t.Errorf("a regular file at -socket is blamed on the directory:\n%s", occupied.stderr.String())
	}

	long := e.start("producer with a long path", bins.producer, nil, "-socket", e.sockDir+"/"+strings.Repeat("x", 120))
	long.expectExit(app.ExitSocket, 10*time.Second)
	mustContain(t, "the long path error", long.stderr.String(), "shorter than 108 bytes")

	// The first producer never saw a consumer: SIGTERM ends it cleanly.
	prod.signal(syscall.SIGTERM)
	pr := prod.producerDone(30 * time.Second)
	if pr.End != "signal" || pr.Batches != 0 {
		t.Errorf("producer ended by %q after %d batches", pr.End, pr.Batches)
	}
}

// TestConsumerErrors: what a user gets wrong when starting a consumer.
func TestConsumerErrors(t *testing.T) {
	e := newEnv(t, "")
	run := func(name string, want int, says []string, args ...string) {
		t.Helper()
		p := e.start(name, bins.consumer, nil, args...)
		p.expectExit(want, 20*time.Second)
		mustContain(t, name, p.stderr.String(), says...)
	}
	run("no socket", app.ExitSocket, []string{"no producer at " + e.sock, "start the producer first"}, "-socket", e.sock)
	run("no socket after -wait", app.ExitSocket, []string{"no producer at"}, "-socket", e.sock, "-wait", "300ms")

	// A socket file nobody listens on, as a crashed producer leaves.
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: e.sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	run("stale socket", app.ExitSocket, []string{"no producer is listening on " + e.sock, "connection refused"}, "-socket", e.sock)
	os.Remove(e.sock)

	run("no such GPU", app.ExitNoDriver, []string{"no GPU 9"}, "-socket", e.sock, "-device", "9")
	if os.Getenv("CUDASHARE_DRIVER") == "" {
		run("unknown driver", app.ExitNoDriver, []string{"unknown driver"}, "-socket", e.sock, "-driver", "opencl")
	}
}

// TestUsage: -h explains the flags and the exit codes; bad flags exit 2.
func TestUsage(t *testing.T) {
	e := newEnv(t, "")
	for _, b := range []struct{ name, bin string }{{"producer", bins.producer}, {"consumer", bins.consumer}} {
		h := e.start(b.name+" -h", b.bin, nil, "-h")
		h.expectExit(app.ExitOK, 10*time.Second)
		mustContain(t, b.name+" -h", h.stdout.String(), "-socket", "-driver", "-device", "exit codes:", "5  consumer: the producer went away")
		for _, bad := range [][]string{{"-nosuchflag"}, {"-size", "12XB"}, {"-verify", "most"}, {"stray"}} {
			if b.name == "producer" && bad[0] == "-verify" {
				bad = []string{"-ring", "0"}
			}
			if b.name == "producer" && bad[0] == "stray" {
				bad = []string{"-ring", "4", "-group", "5"}
			}
			p := e.start(b.name+" "+strings.Join(bad, " "), b.bin, nil, bad...)
			p.expectExit(app.ExitUsage, 10*time.Second)
		}
	}
	mustContain(t, "producer -h", e.start("producer -h", bins.producer, nil, "-h").waitOut(), "-fresh", "-broadcast", "-event", "-count", "-duration", "-consumers")
	mustContain(t, "consumer -h", e.start("consumer -h", bins.consumer, nil, "-h").waitOut(), "-workers", "-credits", "-verify", "-read-test", "-json")
}

// TestCPUProfile: -cpuprofile writes a profile of the whole run from each
// binary (the benchmark's rows are profiled this way on a GPU machine with
// no Go toolchain); a file that cannot be made is a usage error that names
// the flag.
func TestCPUProfile(t *testing.T) {
	e := newEnv(t, "")
	dir := t.TempDir()
	pp, cp := filepath.Join(dir, "producer.pprof"), filepath.Join(dir, "consumer.pprof")
	prod := e.producer("-ring", "4", "-size", "64KiB", "-count", "200", "-cpuprofile", pp)
	c := e.consumer("consumer", "-cpuprofile", cp)
	c.consumerDone(30 * time.Second)
	prod.producerDone(30 * time.Second)
	for _, f := range []string{pp, cp} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		// A profile is a gzipped protocol buffer.
		if len(b) < 2 || b[0] != 0x1f || b[1] != 0x8b {
			t.Errorf("%s: %d bytes, not a gzipped profile", f, len(b))
		}
	}
	for _, b := range []struct{ name, bin string }{{"producer", bins.producer}, {"consumer", bins.consumer}} {
		p := e.start(b.name+" -cpuprofile in a missing directory", b.bin, nil, "-cpuprofile", filepath.Join(dir, "no", "such.pprof"))
		p.expectExit(app.ExitUsage, 10*time.Second)
		mustContain(t, b.name+"'s stderr", p.stderr.String(), "-cpuprofile", "no such file or directory")
	}
}

// waitOut waits for a child that must succeed and returns its stdout.
func (p *proc) waitOut() string {
	p.t.Helper()
	p.expectExit(0, 10*time.Second)
	return p.stdout.String()
}

// TestNoGPU: asking for the real driver where there is none exits 3 with
// a message that says what to do.
func TestNoGPU(t *testing.T) {
	e := newEnv(t, "")
	t.Setenv("CUDASHARE_DRIVER", "") // it would override -driver
	if _, err := driver.Open(driver.Config{Backend: driver.BackendCUDA}); err == nil {
		t.Skip("a CUDA driver with a GPU is here")
	}
	env := []string{"CUDASHARE_DRIVER="}
	for _, b := range []struct{ name, bin string }{{"producer", bins.producer}, {"consumer", bins.consumer}} {
		p := e.start(b.name+" -driver cuda", b.bin, env, "-driver", "cuda", "-socket", e.sock)
		p.expectExit(app.ExitNoDriver, 10*time.Second)
		if s := p.stderr.String(); !strings.Contains(s, "no CUDA driver") && !strings.Contains(s, "no GPU") {
			t.Errorf("%s: the error names neither a missing driver nor a missing GPU:\n%s", b.name, s)
		}
	}
}
