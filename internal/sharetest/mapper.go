//go:build linux

package sharetest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/seed743c36cf/cudashare/share"
)

// The mapper routine measures what a consumer pays for the allocations it
// maps (share's BenchmarkConsumerMaps1000): the first offer of each
// allocation (import and map), then offers that find the mapping open.

func init() { routines["mapper"] = mapper }

// MappedReport is what the mapper prints once the first ParamCount leases,
// one per allocation, are taken ("MAPPED {json}"): per mapping, what the
// process spent and holds more than after Dial.
type MappedReport struct {
	Mappings       int     // open in the registry then
	CPUPerLease    float64 // ns of process CPU (user and system, every thread; polling included) per first lease
	AllocsPerLease float64 // heap allocations per first lease
	HeapPerMapping float64 // bytes of Go heap in use (after a GC)
	RSSPerMapping  float64 // bytes of resident memory (VmRSS): the driver's host side included
	FDsPerMapping  float64 // open descriptors
}

// MapperReport is what the mapper reports at its end.
type MapperReport struct {
	Leases      int
	Bad         []string // leases without their number as metadata
	Errors      []string // errors from Next other than the end
	EOF         bool     // the producer said goodbye
	Registry    share.RegistryStats
	ShutdownErr string
}

// mapper takes leases and releases each at once, until the producer ends.
// After its first ParamCount leases it prints MAPPED (MappedReport). On
// "snap" from stdin, at any time, it prints "SNAP cpu_ns leases mallocs",
// so that the parent can take the cost of the offers between two snaps.
func mapper(ce *ChildEnv) error {
	ctx := context.Background()
	first := Param(ParamCount, 0)
	cfg := share.ImporterConfig{Credits: uint32(Param(ParamCredits, 8)), Logger: ce.Log}
	dctx, cancel := context.WithTimeout(ctx, ExpectTimeout)
	defer cancel()
	im, err := share.Dial(dctx, os.Getenv(ParamPath), ce.Ctx, cfg)
	if err != nil {
		return err
	}
	defer im.Close()
	var leases atomic.Int64
	go snapshots(ce.In, &leases)
	s0 := sampleProcess()
	fmt.Println("CONNECTED")
	var rep MapperReport
	for {
		l, err := im.Next(ctx)
		if err != nil {
			if errors.Is(err, io.EOF) {
				rep.EOF = true
				break
			}
			if errors.Is(err, share.ErrProducerGone) {
				rep.Errors = append(rep.Errors, err.Error())
				break
			}
			rep.Errors = append(rep.Errors, err.Error())
			continue
		}
		if _, ok := ParseMeta(l.Meta()); !ok {
			rep.Bad = append(rep.Bad, fmt.Sprintf("lease %d: metadata %x", l.Seq(), l.Meta()))
		}
		l.Release()
		rep.Leases++
		leases.Store(int64(rep.Leases))
		if rep.Leases == first {
			s1 := sampleProcess()
			n := float64(first)
			report := MappedReport{
				Mappings:       im.Registry().Mappings(),
				CPUPerLease:    float64(s1.cpu-s0.cpu) / n,
				AllocsPerLease: float64(s1.mallocs-s0.mallocs) / n,
				HeapPerMapping: float64(int64(s1.heap)-int64(s0.heap)) / n,
				RSSPerMapping:  float64(s1.rss-s0.rss) / n,
				FDsPerMapping:  float64(s1.fds-s0.fds) / n,
			}
			line, _ := json.Marshal(report)
			fmt.Printf("MAPPED %s\n", line)
		}
	}
	sctx, cancel2 := context.WithTimeout(ctx, ExpectTimeout)
	defer cancel2()
	if err := im.Shutdown(sctx); err != nil {
		rep.ShutdownErr = err.Error()
	}
	rep.Registry = im.Registry().Stats()
	report(rep)
	return nil
}

// snapshots answers "snap" lines from in until it ends.
func snapshots(in *bufio.Reader, leases *atomic.Int64) {
	for {
		line, err := in.ReadString('\n')
		if strings.TrimSpace(line) == "snap" {
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			fmt.Printf("SNAP %d %d %d\n", CPUTime().Nanoseconds(), leases.Load(), ms.Mallocs)
		}
		if err != nil {
			return
		}
	}
}

// Snap is a mapper's "SNAP" line.
type Snap struct {
	CPU     time.Duration
	Leases  int
	Mallocs uint64
}

// ParseSnap reads what follows "SNAP ".
func ParseSnap(s string) (Snap, error) {
	f := strings.Fields(s)
	if len(f) != 3 {
		return Snap{}, fmt.Errorf("snap %q: want 3 fields", s)
	}
	cpu, err1 := strconv.ParseInt(f[0], 10, 64)
	n, err2 := strconv.Atoi(f[1])
	m, err3 := strconv.ParseUint(f[2], 10, 64)
	if err := errors.Join(err1, err2, err3); err != nil {
		return Snap{}, fmt.Errorf("snap %q: %w", s, err)
	}
	return Snap{CPU: time.Duration(cpu), Leases: n, Mallocs: m}, nil
}

// procSample is what a process spent and holds at one time.
type procSample struct {
	cpu           time.Duration
	mallocs, heap uint64
	rss           int64
	fds           int
}

// sampleProcess collects garbage first, so that heap is what is in use.
func sampleProcess() procSample {
	cpu := CPUTime()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return procSample{cpu: cpu, mallocs: ms.Mallocs, heap: ms.HeapAlloc, rss: ResidentBytes(), fds: OpenFDCount()}
}

// ResidentBytes is the process's resident memory (VmRSS), or 0 if it
// cannot be read.
func ResidentBytes() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(rest)
			if len(f) == 2 && f[1] == "kB" {
				kb, _ := strconv.ParseInt(f[0], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}

// OpenFDCount is the number of descriptors the process has open.
func OpenFDCount() int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return 0
	}
	return len(ents) - 1 // the directory's own, open while it is read
}
