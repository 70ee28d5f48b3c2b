// Package peerlink reads what `cudashare devices` reports about the link
// between two devices: the five CUdevice_P2PAttribute values and the
// atomic capabilities of three operations. Nothing in cudashare's own
// paths depends on them, so they stay out of driver's public API; driver
// fills Read when it is linked in.
package peerlink

// Link is the link src -> dst as the driver reports it.
type Link struct {
	// Attrs are, in order: access supported, performance rank, native
	// atomics supported, CUDA array access supported, only partial native
	// atomics. AttrErrs[i] is why Attrs[i] could not be read.
	Attrs    [5]int
	AttrErrs [5]error
	// Caps are the CUatomicOperationCapability masks of integer add,
	// compare-and-swap and float add; CapsErr is why they could not be read.
	Caps    [3]uint32
	CapsErr error
}

// Read reads the link src -> dst, two *driver.Device of one Driver (typed
// any because driver imports this package). Package driver sets it in its
// init and nothing else writes it.
var Read func(src, dst any) Link
