package driver

import (
	"errors"
	"fmt"
	"os"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// IMEXChannelDir is where the nvidia-imex channels appear: without them a
// process may not create fabric-shareable memory, whatever the device
// attribute says.
const IMEXChannelDir = "/dev/nvidia-caps-imex-channels"

// FabricSupport is what can be said of fabric handles
// (CU_MEM_HANDLE_TYPE_FABRIC) on a device, from this process.
type FabricSupport struct {
	// Attribute: CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED.
	Attribute bool
	// Usable: a tiny cuMemCreate requesting the fabric handle type
	// succeeded here.
	Usable bool
	// Why says what was found, for a person.
	Why string
}

// ProbeFabric tells whether fabric handles are usable on dev, not only
// whether the device supports them: on an H200 the attribute reads 1
// while cuMemCreate with the fabric handle type is
// CUDA_ERROR_NOT_PERMITTED where the machine has no IMEX channel. It
// creates (and releases) one allocation of the minimum granularity in the
// device's primary context. The answer is for this process: another, in
// another container, may see other channels.
func (dev *Device) ProbeFabric() (FabricSupport, error) {
	s, err := dev.VMMSupport()
	if err != nil {
		return FabricSupport{}, err
	}
	f := FabricSupport{Attribute: s.Fabric}
	if !s.Fabric || !s.VMM {
		f.Why = "not supported by the device"
		return f, nil
	}
	_, statErr := os.Stat(IMEXChannelDir)
	noChannel := dev.d.Backend() == BackendCUDA && errors.Is(statErr, os.ErrNotExist)
	ctx, err := dev.RetainPrimaryContext()
	if err != nil {
		return f, err
	}
	defer ctx.Close()
	min, _, err := dev.AllocationGranularity()
	if err != nil {
		return f, err
	}
	if err := ctx.enter(); err != nil {
		return f, err
	}
	defer ctx.exit()
	p := vmmProp(dev.h, false)
	p.RequestedHandleTypes = api.MemHandleTypeFabric
	var h api.MemHandle
	err = check(ctx.a.MemCreate(&h, min, &p, 0), "cuMemCreate")
	switch {
	case err == nil:
		ctx.a.MemRelease(h)
		f.Usable, f.Why = true, "supported and usable here"
	case errors.Is(err, ErrNotPermitted) && noChannel:
		f.Why = "supported by the device, not usable here: no IMEX channel (" + IMEXChannelDir + " is absent)"
	case errors.Is(err, ErrNotPermitted):
		f.Why = "supported by the device, not usable here: no IMEX channel (cuMemCreate with the fabric handle type: CUDA_ERROR_NOT_PERMITTED)"
	default:
		f.Why = fmt.Sprintf("supported by the device, not usable here: %v", err)
	}
	return f, nil
}
