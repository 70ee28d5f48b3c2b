package app

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/share"
)

// Exit codes, the same for the producer and the consumer, so that a script
// can tell a missing GPU from a missing producer without reading messages.
const (
	ExitOK           = 0 // done, every batch verified
	ExitFailure      = 1 // a failure, a batch that failed verification, or a protocol error from the producer
	ExitUsage        = 2 // bad flags
	ExitNoDriver     = 3 // no CUDA driver, no GPU, or no such device
	ExitSocket       = 4 // producer: cannot listen on the socket; consumer: no producer there
	ExitProducerGone = 5 // consumer: the producer vanished without a goodbye
	ExitNoPeerAccess = 6 // consumer: its GPU cannot map the producer's GPU memory
	ExitRefused      = 7 // consumer: refused (another user, protocol version mismatch, a limit)
	ExitDropped      = 8 // consumer: the producer dropped it (a lease held past its lease timeout, a protocol error)
	ExitRestarted    = 9 // consumer: the producer restarted (its goodbye said so) and -reconnect is off
)

const exitCodesHelp = `exit codes:
  0  done (consumer: every verified batch was right)
  1  failure, or a batch that failed verification; consumer: also a protocol
     error from the process at the socket (a malformed hello-ack, a bad ring
     segment, a message it cannot accept)
  2  usage: bad flags
  3  no CUDA driver or GPU (or no such -device); -driver sim runs without one
  4  producer: cannot listen on the socket (in use, or an unsafe directory);
     consumer: no producer at the socket
  5  consumer: the producer went away without saying goodbye (killed or crashed);
     with -reconnect, no producer came back within its deadline
  6  consumer: its GPU has no peer access to the producer's GPU
  7  consumer: refused by the producer (another user, or too many connections
     from this process) or protocol version mismatch
  8  consumer: dropped by the producer: it held a batch past the producer's
     -lease-timeout, or broke the protocol
  9  consumer: the producer restarted (SIGHUP; its goodbye said it comes back)
     and -reconnect is off
`

// DefaultSocket is where the producer listens and the consumer dials
// unless -socket says otherwise: share.DefaultSocketPath, a directory of
// this user's only that the producer creates with mode 0700.
func DefaultSocket() string { return share.DefaultSocketPath() }

// ParseSize reads a byte count: a number with an optional binary suffix,
// KiB, MiB, GiB or TiB (K, M, G, T and KB, MB, GB, TB mean the same: GPU
// buffers are sized in powers of two).
func ParseSize(s string) (uint64, error) {
	t := strings.TrimSpace(s)
	i := len(t)
	for i > 0 && (t[i-1] < '0' || t[i-1] > '9') {
		i--
	}
	num, unit := t[:i], strings.ToLower(strings.TrimSpace(t[i:]))
	shift := 0
	switch strings.TrimSuffix(strings.TrimSuffix(unit, "b"), "i") {
	case "":
		if unit != "" && unit != "b" {
			return 0, fmt.Errorf("size %q: unknown unit %q (use KiB, MiB, GiB or TiB)", s, t[i:])
		}
	case "k":
		shift = 10
	case "m":
		shift = 20
	case "g":
		shift = 30
	case "t":
		shift = 40
	default:
		return 0, fmt.Errorf("size %q: unknown unit %q (use KiB, MiB, GiB or TiB)", s, t[i:])
	}
	n, err := strconv.ParseUint(num, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("size %q: not a whole number of bytes with an optional KiB, MiB, GiB suffix", s)
	}
	if n > math.MaxUint64>>shift {
		return 0, fmt.Errorf("size %q: too large", s)
	}
	return n << shift, nil
}

// FormatSize writes a byte count the way ParseSize reads it, exactly when it can.
func FormatSize(n uint64) string {
	for _, u := range []struct {
		shift int
		name  string
	}{{40, "TiB"}, {30, "GiB"}, {20, "MiB"}, {10, "KiB"}} {
		if n >= 1<<u.shift && n%(1<<u.shift) == 0 {
			return strconv.FormatUint(n>>u.shift, 10) + u.name
		}
	}
	if n >= 1<<20 {
		return fmt.Sprintf("%.1fMiB", float64(n)/(1<<20))
	}
	return strconv.FormatUint(n, 10) + "B"
}

// sizeFlag is a flag.Value for byte counts.
type sizeFlag struct{ n *uint64 }

func (f sizeFlag) String() string {
	if f.n == nil || *f.n == 0 {
		return ""
	}
	return FormatSize(*f.n)
}

func (f sizeFlag) Set(s string) error {
	n, err := ParseSize(s)
	if err != nil {
		return err
	}
	*f.n = n
	return nil
}

func newFlagSet(name, summary string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: %s [flags]\n\n%s\nflags:\n", name, summary)
		fs.PrintDefaults()
		fmt.Fprintf(fs.Output(), "\n%s", exitCodesHelp)
	}
	return fs
}

// parseFlags parses args; done is true when the caller should return code
// at once (-h, or a usage error). Help goes to stdout, as it was asked for.
func parseFlags(fs *flag.FlagSet, args []string, stdout io.Writer) (code int, done bool) {
	for _, a := range args {
		if a == "-h" || a == "-help" || a == "--help" {
			fs.SetOutput(stdout)
			fs.Usage()
			return ExitOK, true
		}
		if a == "--" {
			break
		}
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return ExitOK, true
		}
		return ExitUsage, true
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "%s: unexpected argument %q (flags only; -h lists them)\n", fs.Name(), fs.Arg(0))
		return ExitUsage, true
	}
	return 0, false
}

// device is an opened driver with the primary context of one device.
type device struct {
	d    *driver.Driver
	dev  *driver.Device
	ctx  *driver.Context
	name string
}

