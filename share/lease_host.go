//go:build linux

package share

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/seed743c36cf/cudashare/driver"
)

// ErrReleased: the lease was released; its memory is the producer's again.
var ErrReleased = errors.New("share: lease released")

// CopyToHost copies the start of the buffer into dst: min(len(dst),
// Size()) bytes, never past the buffer (the next bytes of the allocation
// may be another lease's). It returns the bytes copied.
//
// The copy is ordered after the producer's writes and after the work
// queued so far on the lease's stream (Stream), and complete when it
// returns: it waits for that stream on the host. dst may be Go memory or a
// driver.HostBuffer's. After Release it fails with ErrReleased; after the
// importer's Close (which closed the mapping), with ErrClosed.
func (l *Lease) CopyToHost(dst []byte) (int, error) { return l.CopyToHostAt(dst, 0) }

// CopyToHostAt is CopyToHost from byte off of the buffer: min(len(dst),
// Size()-off) bytes. An off past Size is an error matching
// driver.ErrInvalidValue.
func (l *Lease) CopyToHostAt(dst []byte, off uint64) (int, error) {
	if l == nil || l.st == nil {
		return 0, errors.New("share: CopyToHost of a lease Next did not return")
	}
	if l.done.Load() {
		return 0, fmt.Errorf("share: copy from lease %d: %w", l.seq, ErrReleased)
	}
	if off > l.size {
		return 0, fmt.Errorf("share: copy from byte %d of a %d-byte lease: %w", off, l.size, driver.ErrInvalidValue)
	}
	if err := l.unmapped(); err != nil {
		return 0, err
	}
	n := min(uint64(len(dst)), l.size-off)
	if n == 0 {
		return 0, nil
	}
	dctx := l.st.im.dctx
	src := l.ptr + driver.DevicePtr(off)
	if l.stream == nil {
		// The host waited for the producer's event: a synchronous copy
		// sees the writes.
		if err := dctx.CopyDtoH(dst[:n], src); err != nil {
			return 0, fmt.Errorf("share: copy from lease %d: %w", l.seq, err)
		}
		return int(n), nil
	}
	// On the lease's stream, which waited for the producer's event (a copy
	// on the NULL stream would not wait for a non-blocking stream). Into
	// pinned memory the copy is asynchronous: wait for it.
	if err := dctx.CopyDtoHAsync(dst[:n], src, l.stream); err != nil {
		return 0, fmt.Errorf("share: copy from lease %d: %w", l.seq, err)
	}
	if err := l.stream.Synchronize(); err != nil {
		return 0, fmt.Errorf("share: copy from lease %d: %w", l.seq, err)
	}
	return int(n), nil
}

// Element is a fixed-size number type that a buffer can hold.
type Element interface {
	~int8 | ~int16 | ~int32 | ~int64 | ~uint8 | ~uint16 | ~uint32 | ~uint64 |
		~float32 | ~float64 | ~complex64 | ~complex128
}

// CopyElements copies the start of l's buffer into dst as elements of T in
// the host's byte order (the GPU's: little-endian): as many whole elements
// as dst and the buffer hold. It returns the elements copied. It does not
// read the lease's metadata; View says what the producer declared.
func CopyElements[T Element](l *Lease, dst []T) (int, error) {
	if len(dst) == 0 {
		return 0, nil
	}
	size := int(unsafe.Sizeof(dst[0]))
	b := unsafe.Slice((*byte)(unsafe.Pointer(&dst[0])), len(dst)*size)
	if l != nil {
		b = b[:min(uint64(len(b)), l.size/uint64(size)*uint64(size))]
	}
	n, err := l.CopyToHost(b)
	return n / size, err
}

// unmapped returns an error matching ErrClosed if the importer was closed
// and with it the lease's mapping: the pointer may meanwhile name other
// memory, so nothing may be read through it. A Close that runs during a
// copy is the caller's race, as for any use of Ptr.
//
// A lease of legacy IPC memory whose producer is gone returns an error
// matching ErrProducerGone: that memory was freed with its producer.
func (l *Lease) unmapped() error {
	im := l.st.im
	im.mu.Lock()
	closed := im.state == stateClosed || l.a.closed
	im.mu.Unlock()
	if closed {
		return fmt.Errorf("share: lease %d: the importer was closed and its mapping with it: %w", l.seq, ErrClosed)
	}
	if l.a.dead() {
		return fmt.Errorf("share: lease %d: its producer is gone, and its legacy IPC memory with it: %w", l.seq, ErrProducerGone)
	}
	return nil
}
