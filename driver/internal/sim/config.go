package sim

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Environment variables read by New.
const (
	EnvDir      = "CUDASHARE_SIM_DIR"
	EnvTopology = "CUDASHARE_SIM_TOPOLOGY"
	// EnvFabric models fabric handles (Config.Fabric).
	EnvFabric  = "CUDASHARE_SIM_FABRIC"
	EnvVisible = "CUDA_VISIBLE_DEVICES"
)

// Defaults of the simulated machine: two H200-like devices joined by NVLink,
// with the P2P attributes two H200s on NV18 report (measured: performance
// rank 0, access, native atomics and array access 1, partial atomics 0).
const (
	DefaultDeviceName = "cudashare sim GPU"
	DefaultTotalMem   = 4 << 30
	DefaultCC         = "9.0"
	DefaultMaxPeers   = 8

	maxDevices  = 64      // each device owns a 1 TiB region of the simulated address space
	maxTotalMem = 1 << 40 // a region must hold the whole device
	maxNameLen  = 255
)

// Config configures a Driver. The zero value is the default machine in the
// default state directory with every device visible.
type Config struct {
	// Dir is the state directory shared by every process of one simulated
	// machine. "" means DefaultDir().
	Dir string
	// Topology describes the machine. nil means DefaultTopology(). Every
	// process sharing Dir must use the same topology; New refuses a mismatch.
	Topology *Topology
	// VisibleDevices holds the entries of CUDA_VISIBLE_DEVICES: host-global
	// ordinals or "GPU-<uuid prefix>" (any case, spaces trimmed). nil means
	// all devices are visible. As in CUDA, the list ends at the first entry
	// that names no device, so []string{""} hides every device, and cuInit
	// then fails with CUDA_ERROR_NO_DEVICE; a device listed twice makes
	// cuInit fail with CUDA_ERROR_INVALID_DEVICE.
	VisibleDevices []string
	// Fabric models CU_MEM_HANDLE_TYPE_FABRIC: "" (the default), the
	// devices do not support it (the attribute reads 0); "noimex", the
	// attribute reads 1 but the machine has no IMEX channel, so cuMemCreate
	// requesting it is CUDA_ERROR_NOT_PERMITTED, as on an H200 without
	// nvidia-imex (measured); "imex", it reads 1 and cuMemCreate accepts it
	// (the allocation is an ordinary one: nothing exports fabric handles).
	Fabric string
}

// Topology is the simulated machine. In CUDASHARE_SIM_TOPOLOGY it is JSON,
// every field but "devices" optional:
//
//	{"devices": 2,                          // a count of default devices, or a list:
//	 "devices": [{"name": "A", "total_mem": 4294967296, "cc": "9.0"}, {}],
//	 "peer":           [[0,1],[1,0]],       // [src][dst] 1: contexts on src may access memory on dst
//	 "perf_rank":      [[0,0],[0,0]],       // CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK
//	 "native_atomic":  [[0,1],[1,0]],       // ..._NATIVE_ATOMIC_SUPPORTED
//	 "partial_atomic": [[0,0],[0,0]],       // ..._ONLY_PARTIAL_NATIVE_ATOMIC_SUPPORTED
//	 "array_access":   [[0,1],[1,0]],       // ..._CUDA_ARRAY_ACCESS_SUPPORTED
//	 "atomic_caps":    [[[], [27, ...]], [[27, ...], []]],  // [src][dst][CUatomicOperation]
//	 "max_peers": 8}
//
// A bare number is also accepted: "4" is four default devices. Matrices are
// n x n; the diagonal is ignored (a device is not its own peer). Defaults:
// "peer" all 1; "native_atomic" and "array_access" equal to "peer";
// "perf_rank" and "partial_atomic" 0; "atomic_caps" all 0, which is what two
// H200s joined by NV18 report on driver 580 (measured: native atomics
// supported, yet no capability bit for any of the 13 operations). A pair without peer access reports 0 for every
// attribute. Unknown fields are errors.
type Topology struct {
	Devices       []DeviceSpec
	Peer          [][]int
	PerfRank      [][]int
	NativeAtomic  [][]int
	PartialAtomic [][]int
	ArrayAccess   [][]int
	AtomicCaps    [][][]uint32
	// MaxPeers is how many peer devices one context may reach (through
	// cuCtxEnablePeerAccess or a lazily enabled IPC open) before
	// CUDA_ERROR_TOO_MANY_PEERS. 0 means DefaultMaxPeers.
	MaxPeers int
}