// openDevice opens the driver and retains the primary context of the
// device with this ordinal. Its error is written for the user and goes with
// ExitNoDriver.
func openDevice(backend string, ordinal int) (*device, error) {
	d, err := driver.Open(driver.Config{Backend: backend})
	if err != nil {
		return nil, explainDriverOpen(backend, err)
	}
	n, err := d.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("cannot count the GPUs: %w", err)
	}
	if ordinal < 0 || ordinal >= n {
		hint := ""
		if os.Getenv("CUDA_VISIBLE_DEVICES") != "" {
			hint = fmt.Sprintf(" (CUDA_VISIBLE_DEVICES=%s renumbers them from 0)", os.Getenv("CUDA_VISIBLE_DEVICES"))
		}
		return nil, fmt.Errorf("no GPU %d: this process sees %d GPU(s) on the %s driver, numbered from 0%s; `cudashare devices` lists them",
			ordinal, n, d.Backend(), hint)
	}
	dev, err := d.Device(ordinal)
	if err != nil {
		return nil, fmt.Errorf("GPU %d: %w", ordinal, err)
	}
	ctx, err := dev.RetainPrimaryContext()
	if err != nil {
		return nil, fmt.Errorf("cannot create a CUDA context on GPU %d: %w", ordinal, err)
	}
	name, _ := dev.Name()
	return &device{d: d, dev: dev, ctx: ctx, name: name}, nil
}

func explainDriverOpen(backend string, err error) error {
	if env := os.Getenv(driver.EnvBackend); env != "" {
		backend = env + " (from " + driver.EnvBackend + ")"
	}
	switch {
	case errors.Is(err, driver.ErrUnknownBackend):
		return fmt.Errorf("unknown driver %q: use auto, cuda or sim", backend)
	case errors.Is(err, driver.ErrLibraryNotFound):
		return fmt.Errorf("no CUDA driver: libcuda.so.1 cannot be loaded (%v); without a GPU, use -driver sim (the simulated driver) or -driver auto", err)
	case errors.Is(err, driver.ErrNoDevice):
		return fmt.Errorf("no GPU: the CUDA driver loads but reports no device (%v); check CUDA_VISIBLE_DEVICES, or use -driver sim", err)
	case errors.Is(err, driver.ErrSymbolNotFound):
		return fmt.Errorf("the CUDA driver is too old for cudashare: %v", err)
	}
	return fmt.Errorf("cannot open the %s driver: %w", backend, err)
}

func (d *device) close() {
	if d != nil && d.ctx != nil {
		d.ctx.Close()
	}
}

// memUsed is the device memory in use on the context's device, as the
// driver counts it, or -1 if it cannot tell.
func memUsed(ctx *driver.Context) int64 {
	free, total, err := ctx.MemInfo()
	if err != nil {
		return -1
	}
	return int64(total - free)
}

// monoNow is CLOCK_MONOTONIC in nanoseconds: the clock the producer stamps
// offers with and the consumer reads at receipt. Both processes run on one
// host, so the two readings compare. (Python's time.perf_counter is the
// same clock, so the torch anchor measures the same way.)
//
// It is read twice per batch, so not through unix.ClockGettime, a real
// system call: Go's own monotonic clock is CLOCK_MONOTONIC too, read
// through the vDSO, but counted from the process's start. monoPair pairs
// one reading of each, once; the offset between them never changes.
func monoNow() int64 {
	return monoBase + int64(time.Since(monoStart))
}

var monoBase, monoStart, monoErr = monoPair()

// monoPair reads CLOCK_MONOTONIC between two readings of Go's clock, a few
// times, and keeps the tightest bracket: the pairing is off by at most half
// its width (monoErr), usually well under a microsecond. A single pairing
// is off by whatever delays the system call (a fault, a preemption at
// start-up): most likely what, on a two-H100 run, turned one row's one-way
// latencies of a few microseconds into 0.
func monoPair() (base int64, start time.Time, maxErr time.Duration) {
	best := time.Duration(-1)
	for range 16 {
		var ts unix.Timespec
		t0 := time.Now()
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
			return t0.UnixNano(), t0, 0 // no such clock: the wall clock, as before
		}
		w := time.Since(t0)
		if best < 0 || w < best {
			best = w
			// ts was read between t0 and t0+w: take the middle.
			base, start = ts.Nano()-int64(w/2), t0
		}
	}
	return base, start, best - best/2
}

// isTerminal reports whether w is a terminal; the live progress line is
// only for people watching, never for a pipe or a file.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

func newLogger(stderr io.Writer, role string, verbose bool) *slog.Logger {
	level := slog.LevelInfo
	if verbose {
		level = slog.LevelDebug
	}
	h := slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level})
	return slog.New(h).With("role", role, "pid", os.Getpid())
}

// cpuNow is the CPU time the process has used so far, user and system,
// every thread (getrusage); 0 if it cannot be read.
func cpuNow() time.Duration {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cpuPer is the CPU time from cpu0 to now per one of n, in µs (0 if n is 0
// or cpu0 was not read).
func cpuPer(cpu0 time.Duration, n uint64) float64 {
	if n == 0 || cpu0 == 0 {
		return 0
	}
	return round1(float64(cpuNow()-cpu0) / float64(n) / 1e3)
}

func seconds(d time.Duration) float64 { return math.Round(d.Seconds()*1000) / 1000 }

func round1(f float64) float64 { return math.Round(f*10) / 10 }

// runLoop runs loop in a goroutine of its own until the returned stop is
// called; stop closes loop's done channel and waits for loop to return.
func runLoop(loop func(done <-chan struct{})) (stop func()) {
	done, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		loop(done)
	}()
	return func() {
		close(done)
		<-finished
	}
}

// envOr is the environment variable name's value, or def if it is unset
// or empty.
func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
