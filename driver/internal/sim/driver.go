package sim

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

var (
	_ api.API    = (*Driver)(nil)
	_ api.Strict = (*Driver)(nil)
)

// DriverVersion is what cuDriverGetVersion reports: CUDA 13.0.
const DriverVersion = 13000

const (
	stateNew = iota
	stateInit
	stateDeinit
)

// Driver is one simulated process's view of the simulated machine. It is
// safe for concurrent use.
type Driver struct {
	m        *machine
	visible  []int // local ordinal -> host-global ordinal
	repeated bool  // CUDA_VISIBLE_DEVICES lists a device twice: cuInit fails
	dir      string
	self     procID
	secret   uint64 // the machine's IPC handle key, copied from the registry
	epoch    time.Time
	fabric   string // Config.Fabric

	state atomic.Int32

	// Lock-free: read on every handoff. threads holds the top of each
	// thread's context stack; stacks (under mu) what lies below, and stacked
	// counts it, so that popping takes no lock while no stack has depth.
	threads threadTable
	stacked atomic.Int32
	ctxs    table[ctxState]
	streams table[streamState]
	events  table[eventState]

	// mu guards everything below and the objects' mutable fields. Copies and
	// queries hold it for reading, so they run in parallel and a free cannot
	// unmap memory under a copy.
	mu          sync.RWMutex
	closed      bool
	reg         *registry
	primary     []*ctxState // by local ordinal; nil until first retained
	primaryRefs []int
	contexts    map[*ctxState]struct{}
	stacks      map[int32][]*ctxState
	space       addrSpace
	lastBufID   uint64
	lastEvent   uint64
	imports     map[importKey]*memObj
	binds       map[bindKey]*binding
	vmm         vmmState

	violMu  sync.Mutex
	violErr error // first failure to record a violation

	pend pendingWork // work queued on foreign mappings (pending.go)

	host hostState // page-locked host memory (cuMemHostAlloc)
}

// ctxState is a context. Its maps are guarded by Driver.mu.
type ctxState struct {
	h         api.Context
	dev       api.Device // local ordinal
	hdev      int        // host-global ordinal
	primary   bool
	destroyed atomic.Bool

	objs    map[*memObj]struct{} // allocations and IPC mappings made in it
	streams map[*streamState]struct{}
	events  map[*eventState]struct{}
	// peers are the contexts whose memory it reaches (cuCtxEnablePeerAccess);
	// lazyPeers the host-global devices an IPC open enabled for it.
	peers     map[*ctxState]struct{}
	lazyPeers map[int]struct{}
}

// New returns a Driver configured from the environment: CUDASHARE_SIM_DIR,
// CUDASHARE_SIM_TOPOLOGY and CUDA_VISIBLE_DEVICES.
func New() (*Driver, error) {
	cfg, err := ConfigFromEnv()
	if err != nil {
		return nil, err
	}
	return NewWithConfig(cfg)
}

// NewWithConfig returns a Driver for cfg. Each Driver is a separate simulated
// process, also within one OS process. Call Deinit to end it: like process
// exit, that unmaps what it mapped and frees what it allocated.
func NewWithConfig(cfg Config) (*Driver, error) {
	topo := DefaultTopology()
	if cfg.Topology != nil {
		topo = *cfg.Topology
	}
	m, err := resolveTopology(topo)
	if err != nil {
		return nil, err
	}
	dir := cfg.Dir
	if dir == "" {
		dir = DefaultDir()
	}
	if err := prepareDir(dir); err != nil {
		return nil, err
	}
	self, err := newProcID()
	if err != nil {
		return nil, err
	}
	pidNS() // learn the PID namespaces, and pass them on to children
	if err := holdPresence(dir, self); err != nil {
		return nil, err
	}
	reg, err := openRegistry(dir, m.hash)
	if err != nil {
		dropPresence(dir)
		return nil, err
	}
	d := &Driver{
		m: m, dir: dir, self: self, secret: reg.hdr.secret, epoch: time.Now(), reg: reg, fabric: cfg.Fabric,
		contexts: make(map[*ctxState]struct{}),
		stacks:   make(map[int32][]*ctxState),
		imports:  make(map[importKey]*memObj),
		binds:    make(map[bindKey]*binding),
	}
	d.visible, d.repeated = visibleDevices(m, cfg.VisibleDevices)
	if d.repeated {
		d.visible = nil
	}
	d.primary = make([]*ctxState, len(d.visible))
	d.primaryRefs = make([]int, len(d.visible))
	salt := uintptr(self.inst & 0xff)
	d.ctxs.tag, d.ctxs.salt = tagContext, salt
	d.streams.tag, d.streams.salt = tagStream, salt
	d.events.tag, d.events.salt = tagEvent, salt
	return d, nil
}

