// Package share shares CUDA device memory from one process with others, with
// no copy: a producer's Exporter offers buffers over a Unix socket
// (package transport, PROTOCOL.md), and each consumer's Importer maps them
// (vmm or legacy ipc), once per allocation, and returns each offer as a
// Lease. A user of share needs nothing of package transport: the errors a
// caller matches (ErrDisconnected, ErrWriteTimeout, ErrTimeout, ...) and
// the producer's Peer are share's own names (errors.go, peer.go).
//
//	producer                                  consumer
//	e, _ := share.NewExporter(ctx, dctx, path, share.ExporterConfig{})
//	r, _ := e.NewRing(8, 4<<20)               im, _ := share.Dial(ctx, path, dctx, share.ImporterConfig{Stream: s})
//	b, _ := r.Acquire(ctx)                    l, _ := im.Next(ctx)
//	// write b.Ptr() on stream ws             // read l.Ptr() on stream s, then s.Synchronize()
//	e.Offer(ctx, b, share.OfferOptions{       l.Release()
//	    Meta: meta, Stream: ws})              ...
//	...                                       im.Shutdown(ctx)
//	e.Shutdown(ctx)
//
// Package pool runs a set of workers over an Importer.
//
// # Joining your own CUDA work
//
// The work that writes a buffer is complete when Offer is called, or
// OfferOptions.Stream is the stream it runs on. No Synchronize is needed
// in the second case: the buffer's interprocess event is recorded on that
// stream, and the consumer's stream waits for it on the GPU. A stream made
// outside cudashare (by cgo, nvJPEG, NVDEC) is used through
// driver.Context.WrapStream, which does not take it over; Stream.Handle and
// Context.Handle give the raw CUstream and CUcontext to such code.
//
// Metadata is one msgpack value: EncodeMeta makes it from a Go value,
// DecodeMeta and Lease.DecodeMeta read it back, and ViewMeta and
// Lease.View follow the dtype and shape convention of PROTOCOL.md section
// 4.2. Lease.CopyToHost and CopyElements copy a lease to the host without
// reading past it. ImporterConfig.DialWait lets a consumer start before
// its producer; DefaultSocketPath is where both meet by default.
//
// # What the caller guarantees
//
// Producer:
//   - It does not write a buffer while a consumer holds it. A Ring hands
//     out only buffers no one holds; Buffer.Wait waits for that; an arena
//     buffer's range is reused only after Free and every release.
//   - Memory it registered (Register) is freed only after Retire of a
//     buffer in it has returned: until then a consumer may map it.
//   - The work that writes a buffer is complete when Offer is called, or
//     OfferOptions.Stream is the stream it runs on (the buffer's event is
//     recorded there and the consumer's stream waits for it).
//   - The driver context outlives the Exporter. Producer and consumer are
//     different processes: CUDA refuses to open an IPC handle in the
//     process that made it.
//
// Consumer:
//   - A lease's pointer is used only between Next and Release, and only in
//     the importer's context. Release comes after every use has completed:
//     the producer may write the buffer, or free it, as soon as it is
//     released. GPU work that reads it must be synchronized first (for
//     example Stream.Synchronize on the importer's stream).
//   - Importers of one process that share a Registry use one context per
//     device (the primary context): the driver lets one context per device
//     open a given handle.
//   - Every lease is released. A lease that is garbage-collected without
//     Release is reported and released on the user's behalf (see Lease),
//     as a backstop, not a way to work.
//
// # Close before free
//
// A producer must never free memory that another process still maps (the
// strict simulated driver refuses it and records a violation; the real
// driver leaves the consumer reading freed memory). So:
//
//   - The exporter records, per allocation, every consumer that may map
//     it: one that was offered a buffer in it and has not confirmed closing
//     it. Retire (and Shutdown, which retires everything) stops offers of
//     the allocation, waits for offers already on their way to leave,
//     sends retire to each of those consumers, waits for each to answer
//     closed, and only then frees. It waits with a context and never frees
//     early; if the context ends, the retirement simply is not finished.
//   - An importer answers a retire once no lease of its own is in the
//     allocation: it drops its hold on the mapping (the registry closes it
//     with the last hold in the process, so the IpcCloseMemHandle has
//     happened) and then sends closed. Its receiving goroutine does this
//     whether or not anyone calls Next, so a retirement is not held up by
//     an idle consumer.
//   - An importer's Shutdown and Close close every mapping before they say
//     goodbye, and a goodbye tells the exporter that the consumer holds
//     nothing: its leases end and its mappings are gone.
//
// # Consumers that disappear, stall or lie
//
// One consumer's misbehaviour never stops the producer serving the others,
// and never makes it free memory that may be in use (PROTOCOL.md, sections
// 6.1 and 7.1, say the same for peers in other languages):
//
//   - What a consumer may map belongs to its connection: nothing is voided
//     while the connection is open. A consumer whose connection ends
//     without a goodbye may have died, or may be alive with its mappings
//     open (its connection failed). The exporter takes it out of the
//     rotation at once; if it held nothing, it is forgotten at once;
//     otherwise its leases and mappings are void once its process has
//     exited (process exit unmaps everything), watched through a pidfd
//     opened while it was connected, one per process however many
//     connections it opens. A ring buffer it held then comes back, and a
//     retirement waiting on it finishes.
//   - If that process exits while its connection is still open (it
//     handed the connection on, or a child inherited it), the exporter
//     finds the processes holding the connection now (sock_diag, then
//     /proc) and waits for them instead. Where none can be found or
//     watched (another PID namespace, another user), what the connection
//     may map stays allocated until a goodbye or the producer exits.
//     ExporterStats counts both cases.
//   - Offer picks the consumer holding the fewest leases among those with
//     a credit (and below MaxLeasesPerConsumer), so a stalled consumer
//     holds no more than its share; consumers that have released nothing
//     yet hold together no more than those that have, so a crowd of
//     connections that never release cannot take the buffers of a
//     consumer at work (PROTOCOL.md, section 6.1). Broadcast gives a consumer that
//     cannot take a buffer a short grace; then it misses buffers until it
//     has room again, and the others go on (see Broadcast).
//   - A consumer holding a lease longer than LeaseTimeout is dropped with
//     an error that says why, and handled as above.
//   - A closed that could be false (not the answer to a retire, or while
//     the consumer holds leases in the allocation), or a release of an
//     offer the consumer does not hold, is a protocol error: the consumer
//     is dropped and handled as above; nothing is freed on its word.
//   - A Shutdown that gives up waiting still says goodbye to every
//     consumer that holds nothing, tells the others why they are dropped,
//     and names them in its error.
//
// A producer that disappears ends every Importer's Next with
// ErrProducerGone; queued leases are dropped, mappings with no lease close
// at once and the others at their last Release (the memory stays valid
// while mapped).
//
// # Speed
//
// The hot path is one offer and one release on the transport's batched
// writes. The producer takes the IPC handle once per allocation and makes
// no driver call per offer unless the offer carries an event (one
// cuEventRecord); the consumer opens each allocation once (a cached lookup
// is a map lookup, tens of nanoseconds) and calls the driver per lease
// only to wait on an event. Neither side allocates per handoff: leases are
// allocated in blocks, rings and arenas reuse their buffers' records, and
// seqs index a slot table. Arenas make fresh buffers as cheap as reused
// ones: sub-allocation costs no driver call and a consumer maps the arena
// once. BenchmarkHandoff and BenchmarkRegistryLookup measure it.
package share
