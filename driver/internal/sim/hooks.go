package sim

import (
	"fmt"
	"os"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// DropBacking removes the shared-memory file behind the allocation that
// holds p, as if the memory could no longer be mapped: another process's
// open of its handle then fails with CUDA_ERROR_MAP_FAILED. It is a test
// hook for the one documented cuIpcOpenMemHandle code that the real driver
// gives no known way to produce. The owner's own mapping stays usable.
func (d *Driver) DropBacking(p api.DevicePtr) error {
	d.mu.RLock()
	o := d.space.find(uint64(p))
	d.mu.RUnlock()
	if o == nil {
		return fmt.Errorf("sim: no allocation holds %#x", uint64(p))
	}
	return os.Remove(d.reg.bufferPath(o.gid))
}