// prepareDir creates the state directory 0700 and refuses one that another
// user owns or may write: its files decide what this process maps.
func prepareDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("sim state dir: %w", err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("sim state dir: %w", err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir():
		return fmt.Errorf("sim state dir %s: not a directory", dir)
	case ok && int(st.Uid) != os.Getuid():
		return fmt.Errorf("sim state dir %s: owned by uid %d, not %d", dir, st.Uid, os.Getuid())
	case fi.Mode().Perm()&0o022 != 0:
		return fmt.Errorf("sim state dir %s: writable by others (mode %v)", dir, fi.Mode().Perm())
	}
	return nil
}

// ResetState deletes the sim's files in dir: the registry, the violation log
// and every buffer. No process may be using dir. Other files are left alone.
func ResetState(dir string) error {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		n := e.Name()
		if n == registryFile || n == violationsFile || strings.HasPrefix(n, bufferPrefix) || strings.HasPrefix(n, presencePrefix) || strings.HasPrefix(n, "."+presencePrefix) {
			if err := os.Remove(filepath.Join(dir, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// Dir is the state directory.
func (d *Driver) Dir() string { return d.dir }

// Deinit ends the simulated process as its exit would: every context is
// destroyed, so its allocations are freed (or left to the processes that
// still map them, with no violation, as when a process dies) and its
// mappings closed; the registry is unmapped. Every call after it returns
// CUDA_ERROR_DEINITIALIZED, as the real driver does during teardown.
// Violations still works. Deinit is idempotent.
func (d *Driver) Deinit() {
	d.state.Store(stateDeinit)
	ended.Store(d.self.inst, struct{}{})
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return
	}
	d.closed = true
	for c := range d.contexts {
		d.destroyContext(c, true)
	}
	d.vmmTeardown()
	d.reg.close()
	dropPresence(d.dir)
}

// ready is the init check every call but cuDriverGetVersion starts with.
func (d *Driver) ready() api.Result {
	switch d.state.Load() {
	case stateInit:
		return api.Success
	case stateDeinit:
		return api.ErrorDeinitialized
	}
	return api.ErrorNotInitialized
}

// lock takes mu for writing, failing once Deinit has run.
func (d *Driver) lock() api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return api.ErrorDeinitialized
	}
	return api.Success
}

// rlock takes mu for reading, failing once Deinit has run.
func (d *Driver) rlock() api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	d.mu.RLock()
	if d.closed {
		d.mu.RUnlock()
		return api.ErrorDeinitialized
	}
	return api.Success
}

func gettid() int32 { return int32(unix.Gettid()) }

// current is the calling thread's context. A destroyed context that is still
// current gives CUDA_ERROR_CONTEXT_IS_DESTROYED: cuda.h defines that code as
// "the context current to the calling thread has been destroyed using
// cuCtxDestroy, or is a primary context which has not yet been initialized".
// Measured for a released primary context; for a context destroyed by
// another thread, unverified.
func (d *Driver) current() (*ctxState, api.Result) {
	c := d.threads.get(gettid())
	if c == nil {
		return nil, api.ErrorInvalidContext
	}
	if c.destroyed.Load() {
		return nil, api.ErrorContextIsDestroyed
	}
	return c, api.Success
}

func (d *Driver) device(dev api.Device) (*device, bool) {
	if dev < 0 || int(dev) >= len(d.visible) {
		return nil, false
	}
	return &d.m.devices[d.visible[dev]], true
}

