// Package uuid holds the one device UUID type that driver and transport both
// name: transport must not import driver, so the type lives below both.
package uuid

import "encoding/hex"

// UUID identifies a CUDA device (CUuuid). Devices are named by UUID, across
// processes and on the wire, because CUDA_VISIBLE_DEVICES renumbers ordinals
// per process.
type UUID [16]byte

// String formats u as nvidia-smi does: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
func (u UUID) String() string {
	var b [36]byte
	hex.Encode(b[0:8], u[0:4])
	b[8] = '-'
	hex.Encode(b[9:13], u[4:6])
	b[13] = '-'
	hex.Encode(b[14:18], u[6:8])
	b[18] = '-'
	hex.Encode(b[19:23], u[8:10])
	b[23] = '-'
	hex.Encode(b[24:], u[10:])
	return "GPU-" + string(b[:])
}
