//go:build linux

package share

// ViewOf exposes viewOf, what Lease.View reads, for tests without a
// producer.
var ViewOf = viewOf