// Backend implements api.API.
func (d *Driver) Backend() string { return "sim" }

// Init implements api.API. With no visible device it fails with
// CUDA_ERROR_NO_DEVICE, and with a device listed twice in
// CUDA_VISIBLE_DEVICES with CUDA_ERROR_INVALID_DEVICE, as cuInit does.
func (d *Driver) Init(flags uint32) api.Result {
	if d.state.Load() == stateDeinit {
		return api.ErrorDeinitialized
	}
	if flags != 0 {
		return api.ErrorInvalidValue
	}
	if d.repeated {
		return api.ErrorInvalidDevice
	}
	if len(d.visible) == 0 {
		return api.ErrorNoDevice
	}
	if !d.state.CompareAndSwap(stateNew, stateInit) && d.state.Load() == stateDeinit {
		return api.ErrorDeinitialized
	}
	return api.Success
}

// DriverGetVersion implements api.API. It works before Init, like the real
// one; after Deinit it too says CUDA_ERROR_DEINITIALIZED.
func (d *Driver) DriverGetVersion(version *int32) api.Result {
	if d.state.Load() == stateDeinit {
		return api.ErrorDeinitialized
	}
	if version == nil {
		return api.ErrorInvalidValue
	}
	*version = DriverVersion
	return api.Success
}

// DeviceGetCount implements api.API.
func (d *Driver) DeviceGetCount(count *int32) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if count == nil {
		return api.ErrorInvalidValue
	}
	*count = int32(len(d.visible))
	return api.Success
}

// DeviceGet implements api.API.
func (d *Driver) DeviceGet(dev *api.Device, ordinal int32) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if dev == nil {
		return api.ErrorInvalidValue
	}
	if _, ok := d.device(api.Device(ordinal)); !ok {
		return api.ErrorInvalidDevice
	}
	*dev = api.Device(ordinal)
	return api.Success
}

// DeviceGetName implements api.API. A name longer than the buffer is cut to
// fit, NUL included.
func (d *Driver) DeviceGetName(name []byte, dev api.Device) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if len(name) == 0 {
		return api.ErrorInvalidValue
	}
	dv, ok := d.device(dev)
	if !ok {
		return api.ErrorInvalidDevice
	}
	cString(name, dv.name)
	return api.Success
}

// DeviceGetUuid implements api.API.
func (d *Driver) DeviceGetUuid(uuid *api.UUID, dev api.Device) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if uuid == nil {
		return api.ErrorInvalidValue
	}
	dv, ok := d.device(dev)
	if !ok {
		return api.ErrorInvalidDevice
	}
	*uuid = dv.uuid
	return api.Success
}

// DeviceTotalMem implements api.API.
func (d *Driver) DeviceTotalMem(bytes *uint64, dev api.Device) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if bytes == nil {
		return api.ErrorInvalidValue
	}
	dv, ok := d.device(dev)
	if !ok {
		return api.ErrorInvalidDevice
	}
	*bytes = dv.totalMem
	return api.Success
}

// DeviceGetAttribute implements api.API for the attributes cudashare reads;
// any other attribute is CUDA_ERROR_INVALID_VALUE. Order: value, device,
// attribute (measured).
func (d *Driver) DeviceGetAttribute(value *int32, attrib int32, dev api.Device) api.Result {
	if r := d.ready(); r != api.Success {
		return r
	}
	if value == nil {
		return api.ErrorInvalidValue
	}
	dv, ok := d.device(dev)
	if !ok {
		return api.ErrorInvalidDevice
	}
	switch attrib {
	case api.AttrUnifiedAddressing, api.AttrVirtualMemoryManagementSupported,
		api.AttrHandleTypePosixFileDescriptorSupported, api.AttrIpcEventSupported:
		*value = 1
	case api.AttrHandleTypeFabricSupported:
		*value = 0
		if d.fabric != "" {
			*value = 1
		}
	case api.AttrComputeCapabilityMajor:
		*value = dv.ccMajor
	case api.AttrComputeCapabilityMinor:
		*value = dv.ccMinor
	default:
		return api.ErrorInvalidValue
	}
	return api.Success
}
