package sim

import (
	"bytes"
	"errors"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
)

// procID names one simulated process: a Driver. pid and start (the process
// start time in clock ticks since boot, field 22 of /proc/<pid>/stat) tell a
// live process from a dead one whose pid was reused; inst tells apart the
// Drivers of one OS process. Its layout is part of the registry file.
type procID struct {
	pid   int32
	inst  uint32
	start uint64
}

var (
	selfStart = sync.OnceValues(func() (uint64, error) {
		start, ok := procStart(int32(os.Getpid()))
		if !ok {
			return 0, errors.New("read /proc/self/stat: cannot tell this process's start time")
		}
		return start, nil
	})
	instances atomic.Uint32
	// ended holds the instances of this process that have run Deinit, which
	// the sim treats as their process exiting.
	ended sync.Map
)

func newProcID() (procID, error) {
	start, err := selfStart()
	if err != nil {
		return procID{}, err
	}
	return procID{pid: int32(os.Getpid()), inst: instances.Add(1), start: start}, nil
}

// procStart returns the start time of a running process. A zombie (or a
// process being reaped) counts as gone: its exit has already unmapped
// everything it had mapped.
func procStart(pid int32) (uint64, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/stat")
	if err != nil {
		return 0, false
	}
	// The command name in field 2 may hold spaces and parentheses; the
	// fields after its last ')' are plain.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, false
	}
	f := bytes.Fields(b[i+1:])
	// f[0] is field 3 (state), f[19] is field 22 (starttime).
	if len(f) < 20 || bytes.Equal(f[0], []byte("Z")) || bytes.Equal(f[0], []byte("X")) {
		return 0, false
	}
	start, err := strconv.ParseUint(string(f[19]), 10, 64)
	if err != nil {
		return 0, false
	}
	return start, true
}

// liveness answers "is this process alive" once per pid for the length of one
// registry operation.
type liveness struct {
	self  procID
	dir   string // the state directory, for presence files; "" skips them
	cache map[int32]procState
}

type procState struct {
	start uint64
	alive bool
}

func newLiveness(self procID) *liveness {
	return &liveness{self: self, cache: make(map[int32]procState)}
}

// live is a liveness for one registry operation of d.
func (d *Driver) live() *liveness {
	l := newLiveness(d.self)
	l.dir = d.dir
	return l
}

func (l *liveness) alive(p procID) bool {
	if p.pid == 0 {
		return false
	}
	if p.pid == l.self.pid {
		// Drivers of this process that were dropped without Deinit keep
		// their entries until the process exits.
		_, gone := ended.Load(p.inst)
		return p.start == l.self.start && !gone
	}
	st, ok := l.cache[p.pid]
	if !ok {
		st.start, st.alive = procStart(p.pid)
		l.cache[p.pid] = st
	}
	return st.alive && st.start == p.start
}
