//go:build linux

package share

import (
	"fmt"

	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/transport"
)

// This file is how an exporter shares memory: VMM allocations as file
// descriptors, or legacy IPC handles, chosen once for its device.

// Sharing is how an Exporter shares the memory it allocates (rings and
// arenas; Register always offers the caller's memory with legacy IPC).
type Sharing uint8

const (
	// SharingAuto: VMM where the device exports POSIX file descriptors,
	// else legacy IPC.
	SharingAuto Sharing = iota
	// SharingIPC: cuMemAlloc memory shared with legacy CUDA IPC handles.
	// Consumers in sibling PID namespaces (two containers) cannot open
	// them, the memory dies with the producer, and what a lost consumer
	// may map stays allocated until its processes exit.
	SharingIPC
	// SharingVMM: cuMemCreate allocations exported as file descriptors,
	// sent once per allocation and consumer over the socket. They import
	// in any PID namespace, outlive the producer in the consumers that
	// map them, and a lost consumer never pins the producer's memory: its
	// buffers are replaced (PROTOCOL.md, section 7.1). NewExporter fails
	// with driver.ErrNotSupported where the device cannot.
	SharingVMM
)

func (s Sharing) String() string {
	switch s {
	case SharingAuto:
		return "auto"
	case SharingIPC:
		return "ipc"
	case SharingVMM:
		return "vmm"
	}
	return fmt.Sprintf("sharing(%d)", uint8(s))
}

// ParseSharing reads "auto", "ipc" or "vmm".
func ParseSharing(s string) (Sharing, error) {
	for _, v := range []Sharing{SharingAuto, SharingIPC, SharingVMM} {
		if s == v.String() {
			return v, nil
		}
	}
	return 0, fmt.Errorf("share: sharing %q: want auto, ipc or vmm", s)
}

// resolveSharing picks the exporter's sharing path, and says why.
func resolveSharing(dev *driver.Device, want Sharing) (Sharing, uint64, string, error) {
	sup, err := dev.VMMSupport()
	var gran uint64
	if err == nil && sup.VMM && sup.PosixFD {
		gran, _, err = dev.AllocationGranularity()
	}
	ok := err == nil && sup.VMM && sup.PosixFD && gran > 0
	why := fmt.Sprintf("the device supports VMM allocations exported as POSIX file descriptors (granularity %d bytes)", gran)
	if !ok {
		why = fmt.Sprintf("the device does not export VMM allocations as POSIX file descriptors (VMM %v, POSIX fd %v)", sup.VMM, sup.PosixFD)
		if err != nil {
			why = fmt.Sprintf("the device's VMM support could not be read: %v", err)
		}
	}
	switch want {
	case SharingIPC:
		return SharingIPC, 0, "legacy IPC was asked for", nil
	case SharingVMM:
		if !ok {
			return 0, 0, "", fmt.Errorf("share: sharing vmm: %s: %w", why, driver.ErrNotSupported)
		}
		return SharingVMM, gran, "VMM was asked for, and " + why, nil
	case SharingAuto:
		if ok {
			return SharingVMM, gran, why, nil
		}
		return SharingIPC, 0, why, nil
	}
	return 0, 0, "", fmt.Errorf("share: unknown %s", want)
}

// Sharing says how the exporter shares the rings and arenas it allocates,
// and why.
func (e *Exporter) Sharing() (Sharing, string) { return e.sharing, e.sharingWhy }

// refuse says why the exporter cannot serve a consumer that
// advertised caps, or nil if it can.
func (e *Exporter) refuse(caps transport.Caps) error {
	if e.sharing == SharingVMM && caps&transport.CapVMM == 0 {
		return fmt.Errorf("%w: this producer offers VMM allocations as file descriptors; the consumer did not advertise the vmm capability (bit 0)", transport.ErrNotSupported)
	}
	return nil
}
