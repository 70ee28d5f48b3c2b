package driver

import (
	"fmt"

	"github.com/seed743c36cf/cudashare/internal/uuid"

	"github.com/seed743c36cf/cudashare/driver/internal/api"
)

// UUID identifies a device across processes; ordinals do not
// (CUDA_VISIBLE_DEVICES renumbers them per process). It is the same type as
// transport.UUID.
type UUID = uuid.UUID

// Device is a CUdevice as this process sees it.
type Device struct {
	d       *Driver
	h       api.Device
	ordinal int
	uuid    UUID
}

// Ordinal is the device's index in this process.
func (dev *Device) Ordinal() int { return dev.ordinal }

// UUID is the device's stable identity.
func (dev *Device) UUID() UUID { return dev.uuid }

func (dev *Device) String() string { return fmt.Sprintf("device %d (%s)", dev.ordinal, dev.uuid) }

// Name is cuDeviceGetName.
func (dev *Device) Name() (string, error) {
	buf := make([]byte, 256)
	if err := check(dev.d.a.DeviceGetName(buf, dev.h), "cuDeviceGetName"); err != nil {
		return "", err
	}
	for i, c := range buf {
		if c == 0 {
			return string(buf[:i]), nil
		}
	}
	return string(buf), nil
}

// TotalMem is cuDeviceTotalMem_v2, in bytes.
func (dev *Device) TotalMem() (uint64, error) {
	var n uint64
	err := check(dev.d.a.DeviceTotalMem(&n, dev.h), "cuDeviceTotalMem_v2")
	return n, err
}

// DeviceAttribute is a CUdevice_attribute.
type DeviceAttribute int32

// The attributes cudashare relies on.
const (
	AttrUnifiedAddressing          = DeviceAttribute(api.AttrUnifiedAddressing)
	AttrComputeCapabilityMajor     = DeviceAttribute(api.AttrComputeCapabilityMajor)
	AttrComputeCapabilityMinor     = DeviceAttribute(api.AttrComputeCapabilityMinor)
	AttrVirtualMemoryManagement    = DeviceAttribute(api.AttrVirtualMemoryManagementSupported)
	AttrPosixFileDescriptorHandles = DeviceAttribute(api.AttrHandleTypePosixFileDescriptorSupported)
	AttrIpcEventSupported          = DeviceAttribute(api.AttrIpcEventSupported)
)

// Attribute is cuDeviceGetAttribute.
func (dev *Device) Attribute(a DeviceAttribute) (int, error) {
	var v int32
	err := check(dev.d.a.DeviceGetAttribute(&v, int32(a), dev.h), "cuDeviceGetAttribute")
	return int(v), err
}

// CanAccessPeer is cuDeviceCanAccessPeer: whether contexts on dev can map
// memory that lives on peer.
func (dev *Device) CanAccessPeer(peer *Device) (bool, error) {
	var v int32
	err := check(dev.d.a.DeviceCanAccessPeer(&v, dev.h, peer.h), "cuDeviceCanAccessPeer")
	return v == 1, err
}

// RetainPrimaryContext is cuDevicePrimaryCtxRetain. Close the context to
// release it.
func (dev *Device) RetainPrimaryContext() (*Context, error) {
	var h api.Context
	if err := check(dev.d.a.DevicePrimaryCtxRetain(&h, dev.h), "cuDevicePrimaryCtxRetain"); err != nil {
		return nil, fmt.Errorf("%s: %w", dev, err)
	}
	return &Context{a: dev.d.a, h: h, dev: dev}, nil
}
