// Package pool runs a fixed number of workers over a share.Importer: each
// worker takes the next lease, runs the handler on it, and releases it.
//
// # Guarantees
//
//   - A lease is released after its handler returns, whatever it returns,
//     and also if it panics: the panic becomes a *PanicError (with the
//     stack), not a crash, and ends the pool like any handler error.
//   - The first error ends the pool: the context the handlers get is
//     cancelled, no new lease is taken, and the handlers in flight are
//     waited for (drained) and their leases released. Wait returns that
//     first error.
//   - Cancelling the pool's context does the same; Wait then returns the
//     context's error.
//   - The producer's goodbye ends the pool cleanly: Wait returns nil.
//   - Then the pool shuts the importer down (share.Importer.Shutdown):
//     every mapping is closed before the importer says goodbye, so the
//     producer may free its memory as soon as it reads the goodbye. This
//     is the close-before-free order across processes.
//
// The pool owns the importer from Start on: do not call its Next, and do
// not close it before Wait returns.
package pool
