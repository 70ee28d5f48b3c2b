package sim

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// PID namespaces. A pid means nothing outside its namespace, and a process
// in a child namespace (unshare --pid --fork --mount-proc, a container) sees
// neither its parent namespace's processes nor their pids. So the sim
// records, next to every pid, the inode of the process's PID namespace, and
// tells whether a process of another namespace is alive by a presence file
// rather than by /proc: every process holds a shared flock on
// "proc-<ns>-<pid>-<start>" in the state directory for as long as it uses
// the directory, and the kernel drops the lock when it dies.
//
// The real driver lets legacy IPC handles open between a parent and a child
// namespace, either way, and refuses siblings with
// CUDA_ERROR_INVALID_CONTEXT (measured, GPU.md). A process can tell that
// another namespace is its descendant (processes of it appear in its
// /proc), but not that one is its ancestor: the kernel does not let a
// process name namespaces above its own. So each sim process passes the
// chain of its namespaces to the processes it starts in EnvPIDNamespaces;
// a process learns its ancestors from it. A process started in a new PID
// namespace by one that never used the sim does not know its ancestors, and
// treats their handles as a sibling's.

// EnvPIDNamespaces holds the inodes of the PID namespaces of the sim
// processes this process descends from, outermost first. New sets it (adding
// this process's namespace) for the processes it starts.
const EnvPIDNamespaces = "CUDASHARE_SIM_PIDNS"

const presencePrefix = "proc-"

// nsInfo is this process's PID namespace and the known ancestors.
type nsInfo struct {
	self      uint32
	ancestors []uint32
}

var pidNS = sync.OnceValue(func() nsInfo {
	var info nsInfo
	if l, err := os.Readlink("/proc/self/ns/pid"); err == nil {
		info.self = parseNSLink(l)
	}
	var chain []string
	for _, f := range strings.Split(os.Getenv(EnvPIDNamespaces), ",") {
		if n, err := strconv.ParseUint(f, 10, 32); err == nil && n != 0 {
			if uint32(n) != info.self {
				info.ancestors = append(info.ancestors, uint32(n))
			}
			chain = append(chain, f)
		}
	}
	if info.self != 0 && (len(chain) == 0 || chain[len(chain)-1] != strconv.FormatUint(uint64(info.self), 10)) {
		chain = append(chain, strconv.FormatUint(uint64(info.self), 10))
		os.Setenv(EnvPIDNamespaces, strings.Join(chain, ","))
	}
	return info
})

// parseNSLink reads the inode from a namespace link, "pid:[4026531836]".
func parseNSLink(l string) uint32 {
	s, ok := strings.CutPrefix(l, "pid:[")
	if !ok {
		return 0
	}
	n, err := strconv.ParseUint(strings.TrimSuffix(s, "]"), 10, 32)
	if err != nil {
		return 0
	}
	return uint32(n)
}

func selfNS() uint32 { return pidNS().self }

// nsRelated says whether the real driver would open a legacy IPC handle
// exported from PID namespace ns here: the same namespace, an ancestor, or
// a descendant. Unknown namespaces (0: a registry written before the sim
// recorded them) count as related.
func nsRelated(ns uint32) bool {
	info := pidNS()
	if ns == 0 || info.self == 0 || ns == info.self || slices.Contains(info.ancestors, ns) {
		return true
	}
	return nsVisible(ns)
}

// nsVisible says whether a process of namespace ns shows in /proc: then ns
// is this process's namespace or below it.
func nsVisible(ns uint32) bool {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return false
	}
	want := fmt.Sprintf("pid:[%d]", ns)
	for _, e := range ents {
		if c := e.Name()[0]; c < '0' || c > '9' {
			continue
		}
		if l, err := os.Readlink("/proc/" + e.Name() + "/ns/pid"); err == nil && l == want {
			return true
		}
	}
	return false
}

// presence is this process's presence file in one state directory.
type presence struct {
	fd   int
	path string
	refs int
}

var presences struct {
	sync.Mutex
	m map[string]*presence
}

func presenceName(ns uint32, p procID) string {
	return fmt.Sprintf("%s%d-%d-%d", presencePrefix, ns, p.pid, p.start)
}

// holdPresence takes this process's presence file in dir, once per
// directory however many Drivers use it.
func holdPresence(dir string, self procID) error {
	presences.Lock()
	defer presences.Unlock()
	if p := presences.m[dir]; p != nil {
		p.refs++
		return nil
	}
	sweepPresence(dir)
	// Locked under a temporary name and renamed: a file under the final name
	// is always locked while its process lives, so a sweep never takes it
	// for a dead one's.
	path := filepath.Join(dir, presenceName(selfNS(), self))
	// The namespace is in the temporary name too: the first processes
	// of two sibling namespaces are both pid 1, and may have started in
	// the same clock tick.
	tmp := filepath.Join(dir, "."+presenceName(selfNS(), self))
	fd, err := unix.Open(tmp, unix.O_RDWR|unix.O_CREAT|unix.O_TRUNC|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("sim presence file: %w", err)
	}
	if err := flock(fd, unix.LOCK_SH); err != nil {
		unix.Close(fd)
		unix.Unlink(tmp)
		return fmt.Errorf("sim presence file: %w", err)
	}
	if err := unix.Rename(tmp, path); err != nil {
		unix.Close(fd)
		unix.Unlink(tmp)
		return fmt.Errorf("sim presence file: %w", err)
	}
	if presences.m == nil {
		presences.m = make(map[string]*presence)
	}
	presences.m[dir] = &presence{fd: fd, path: path, refs: 1}
	return nil
}

// sweepPresence removes the presence files of processes that are gone
// (which exited without Deinit, as most do), so the directory does not
// collect one file per process ever run.
func sweepPresence(dir string) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), presencePrefix) {
			continue
		}
		path := filepath.Join(dir, e.Name())
		fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
		if err != nil {
			continue
		}
		if unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB) == nil {
			_ = unix.Unlink(path)
		}
		unix.Close(fd)
	}
}

// dropPresence undoes one holdPresence.
func dropPresence(dir string) {
	presences.Lock()
	defer presences.Unlock()
	p := presences.m[dir]
	if p == nil {
		return
	}
	if p.refs--; p.refs > 0 {
		return
	}
	delete(presences.m, dir)
	_ = unix.Unlink(p.path)
	_ = unix.Close(p.fd)
}

// aliveIn is alive for a process of PID namespace ns: by /proc in this
// namespace (or when ns is not known), by its presence file in another.
func (l *liveness) aliveIn(p procID, ns uint32) bool {
	if ns == 0 || ns == selfNS() || l.dir == "" {
		return l.alive(p)
	}
	if p.pid == 0 {
		return false
	}
	path := filepath.Join(l.dir, presenceName(ns, p))
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return !errors.Is(err, unix.ENOENT)
	}
	defer unix.Close(fd)
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return true // held: the process lives (or the check failed; assume it lives)
	}
	// Nobody holds it: the process is gone. Clear the file.
	_ = unix.Unlink(path)
	return false
}
