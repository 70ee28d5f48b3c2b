package driver

import (
	"github.com/seed743c36cf/cudashare/driver/internal/api"
	"github.com/seed743c36cf/cudashare/internal/peerlink"
)

func init() {
	peerlink.Read = func(src, dst any) peerlink.Link { return src.(*Device).peerLink(dst.(*Device)) }
}

// peerLink reads the P2P attributes (cuDeviceGetP2PAttribute) and atomic
// capabilities (cuDeviceGetP2PAtomicCapabilities) of the link dev -> dst,
// for `cudashare devices`.
func (dev *Device) peerLink(dst *Device) peerlink.Link {
	var l peerlink.Link
	attrs := [len(l.Attrs)]int32{
		api.P2PAttrAccessSupported,
		api.P2PAttrPerformanceRank,
		api.P2PAttrNativeAtomicSupported,
		api.P2PAttrCudaArrayAccessSupported,
		api.P2PAttrOnlyPartialNativeAtomicSupported,
	}
	for i, a := range attrs {
		var v int32
		l.AttrErrs[i] = check(dev.d.a.DeviceGetP2PAttribute(&v, a, dev.h, dst.h), "cuDeviceGetP2PAttribute")
		l.Attrs[i] = int(v)
	}
	ops := [len(l.Caps)]int32{api.AtomicIntegerAdd, api.AtomicCAS, api.AtomicFloatAdd}
	l.CapsErr = check(dev.d.a.DeviceGetP2PAtomicCapabilities(&l.Caps[0], &ops[0], uint32(len(ops)), dev.h, dst.h), "cuDeviceGetP2PAtomicCapabilities")
	return l
}
