package app

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/seed743c36cf/cudashare/driver"
)

// Command makes the command that runs the producer or the consumer (role)
// with args as a child process bound to ctx (exec.CommandContext):
// cudashare re-runs its own executable with its hidden producer and
// consumer commands.
type Command func(ctx context.Context, role string, args ...string) *exec.Cmd

const demoSummary = `Runs a producer and consumer processes that share GPU buffers for a few
seconds, verifies every batch, and prints a short report. Without a GPU it
runs on the simulated driver and says so.
`

// RunDemo is `cudashare demo`: one producer and -consumers consumer
// processes, made by command, sharing a ring of buffers for -seconds.
func RunDemo(ctx context.Context, args []string, stdout, stderr io.Writer, command Command) int {
	fs := newFlagSet("cudashare demo", demoSummary, stderr)
	backend := fs.String("driver", driver.BackendAuto, "driver: auto (a GPU if there is one, else the simulator), cuda or sim; CUDASHARE_DRIVER overrides it")
	secs := fs.Float64("seconds", 3, "how long the producer offers batches")
	nCons := fs.Int("consumers", 2, "consumer processes")
	size := uint64(1 << 20)
	fs.Var(sizeFlag{&size}, "size", "bytes per buffer")
	ring := fs.Int("ring", 8, "buffers in the ring")
	pdev := fs.Int("device", 0, "the producer's GPU")
	cdev := fs.Int("consumer-device", -1, "the consumers' GPU (-1: the producer's)")
	verbose := fs.Bool("v", false, "show the children's logs")
	if code, done := parseFlags(fs, args, stdout); done {
		return code
	}
	if *secs <= 0 || *nCons < 1 || *ring < 1 || size == 0 {
		fmt.Fprintln(stderr, "cudashare demo: -seconds, -consumers, -ring and -size must be positive")
		return ExitUsage
	}
	if *cdev < 0 {
		*cdev = *pdev
	}

	// The simulator keeps its machine in a state directory; the demo gets
	// one of its own unless the caller chose one, so that its violation
	// count is its own.
	if os.Getenv("CUDASHARE_SIM_DIR") == "" {
		dir, err := os.MkdirTemp("", "cudashare-demo-sim-")
		if err != nil {
			fmt.Fprintf(stderr, "cudashare demo: %v\n", err)
			return ExitFailure
		}
		defer os.RemoveAll(dir)
		os.Setenv("CUDASHARE_SIM_DIR", dir)
		defer os.Unsetenv("CUDASHARE_SIM_DIR")
	}
	d, err := driver.Open(driver.Config{Backend: *backend})
	if err != nil {
		fmt.Fprintf(stderr, "cudashare demo: %v\n", explainDriverOpen(*backend, err))
		return ExitNoDriver
	}
	sockDir, err := os.MkdirTemp("", "cudashare-demo-") // mode 0700, as the protocol wants
	if err != nil {
		fmt.Fprintf(stderr, "cudashare demo: %v\n", err)
		return ExitFailure
	}
	defer os.RemoveAll(sockDir)
	sock := filepath.Join(sockDir, "demo.sock")

	// The children get the backend this process resolved, so that they
	// cannot pick another one.
	drv := d.Backend()
	wait := "30s"
	// The watchdog: children still running long after they should have
	// ended are interrupted, then killed.
	wctx, cancel := context.WithTimeout(ctx, time.Duration(*secs*float64(time.Second))+60*time.Second)
	defer cancel()
	prod := command(wctx, "producer", "-driver", drv, "-device", fmt.Sprint(*pdev), "-socket", sock,
		"-size", FormatSize(size), "-ring", fmt.Sprint(*ring), "-duration", fmt.Sprintf("%gs", *secs),
		"-consumers", fmt.Sprint(*nCons), "-wait", wait, "-json")
	var cons []*exec.Cmd
	for range *nCons {
		cons = append(cons, command(wctx, "consumer", "-driver", drv, "-device", fmt.Sprint(*cdev), "-socket", sock,
			"-wait", wait, "-workers", "2", "-verify", "async", "-json"))
	}
	children := append([]*exec.Cmd{prod}, cons...)
	outs := make([]*bytes.Buffer, len(children))
	errs := make([]*bytes.Buffer, len(children))
	for i, cmd := range children {
		outs[i], errs[i] = new(bytes.Buffer), new(bytes.Buffer)
		cmd.Stdout = outs[i]
		cmd.Stderr = errs[i]
		if *verbose {
			cmd.Stderr = io.MultiWriter(errs[i], stderr)
		}
		// An interrupted demo interrupts its children, which then shut
		// down gracefully; the watchdog below kills what still hangs.
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
		cmd.WaitDelay = 15 * time.Second
	}
	fmt.Fprintf(stdout, "cudashare demo: 1 producer and %d consumer processes share a ring of %d x %s GPU buffers for %gs\n",
		*nCons, *ring, FormatSize(size), *secs)

	for i, cmd := range children {
		if err := cmd.Start(); err != nil {
			fmt.Fprintf(stderr, "cudashare demo: start %s: %v\n", roleName(i), err)
			for _, c := range children[:i] {
				c.Process.Kill()
				c.Wait()
			}
			return ExitFailure
		}
	}
	codes := make([]int, len(children))
	for i, cmd := range children {
		codes[i] = exitStatus(cmd.Wait())
	}

	var pr ProducerReport
	crs := make([]ConsumerReport, len(cons))
	ok := true
	if err := lastJSON(outs[0], &pr); err != nil {
		ok = false
		fmt.Fprintf(stderr, "cudashare demo: no report from the producer: %v\n", err)
	}
	for i := range cons {
		if err := lastJSON(outs[i+1], &crs[i]); err != nil {
			ok = false
			fmt.Fprintf(stderr, "cudashare demo: no report from consumer %d: %v\n", i+1, err)
		}
	}
	for i, code := range codes {
		if code != 0 {
			ok = false
			fmt.Fprintf(stderr, "cudashare demo: %s exited with code %d; its log:\n%s", roleName(i), code, indent(errs[i].String()))
		}
	}

	// The report.
	driverLine := drv
	switch {
	case drv != driver.BackendSim:
		driverLine += ", the real CUDA driver (" + d.Reason() + ")"
	case !strings.HasPrefix(d.Reason(), "auto"):
		driverLine += ", the simulated driver, as asked (-driver sim or CUDASHARE_DRIVER=sim)"
	case strings.Contains(d.Reason(), "library not found"):
		driverLine += ", the simulated driver: no GPU found (libcuda.so.1 is not installed)"
	default:
		driverLine += ", the simulated driver: no GPU found (" + d.Reason() + ")"
	}
	row := func(k, format string, a ...any) {
		fmt.Fprintf(stdout, "  %-11s %s\n", k+":", fmt.Sprintf(format, a...))
	}
	row("driver", "%s", driverLine)
	row("devices", "%s", describeDevices(d, *pdev, *cdev))
	row("sharing", "%s", describeSharing(&pr))

	var recv, verified, wrong, unreadable, maps uint64
	var per []string
	var p50, p99 float64
	for _, r := range crs {
		recv += r.Handoffs
		verified += r.Verified
		wrong += r.VerifyErrors
		unreadable += r.Errors
		maps += r.Mappings
		per = append(per, fmt.Sprint(r.Handoffs))
		p50, p99 = max(p50, r.P50us), max(p99, r.P99us)
	}
	row("batches", "%d offered, %d received (%s), %d verified, %d wrong", pr.Batches, recv, strings.Join(per, " + "), verified, wrong+unreadable)
	if recv != pr.Batches || verified != recv || wrong+unreadable > 0 {
		ok = false
	}
	rate := 0.0
	if pr.Seconds > 0 {
		rate = float64(recv) / pr.Seconds
	}
	row("handoffs/s", "%.0f (all consumers together)", rate)
	// The consumers copy each batch on their streams and release it
	// stream-ordered (-verify async): a release that fell back to a host
	// wait would still verify, so the count is checked too.
	row("releases", "%d of %d stream-ordered, after each consumer's copy of its batch, with no host wait", pr.OrderedReleases, recv)
	if pr.OrderedReleases != recv {
		ok = false
	}
	row("latency", "p50 %.0f µs, p99 %.0f µs (offer to receipt, the slowest consumer's)", p50, p99)
	freed := "every buffer freed"
	if pr.AllocationsLeft > 0 || pr.Error != "" {
		freed = fmt.Sprintf("%d allocation(s) NOT freed", pr.AllocationsLeft)
		ok = false
	}
	row("memory", "%s offered in place, none copied to share it; %d mapping(s) opened in all; %s", humanBytes(pr.BytesOffered), maps, freed)

	if v, err := d.Violations(); errors.Is(err, driver.ErrStrictUnsupported) {
		row("violations", "n/a (real driver: only the simulator checks lifetimes)")
	} else if err != nil {
		row("violations", "unknown: %v", err)
		ok = false
	} else {
		row("violations", "%d", len(v))
		for _, x := range v {
			fmt.Fprintf(stdout, "    %+v\n", x)
		}
		if len(v) > 0 {
			ok = false
		}
	}
	if !ok {
		row("result", "FAILED")
		writeConsumerTable(stdout, pr.Consumers)
		return ExitFailure
	}
	row("result", "ok")
	writeConsumerTable(stdout, pr.Consumers)
	return ExitOK
}