// topologyJSON is the wire form of Topology; "devices" may be a count.
type topologyJSON struct {
	Devices       json.RawMessage `json:"devices"`
	Peer          [][]int         `json:"peer,omitempty"`
	PerfRank      [][]int         `json:"perf_rank,omitempty"`
	NativeAtomic  [][]int         `json:"native_atomic,omitempty"`
	PartialAtomic [][]int         `json:"partial_atomic,omitempty"`
	ArrayAccess   [][]int         `json:"array_access,omitempty"`
	AtomicCaps    [][][]uint32    `json:"atomic_caps,omitempty"`
	MaxPeers      int             `json:"max_peers,omitempty"`
}

// DeviceSpec is one device. Zero fields take the defaults.
type DeviceSpec struct {
	Name     string `json:"name,omitempty"`
	TotalMem uint64 `json:"total_mem,omitempty"` // bytes; backing files are sparse
	CC       string `json:"cc,omitempty"`        // compute capability "major.minor"
}

// DefaultTopology is two default devices with peer access both ways.
func DefaultTopology() Topology {
	return Topology{Devices: make([]DeviceSpec, 2)}
}

// DefaultDir is /dev/shm/cudashare-sim-<uid>, or the same name under
// os.TempDir() where /dev/shm is missing.
func DefaultDir() string {
	name := "cudashare-sim-" + strconv.Itoa(os.Getuid())
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		return filepath.Join("/dev/shm", name)
	}
	return filepath.Join(os.TempDir(), name)
}

// ConfigFromEnv reads CUDASHARE_SIM_DIR, CUDASHARE_SIM_TOPOLOGY and
// CUDA_VISIBLE_DEVICES.
func ConfigFromEnv() (Config, error) {
	cfg := Config{Dir: os.Getenv(EnvDir), Fabric: os.Getenv(EnvFabric)}
	switch cfg.Fabric {
	case "", "noimex", "imex":
	default:
		return Config{}, fmt.Errorf("%s=%q: want noimex, imex or nothing", EnvFabric, cfg.Fabric)
	}
	if s, ok := os.LookupEnv(EnvTopology); ok && strings.TrimSpace(s) != "" {
		t, err := ParseTopology(s)
		if err != nil {
			return Config{}, fmt.Errorf("%s: %w", EnvTopology, err)
		}
		cfg.Topology = &t
	}
	if s, ok := os.LookupEnv(EnvVisible); ok {
		cfg.VisibleDevices = strings.Split(s, ",")
	}
	return cfg, nil
}

// ParseTopology parses the CUDASHARE_SIM_TOPOLOGY format: JSON or a bare
// device count.
func ParseTopology(s string) (Topology, error) {
	s = strings.TrimSpace(s)
	if n, err := strconv.Atoi(s); err == nil {
		return countTopology(n)
	}
	var t Topology
	if err := t.UnmarshalJSON([]byte(s)); err != nil {
		return Topology{}, fmt.Errorf("parse topology: %w", err)
	}
	return t, nil
}

// UnmarshalJSON reads the JSON form, refusing unknown fields.
func (t *Topology) UnmarshalJSON(b []byte) error {
	var w topologyJSON
	if err := strictJSON(string(b), &w); err != nil {
		return err
	}
	*t = Topology{
		Peer: w.Peer, PerfRank: w.PerfRank, NativeAtomic: w.NativeAtomic, PartialAtomic: w.PartialAtomic,
		ArrayAccess: w.ArrayAccess, AtomicCaps: w.AtomicCaps, MaxPeers: w.MaxPeers,
	}
	var n int
	switch {
	case len(w.Devices) == 0:
		return errors.New(`"devices" is required`)
	case json.Unmarshal(w.Devices, &n) == nil:
		c, err := countTopology(n)
		if err != nil {
			return err
		}
		t.Devices = c.Devices
	default:
		if err := strictJSON(string(w.Devices), &t.Devices); err != nil {
			return fmt.Errorf(`"devices": %w`, err)
		}
	}
	return nil
}

// MarshalJSON writes the JSON form, which CUDASHARE_SIM_TOPOLOGY accepts.
func (t Topology) MarshalJSON() ([]byte, error) {
	devs := t.Devices
	if devs == nil {
		devs = []DeviceSpec{}
	}
	dj, err := json.Marshal(devs)
	if err != nil {
		return nil, err
	}
	return json.Marshal(topologyJSON{
		Devices: dj, Peer: t.Peer, PerfRank: t.PerfRank, NativeAtomic: t.NativeAtomic, PartialAtomic: t.PartialAtomic,
		ArrayAccess: t.ArrayAccess, AtomicCaps: t.AtomicCaps, MaxPeers: t.MaxPeers,
	})
}

