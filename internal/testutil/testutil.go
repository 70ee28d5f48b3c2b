// Package testutil holds what the project's tests share: a snapshot of the
// process's file descriptors for leak checks, and a buffer that a child's
// output and a test can share. It is for test code only.
package testutil

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
)

// OpenFDs returns this process's open descriptors and what each points
// to, leaving out the ones the real CUDA driver keeps for itself.
func OpenFDs() map[int]string {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		panic(err)
	}
	fds := make(map[int]string)
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err != nil {
			continue // the directory's own descriptor, gone by now
		}
		if driverOwned(target) {
			continue
		}
		fds[fd] = target
	}
	return fds
}

// NewFDs describes, sorted, the descriptors open now that were not open
// (to the same target) in before.
func NewFDs(before map[int]string) []string {
	var extra []string
	for fd, target := range OpenFDs() {
		if before[fd] != target {
			extra = append(extra, fmt.Sprintf("descriptor %d -> %s", fd, target))
		}
	}
	slices.Sort(extra)
	return extra
}

// driverOwned reports descriptors that the real CUDA driver opens for
// itself and keeps for the life of the process: its device files, and the
// shared memory behind interprocess events (/dev/shm/cuda.shm.*, first
// seen on an H200 when a test recorded an IPC event). They are not ours to
// close, so they are no leak of ours.
func driverOwned(target string) bool {
	return strings.HasPrefix(target, "/dev/nvidia") || strings.HasPrefix(target, "/dev/shm/cuda.shm.")
}

// SyncBuffer is a bytes.Buffer safe for concurrent writers and readers.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Bytes returns a copy of the contents.
func (s *SyncBuffer) Bytes() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return bytes.Clone(s.b.Bytes())
}
