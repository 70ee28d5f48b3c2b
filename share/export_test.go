//go:build linux

package share

import (
	"github.com/seed743c36cf/cudashare/driver"
	"github.com/seed743c36cf/cudashare/transport"
)

// RegistryProbe exposes a registry's acquire and release of one key to the
// external tests and benchmarks.
type RegistryProbe struct {
	r *Registry
	k regKey
	e *regEntry
}

func NewRegistryProbe(r *Registry, pid int32, src, dst driver.UUID, h driver.IpcMemHandle) *RegistryProbe {
	return &RegistryProbe{r: r, k: regKey{pid: pid, src: src, dst: dst, handle: transport.IPCHandle(h)}}
}

// Acquire takes one hold on the mapping, opening it on first use.
func (p *RegistryProbe) Acquire(dctx *driver.Context, allocID, allocSize uint64) (driver.DevicePtr, error) {
	e, err := p.r.acquire(dctx, &p.k, allocID, allocSize)
	if err != nil {
		return 0, err
	}
	p.e = e
	return e.ptr, nil
}

// Release drops one hold.
func (p *RegistryProbe) Release() error { return p.r.release(p.e) }
