package driver

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// Backend names accepted by Open and by the CUDASHARE_DRIVER variable.
const (
	BackendAuto = "auto" // real CUDA when libcuda loads and a device exists, else the simulator
	BackendCUDA = "cuda" // libcuda.so.1 through purego
	BackendSim  = "sim"  // the multi-process simulator
)

// EnvBackend overrides Config.Backend when set.
const EnvBackend = "CUDASHARE_DRIVER"

// Config selects and configures a backend.
type Config struct {
	// Backend is BackendAuto (the default when empty), BackendCUDA or
	// BackendSim. CUDASHARE_DRIVER overrides it.
	Backend string
	// LibraryPath is the CUDA driver library; "" means libcuda.so.1.
	LibraryPath string
}

// Driver is an initialized backend. It is safe for concurrent use.
type Driver struct {
	a      api.API
	name   string
	reason string

	mu      sync.Mutex
	devices map[int]*Device
}

// Open selects a backend, initializes it (cuInit) and returns it. With
// BackendAuto it falls back to the simulator when the real driver is
// missing or sees no device, and Reason says why.
func Open(cfg Config) (*Driver, error) {
	name := cfg.Backend
	if env := strings.TrimSpace(os.Getenv(EnvBackend)); env != "" {
		name = env
	}
	if name == "" {
		name = BackendAuto
	}
	switch name {
	case BackendCUDA, BackendSim:
		a, err := openBackend(name, cfg.LibraryPath)
		if err != nil {
			return nil, err
		}
		if err := initAPI(a); err != nil {
			return nil, err
		}
		return newDriver(a, "selected "+name), nil
	case BackendAuto:
		a, err := openCUDA(cfg.LibraryPath)
		if err == nil {
			if err = initAPI(a); err == nil {
				var n int32
				if err = check(a.DeviceGetCount(&n), "cuDeviceGetCount"); err == nil && n == 0 {
					err = ErrNoDevice
				}
				if err == nil {
					return newDriver(a, fmt.Sprintf("auto: real CUDA driver with %d device(s)", n)), nil
				}
			}
		}
		cudaErr := err
		s, err := openSim()
		if err == nil {
			err = initAPI(s)
		}
		if err != nil {
			return nil, fmt.Errorf("%w: cuda: %v; sim: %v", ErrNoBackend, cudaErr, err)
		}
		return newDriver(s, fmt.Sprintf("auto: no usable GPU (%v), using the simulated driver", cudaErr)), nil
	default:
		return nil, fmt.Errorf("%w %q (want %s, %s or %s)", ErrUnknownBackend, name, BackendAuto, BackendCUDA, BackendSim)
	}
}

// openBackend loads a named backend without initializing it.
func openBackend(name, lib string) (api.API, error) {
	switch name {
	case BackendCUDA:
		return openCUDA(lib)
	case BackendSim:
		return openSim()
	}
	return nil, fmt.Errorf("%w %q", ErrUnknownBackend, name)
}

func initAPI(a api.API) error {
	return check(a.Init(0), "cuInit")
}

func newDriver(a api.API, reason string) *Driver {
	return &Driver{a: a, name: a.Backend(), reason: reason, devices: map[int]*Device{}}
}

// Backend is "cuda" or "sim".
func (d *Driver) Backend() string { return d.name }

// Reason says how the backend was chosen, for logs and reports.
func (d *Driver) Reason() string { return d.reason }

// raw is the backend itself, for the conformance suite.
func (d *Driver) raw() api.API { return d.a }

// Version is cuDriverGetVersion: 1000*major + 10*minor.
func (d *Driver) Version() (int, error) {
	var v int32
	if err := check(d.a.DriverGetVersion(&v), "cuDriverGetVersion"); err != nil {
		return 0, err
	}
	return int(v), nil
}

// DeviceCount is cuDeviceGetCount: the devices this process sees
// (CUDA_VISIBLE_DEVICES applies).
func (d *Driver) DeviceCount() (int, error) {
	var n int32
	if err := check(d.a.DeviceGetCount(&n), "cuDeviceGetCount"); err != nil {
		return 0, err
	}
	return int(n), nil
}

// Device returns the device with this process's ordinal.
func (d *Driver) Device(ordinal int) (*Device, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if dev, ok := d.devices[ordinal]; ok {
		return dev, nil
	}
	var h api.Device
	if err := check(d.a.DeviceGet(&h, int32(ordinal)), "cuDeviceGet"); err != nil {
		return nil, fmt.Errorf("device %d: %w", ordinal, err)
	}
	dev := &Device{d: d, h: h, ordinal: ordinal}
	var u api.UUID
	if err := check(d.a.DeviceGetUuid(&u, h), "cuDeviceGetUuid"); err != nil {
		return nil, fmt.Errorf("device %d: %w", ordinal, err)
	}
	dev.uuid = u
	d.devices[ordinal] = dev
	return dev, nil
}

// Devices returns every device this process sees, by ordinal.
func (d *Driver) Devices() ([]*Device, error) {
	n, err := d.DeviceCount()
	if err != nil {
		return nil, err
	}
	out := make([]*Device, 0, n)
	for i := 0; i < n; i++ {
		dev, err := d.Device(i)
		if err != nil {
			return nil, err
		}
		out = append(out, dev)
	}
	return out, nil
}

// ErrDeviceNotVisible: no device of this process has the UUID (it may be
// hidden by CUDA_VISIBLE_DEVICES; IPC handles from it can still be opened).
var ErrDeviceNotVisible = errors.New("driver: device not visible to this process")

// DeviceByUUID finds a visible device by UUID.
func (d *Driver) DeviceByUUID(u UUID) (*Device, error) {
	devs, err := d.Devices()
	if err != nil {
		return nil, err
	}
	for _, dev := range devs {
		if dev.uuid == u {
			return dev, nil
		}
	}
	return nil, fmt.Errorf("%w: %s", ErrDeviceNotVisible, u)
}

// Violation is one breach of a lifetime rule recorded by a strict backend.
type Violation = api.Violation

// Violations returns every lifetime violation that the strict simulator
// recorded, across all processes sharing its state. On the real driver it
// returns ErrStrictUnsupported: those bugs are undefined behaviour there.
func (d *Driver) Violations() ([]Violation, error) {
	s, ok := d.a.(api.Strict)
	if !ok {
		return nil, ErrStrictUnsupported
	}
	return s.Violations()
}
