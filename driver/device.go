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

// P2PAttribute is a CUdevice_P2PAttribute.
type P2PAttribute int32

// All five P2P attributes of CUDA 13.
const (
	P2PPerformanceRank                = P2PAttribute(api.P2PAttrPerformanceRank)
	P2PAccessSupported                = P2PAttribute(api.P2PAttrAccessSupported)
	P2PNativeAtomicSupported          = P2PAttribute(api.P2PAttrNativeAtomicSupported)
	P2PCudaArrayAccessSupported       = P2PAttribute(api.P2PAttrCudaArrayAccessSupported)
	P2POnlyPartialNativeAtomicSupport = P2PAttribute(api.P2PAttrOnlyPartialNativeAtomicSupported)
)

// P2PAttribute is cuDeviceGetP2PAttribute for the link dev -> dst.
func (dev *Device) P2PAttribute(a P2PAttribute, dst *Device) (int, error) {
	var v int32
	err := check(dev.d.a.DeviceGetP2PAttribute(&v, int32(a), dev.h, dst.h), "cuDeviceGetP2PAttribute")
	return int(v), err
}

// AtomicOperation is a CUatomicOperation.
type AtomicOperation int32

// AtomicCapability is a CUatomicOperationCapability bit mask.
type AtomicCapability uint32

// CUatomicOperation values.
const (
	AtomicIntegerAdd       = AtomicOperation(api.AtomicIntegerAdd)
	AtomicIntegerMin       = AtomicOperation(api.AtomicIntegerMin)
	AtomicIntegerMax       = AtomicOperation(api.AtomicIntegerMax)
	AtomicIntegerIncrement = AtomicOperation(api.AtomicIntegerIncrement)
	AtomicIntegerDecrement = AtomicOperation(api.AtomicIntegerDecrement)
	AtomicAnd              = AtomicOperation(api.AtomicAnd)
	AtomicOr               = AtomicOperation(api.AtomicOr)
	AtomicXor              = AtomicOperation(api.AtomicXor)
	AtomicExchange         = AtomicOperation(api.AtomicExchange)
	AtomicCAS              = AtomicOperation(api.AtomicCAS)
	AtomicFloatAdd         = AtomicOperation(api.AtomicFloatAdd)
	AtomicFloatMin         = AtomicOperation(api.AtomicFloatMin)
	AtomicFloatMax         = AtomicOperation(api.AtomicFloatMax)
)

// CUatomicOperationCapability bits.
const (
	AtomicCapSigned     = AtomicCapability(api.AtomicCapSigned)
	AtomicCapUnsigned   = AtomicCapability(api.AtomicCapUnsigned)
	AtomicCapReduction  = AtomicCapability(api.AtomicCapReduction)
	AtomicCapScalar32   = AtomicCapability(api.AtomicCapScalar32)
	AtomicCapScalar64   = AtomicCapability(api.AtomicCapScalar64)
	AtomicCapScalar128  = AtomicCapability(api.AtomicCapScalar128)
	AtomicCapVector32x4 = AtomicCapability(api.AtomicCapVector32x4)
)

// P2PAtomicCapabilities is cuDeviceGetP2PAtomicCapabilities for the link
// dev -> dst: one capability mask per operation, in order.
func (dev *Device) P2PAtomicCapabilities(dst *Device, ops ...AtomicOperation) ([]AtomicCapability, error) {
	if len(ops) == 0 {
		return nil, &Error{Code: api.ErrorInvalidValue, Op: "cuDeviceGetP2PAtomicCapabilities"}
	}
	raw := make([]int32, len(ops))
	for i, op := range ops {
		raw[i] = int32(op)
	}
	caps := make([]uint32, len(ops))
	if err := check(dev.d.a.DeviceGetP2PAtomicCapabilities(&caps[0], &raw[0], uint32(len(ops)), dev.h, dst.h), "cuDeviceGetP2PAtomicCapabilities"); err != nil {
		return nil, err
	}
	out := make([]AtomicCapability, len(caps))
	for i, c := range caps {
		out[i] = AtomicCapability(c)
	}
	return out, nil
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
