//go:build linux

package share

// ArrayOf exposes arrayOf, what Lease.Array reads, for tests without a
// producer.
var ArrayOf = arrayOf