func countTopology(n int) (Topology, error) {
	if n < 0 || n > maxDevices {
		return Topology{}, fmt.Errorf("topology: device count %d out of range [0, %d]", n, maxDevices)
	}
	return Topology{Devices: make([]DeviceSpec, n)}, nil
}

func strictJSON(s string, v any) error {
	dec := json.NewDecoder(strings.NewReader(s))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return errors.New("trailing data")
	}
	return nil
}

// device and link are the resolved, validated topology.
type device struct {
	name       string
	totalMem   uint64
	ccMajor    int32
	ccMinor    int32
	uuid       api.UUID
	uuidString string // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
}

type link struct {
	access        bool
	perfRank      int32
	nativeAtomic  bool
	partialAtomic bool
	arrayAccess   bool
	atomicCaps    [api.AtomicOperationCount]uint32
}

type machine struct {
	devices  []device
	links    [][]link // [src][dst], host-global ordinals
	maxPeers int
	hash     uint64 // of the canonical form; every process sharing a dir must agree
}

func resolveTopology(t Topology) (*machine, error) {
	n := len(t.Devices)
	if n > maxDevices {
		return nil, fmt.Errorf("topology: %d devices, at most %d", n, maxDevices)
	}
	c := topologyJSON{MaxPeers: t.MaxPeers} // canonical: defaults filled in
	if c.MaxPeers == 0 {
		c.MaxPeers = DefaultMaxPeers
	}
	if c.MaxPeers < 0 {
		return nil, fmt.Errorf("topology: max_peers %d is negative", c.MaxPeers)
	}
	m := &machine{maxPeers: c.MaxPeers}
	devs := make([]DeviceSpec, n)
	for i, spec := range t.Devices {
		if spec.Name == "" {
			spec.Name = DefaultDeviceName
		}
		if spec.TotalMem == 0 {
			spec.TotalMem = DefaultTotalMem
		}
		if spec.CC == "" {
			spec.CC = DefaultCC
		}
		if len(spec.Name) > maxNameLen || strings.IndexByte(spec.Name, 0) >= 0 {
			return nil, fmt.Errorf("topology: device %d: bad name %q", i, spec.Name)
		}
		if spec.TotalMem > maxTotalMem {
			return nil, fmt.Errorf("topology: device %d: total_mem %d above %d", i, spec.TotalMem, uint64(maxTotalMem))
		}
		major, minor, err := parseCC(spec.CC)
		if err != nil {
			return nil, fmt.Errorf("topology: device %d: %w", i, err)
		}
		devs[i] = spec
		// A device's UUID depends on its own spec and place only, so adding
		// a device to the topology does not rename the others.
		js, _ := json.Marshal(spec)
		sum := sha256.Sum256(fmt.Appendf(nil, "cudashare-sim-uuid\x00%d\x00%s", i, js))
		dv := device{name: spec.Name, totalMem: spec.TotalMem, ccMajor: major, ccMinor: minor}
		copy(dv.uuid[:], sum[:16])
		dv.uuidString = formatUUID(dv.uuid)
		m.devices = append(m.devices, dv)
	}
	c.Devices, _ = json.Marshal(devs)

	var err error
	matrix := func(name string, v [][]int, def func(s, d int) int) [][]int {
		if err != nil {
			return nil
		}
		if v != nil && len(v) != n {
			err = fmt.Errorf("topology: %q has %d rows, want %d", name, len(v), n)
			return nil
		}
		out := make([][]int, n)
		for s := range out {
			if v != nil && len(v[s]) != n {
				err = fmt.Errorf("topology: %q row %d has %d columns, want %d", name, s, len(v[s]), n)
				return nil
			}
			out[s] = make([]int, n)
			for d := range out[s] {
				if s == d {
					continue
				}
				switch {
				case v != nil && name == "perf_rank":
					out[s][d] = v[s][d]
				case v != nil && v[s][d] != 0:
					out[s][d] = 1
				case v == nil:
					out[s][d] = def(s, d)
				}
			}
		}
		return out
	}
	zero := func(s, d int) int { return 0 }
	c.Peer = matrix("peer", t.Peer, func(s, d int) int { return 1 })
	peer := func(s, d int) int { return c.Peer[s][d] }
	c.PerfRank = matrix("perf_rank", t.PerfRank, zero)
	c.NativeAtomic = matrix("native_atomic", t.NativeAtomic, peer)
	c.PartialAtomic = matrix("partial_atomic", t.PartialAtomic, zero)
	c.ArrayAccess = matrix("array_access", t.ArrayAccess, peer)
	if err != nil {
		return nil, err
	}
	if t.AtomicCaps != nil && len(t.AtomicCaps) != n {
		return nil, fmt.Errorf("topology: \"atomic_caps\" has %d rows, want %d", len(t.AtomicCaps), n)
	}
	c.AtomicCaps = make([][][]uint32, n)
	m.links = make([][]link, n)
	for s := range n {
		if t.AtomicCaps != nil && len(t.AtomicCaps[s]) != n {
			return nil, fmt.Errorf("topology: \"atomic_caps\" row %d has %d columns, want %d", s, len(t.AtomicCaps[s]), n)
		}
		c.AtomicCaps[s] = make([][]uint32, n)
		m.links[s] = make([]link, n)
		for d := range n {
			if s == d || c.Peer[s][d] == 0 {
				// No peer access: every attribute reads 0.
				c.PerfRank[s][d], c.NativeAtomic[s][d], c.PartialAtomic[s][d], c.ArrayAccess[s][d] = 0, 0, 0, 0
				continue
			}
			var caps []uint32
			if t.AtomicCaps != nil {
				caps = t.AtomicCaps[s][d]
			}
			if len(caps) > api.AtomicOperationCount {
				return nil, fmt.Errorf("topology: \"atomic_caps\"[%d][%d] has %d operations, at most %d", s, d, len(caps), api.AtomicOperationCount)
			}
			c.AtomicCaps[s][d] = caps
			l := &m.links[s][d]
			l.access, l.perfRank = true, int32(c.PerfRank[s][d])
			l.nativeAtomic, l.partialAtomic, l.arrayAccess = c.NativeAtomic[s][d] != 0, c.PartialAtomic[s][d] != 0, c.ArrayAccess[s][d] != 0
			copy(l.atomicCaps[:], caps)
		}
	}
	canon, err := json.Marshal(c)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(canon)
	m.hash = binary.LittleEndian.Uint64(sum[:8])
	return m, nil
}

