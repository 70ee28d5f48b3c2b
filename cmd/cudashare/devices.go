package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/internal/peerlink"
)

func runDevices(args []string, stdout, stderr io.Writer) int {
	fs, backend := newFlagSet("devices", stderr)
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	d, err := driver.Open(driver.Config{Backend: *backend})
	if err != nil {
		fmt.Fprintf(stderr, "cudashare: %v\n", err)
		return exitNoDriver
	}
	version, _ := d.Version()
	fmt.Fprintf(stdout, "driver: %s (%s), CUDA driver API %d\n", d.Backend(), d.Reason(), version)
	devs, err := d.Devices()
	if err != nil {
		fmt.Fprintf(stderr, "cudashare: %v\n", err)
		return exitFailure
	}
	for _, dev := range devs {
		name, _ := dev.Name()
		mem, _ := dev.TotalMem()
		major, _ := dev.Attribute(driver.AttrComputeCapabilityMajor)
		minor, _ := dev.Attribute(driver.AttrComputeCapabilityMinor)
		ipc, _ := dev.Attribute(driver.AttrIpcEventSupported)
		fmt.Fprintf(stdout, "  %d  %s  %s  %.1f GiB  sm_%d%d  ipc-events=%d\n", dev.Ordinal(), dev.UUID(), name, float64(mem)/(1<<30), major, minor, ipc)
		fmt.Fprintf(stdout, "     vmm: %s\n", vmmLine(dev))
		fmt.Fprintf(stdout, "     fabric: %s\n", fabricLine(dev))
	}
	if len(devs) < 2 {
		return exitOK
	}
	fmt.Fprintln(stdout, "peer links (src -> dst): access, rank, native atomics, array access, partial atomics; atomic caps per op")
	for _, a := range devs {
		for _, b := range devs {
			if a == b {
				continue
			}
			can, err := a.CanAccessPeer(b)
			if err != nil {
				fmt.Fprintf(stdout, "  %d -> %d: %v\n", a.Ordinal(), b.Ordinal(), err)
				continue
			}
			link := peerlink.Read(a, b)
			var attrs []string
			for i, v := range link.Attrs {
				if link.AttrErrs[i] != nil {
					attrs = append(attrs, "err")
					continue
				}
				attrs = append(attrs, fmt.Sprint(v))
			}
			capStr := fmt.Sprint(link.CapsErr)
			if link.CapsErr == nil {
				capStr = fmt.Sprintf("add=%#x cas=%#x fadd=%#x", link.Caps[0], link.Caps[1], link.Caps[2])
			}
			fmt.Fprintf(stdout, "  %d -> %d: can-access=%v  [%s]  %s\n", a.Ordinal(), b.Ordinal(), can, strings.Join(attrs, " "), capStr)
		}
	}
	return exitOK
}

// vmmLine reports a device's virtual memory management support: VMM itself,
// POSIX-fd and fabric handles, and the allocation granularity.
func vmmLine(dev *driver.Device) string {
	s, err := dev.VMMSupport()
	if err != nil {
		return err.Error()
	}
	line := fmt.Sprintf("supported=%v posix-fd=%v fabric-attribute=%v", s.VMM, s.PosixFD, s.Fabric)
	if !s.VMM {
		return line
	}
	min, rec, err := dev.AllocationGranularity()
	if err != nil {
		return line + "  granularity: " + err.Error()
	}
	return line + fmt.Sprintf("  granularity=%s (recommended %s)", granSize(min), granSize(rec))
}

func granSize(n uint64) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

// fabricLine tells whether fabric handles are usable here, not only what
// the device attribute says (driver.Device.ProbeFabric).
func fabricLine(dev *driver.Device) string {
	f, err := dev.ProbeFabric()
	if err != nil {
		return "could not tell: " + err.Error()
	}
	return f.Why
}
