//go:build linux

package share

import (
	"bytes"
	"context"
	"errors"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// procWatch tells when a peer process has exited. A consumer that
// vanishes without a goodbye may still be alive with its mappings open (a
// protocol error or a bug closed its socket, not its exit), so the
// exporter frees what it mapped only once the process is gone: its exit
// unmapped everything.
//
// It uses a pidfd, opened while the peer is connected so its pid cannot
// have been reused, which becomes readable when every thread of the
// process has exited; where pidfds are not available, it polls
// /proc/<pid>/stat, comparing the start time.
//
// Every connection of one process shares one watch (Exporter.pids): a
// process that opens a thousand connections costs one descriptor and one
// goroutine, not a thousand.
type procWatch struct {
	pid   int
	self  bool     // the peer is this process (a test with the simulator)
	f     *os.File // the pidfd; nil when polling
	start uint64   // for polling: the start time seen at connect; 0 unknown

	// Guarded by Exporter.mu.
	cons   map[*consumer]struct{} // the consumers whose connection it held
	exited bool                   // the process has exited
	leases int                    // held through the connections it opened
	lost   int                    // of those, held through connections that ended
	// abandoned counts buffers its lost connections held in VMM
	// allocations: given up to it (it may still read them) and replaced.
	// While it lives it is served last, as with lost leases, so that a
	// process that keeps taking buffers and hanging up makes the producer
	// replace memory only when no other consumer can take a buffer.
	abandoned int
	stop      context.CancelFunc // ends the watching goroutine
}

const procPollInterval = 20 * time.Millisecond

var longAgo = time.Unix(1, 0)

func watchProcess(pid int) *procWatch {
	w := &procWatch{pid: pid, self: pid == os.Getpid(), cons: make(map[*consumer]struct{})}
	if w.self || pid <= 0 {
		return w
	}
	w.start, _ = procStart(pid)
	if fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK); err == nil {
		w.f = os.NewFile(uintptr(fd), "pidfd:"+strconv.Itoa(pid))
	}
	return w
}

// wait returns nil once the process has exited, or ctx's error. A watch
// of this process never ends but by ctx.
func (w *procWatch) wait(ctx context.Context) error {
	switch {
	case w.pid <= 0:
		// Unknown (another PID namespace): it cannot be watched.
		<-ctx.Done()
		return ctx.Err()
	case w.self:
		<-ctx.Done()
		return ctx.Err()
	case w.f != nil:
		err := w.waitPidfd(ctx)
		if err == nil || ctx.Err() != nil {
			return err
		}
		// The pidfd cannot be polled here: fall back to /proc.
	}
	t := time.NewTicker(procPollInterval)
	defer t.Stop()
	for {
		if start, ok := procStart(w.pid); !ok || (w.start != 0 && start != w.start) {
			return nil
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (w *procWatch) waitPidfd(ctx context.Context) error {
	rc, err := w.f.SyscallConn()
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { w.f.SetReadDeadline(longAgo) })
	defer stop()
	exited := false
	err = rc.Read(func(fd uintptr) bool {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, perr := unix.Poll(fds, 0)
		exited = perr == nil && n > 0
		return exited || (perr != nil && perr != unix.EINTR)
	})
	if exited {
		return nil
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err == nil {
		err = errors.New("share: pidfd poll failed")
	}
	return err
}

func (w *procWatch) close() {
	if w.f != nil {
		w.f.Close()
	}
}

// procStart returns the start time of a running process; a zombie counts
// as gone, since its exit has unmapped everything it mapped.
func procStart(pid int) (uint64, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, false
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 20 || string(f[0]) == "Z" || string(f[0]) == "X" {
		return 0, false
	}
	start, err := strconv.ParseUint(string(f[19]), 10, 64)
	return start, err == nil
}

// socketHolders returns the processes, other than skip, with a descriptor
// of the socket with inode ino, from a scan of /proc. Processes of other
// users, which this one may not look into, are not seen.
func socketHolders(ino uint64, skip int) ([]int, error) {
	want := "socket:[" + strconv.FormatUint(ino, 10) + "]"
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil || pid == skip {
			continue
		}
		dir := "/proc/" + p.Name() + "/fd/"
		fds, err := os.ReadDir(dir)
		if err != nil {
			continue // gone, or not ours to look into
		}
		for _, fd := range fds {
			if link, err := os.Readlink(dir + fd.Name()); err == nil && link == want {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids, nil
}