func roleName(i int) string {
	if i == 0 {
		return "the producer"
	}
	return fmt.Sprintf("consumer %d", i)
}

func describeDevices(d *driver.Driver, pdev, cdev int) string {
	devs, err := d.Devices()
	if err != nil || len(devs) == 0 {
		return fmt.Sprint(err)
	}
	name, _ := devs[0].Name()
	s := fmt.Sprintf("%d x %s; producer on GPU %d", len(devs), name, pdev)
	if pdev < len(devs) {
		s += " (" + devs[pdev].UUID().String() + ")"
	}
	if cdev == pdev {
		return s + ", consumers on the same GPU"
	}
	return s + fmt.Sprintf(", consumers on GPU %d", cdev)
}

// lastJSON decodes the last line of out that holds a JSON object.
func lastJSON(out *bytes.Buffer, v any) error {
	var last []byte
	sc := bufio.NewScanner(bytes.NewReader(out.Bytes()))
	for sc.Scan() {
		if b := bytes.TrimSpace(sc.Bytes()); len(b) > 0 && b[0] == '{' {
			last = append(last[:0], b...)
		}
	}
	if last == nil {
		return errors.New("no JSON line in its output")
	}
	return json.Unmarshal(last, v)
}

func exitStatus(err error) int {
	if err == nil {
		return 0
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if code := ee.ExitCode(); code >= 0 {
			return code
		}
		return 128 + int(ee.Sys().(syscall.WaitStatus).Signal())
	}
	return ExitFailure
}

func indent(s string) string {
	if s == "" {
		return "    (nothing)\n"
	}
	var b strings.Builder
	for _, l := range strings.Split(strings.TrimRight(s, "\n"), "\n") {
		b.WriteString("    " + l + "\n")
	}
	return b.String()
}

// humanBytes writes a byte count for people: 1.5 GiB.
func humanBytes(n uint64) string {
	switch {
	case n >= 1<<40:
		return fmt.Sprintf("%.1f TiB", float64(n)/(1<<40))
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// describeSharing says which sharing path the producer took, and why.
func describeSharing(pr *ProducerReport) string {
	switch pr.Sharing {
	case "vmm":
		return "VMM allocations sent as file descriptors over the socket (" + pr.SharingWhy + ")"
	case "ipc":
		return "legacy CUDA IPC handles (" + pr.SharingWhy + ")"
	}
	return "unknown (" + pr.SharingWhy + ")"
}