func parseCC(s string) (int32, int32, error) {
	maj, min, ok := strings.Cut(s, ".")
	a, err1 := strconv.ParseUint(maj, 10, 8)
	b, err2 := strconv.ParseUint(min, 10, 8)
	if !ok || err1 != nil || err2 != nil || a == 0 {
		return 0, 0, fmt.Errorf("bad compute capability %q, want \"major.minor\"", s)
	}
	return int32(a), int32(b), nil
}

func formatUUID(u api.UUID) string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// visibleDevices applies CUDA_VISIBLE_DEVICES: it returns the host-global
// ordinals in local order, and whether a device is listed twice. Like CUDA,
// parsing stops at the first entry that names no device (bad syntax, out of
// range, an ambiguous or unknown UUID prefix); the entries before it stay.
// All measured on driver 580, but for ambiguous prefixes.
func visibleDevices(m *machine, entries []string) (visible []int, repeated bool) {
	if entries == nil {
		all := make([]int, len(m.devices))
		for i := range all {
			all[i] = i
		}
		return all, false
	}
	var out []int
	taken := make(map[int]bool)
	for _, e := range entries {
		e = strings.TrimSpace(e)
		idx := -1
		if n, err := strconv.Atoi(e); err == nil {
			if n >= 0 && n < len(m.devices) {
				idx = n
			}
		} else if len(e) > len("GPU-") && strings.EqualFold(e[:4], "GPU-") {
			for i := range m.devices {
				if len(e) <= len(m.devices[i].uuidString) && strings.EqualFold(m.devices[i].uuidString[:len(e)], e) {
					if idx >= 0 { // ambiguous prefix
						idx = -1
						break
					}
					idx = i
				}
			}
		}
		if idx < 0 {
			break
		}
		repeated = repeated || taken[idx]
		taken[idx] = true
		out = append(out, idx)
	}
	return out, repeated
}

// cString copies s into b as a NUL-terminated string, truncating it to fit.
func cString(b []byte, s string) {
	n := copy(b[:len(b)-1], s)
	b[n] = 0
}
