// Package sim is the simulated CUDA driver: a pure-Go implementation of
// api.API that shares "device memory" between real processes, for machines
// without a GPU and for CI. It keeps the real driver's return codes and
// lifetime rules, and is strict where the real driver is undefined: those
// are the bugs cudashare exists to prevent, so the sim refuses them, records
// them as violations (api.Strict), and leaves memory intact.
//
// # Configuration
//
// New reads the environment; NewWithConfig takes a Config.
//
//   - CUDASHARE_SIM_DIR: the state directory, default DefaultDir()
//     (/dev/shm/cudashare-sim-<uid>). Every process that points at the same
//     directory shares one simulated machine. It is created 0700 and refused
//     if another user owns it or may write it.
//   - CUDASHARE_SIM_TOPOLOGY: the machine, as JSON (see Topology) or a bare
//     device count. Default: two "cudashare sim GPU" devices of 4 GiB,
//     compute capability 9.0, peer access both ways, performance rank 0,
//     native atomics: a two-H200 NVLink box. UUIDs derive from the topology,
//     so every process agrees on them.
//   - CUDA_VISIBLE_DEVICES: renumbers the devices of this process as CUDA
//     does (ordinals or GPU-<uuid prefix>; the list ends at the first entry
//     that names no device). IPC handles of hidden devices still open, with
//     peer rules applied between the host-global devices.
//
// Every process sharing a directory must use the same topology; New fails on
// a mismatch. Each Driver is one simulated process, also when one OS process
// makes several (as tests do).
//
// # Shared state
//
// Three kinds of file live in the state directory:
//
//   - registry: a fixed-size table (8192 allocation slots) mmap'd MAP_SHARED
//     by every process and changed only under an exclusive flock on it. A
//     slot holds the allocation's global buffer id (never reused in the
//     directory), a random nonce, the owner (pid, Driver instance, process
//     start time from /proc/<pid>/stat, PID namespace inode), the
//     host-global device, the size,
//     a state (live, or orphaned: owner gone but still mapped elsewhere) and
//     a table of up to 32 mapper processes with their mapping counts. Device
//     memory in use is the sum over slots, so it is never out of step with
//     them.
//   - buf-<id>: one sparse file per allocation, mmap'd MAP_SHARED by its owner
//     and by every process that opens its IPC handle, so bytes written by one
//     process are read by another. Copies, sets and reads are plain memory
//     operations on these mappings.
//   - violations.jsonl: the violation log, one JSON line per O_APPEND write,
//     so lines from concurrent processes never interleave.
//   - proc-<ns>-<pid>-<start>: one presence file per process using the
//     directory, on which the process holds a shared flock while it uses
//     the directory. A process in another PID namespace is alive while its
//     file is locked: its pid means nothing in this one's /proc.
//
// A process that is gone (its pid has no /proc entry, is a zombie, or was
// reused: the start time differs) counts as having unmapped everything, as
// process exit does, and as having freed its allocations once no live
// process maps them. Nothing waits for that: entries are swept lazily, when
// an allocation would not fit, when a free or an open looks at a slot, and
// in cuMemGetInfo. A process killed in the middle of a registry update can
// leave that one slot inconsistent; the flock itself dies with it.
//
// # PID namespaces
//
// Processes in different PID namespaces (unshare --pid, containers) share a
// machine when they share the state directory. Pids are recorded with their
// namespace's inode, liveness across namespaces goes by presence files, and
// legacy IPC handles follow the real driver (measured, GPU.md): they open
// between a parent and a child namespace either way, and fail between
// siblings with CUDA_ERROR_INVALID_CONTEXT. A process sees that a namespace
// is below its own when the namespace's processes show in its /proc; that
// one is above it, only from CUDASHARE_SIM_PIDNS, which every sim process
// sets (appending its namespace) for the processes it starts. A process put
// in a new namespace by a process that never used the sim therefore treats
// handles from the namespaces above as a sibling's. VMM fds need none of
// this: they import in any namespace.
//
// Why this design: an mmap'd table under flock needs no daemon and no
// socket, survives any process being killed (the kernel drops its lock and
// its mappings), and costs one flock and a few /proc reads per allocation,
// free, open or close, which are not on the handoff path.
//
// # VMM allocations (cuMemCreate and friends)
//
// A VMM allocation is a memfd (memfd_create, named
// "cudashare-sim-vmm-<global id>"), not a file in the state directory. Its
// layout is the simulator's representation of device memory, stable for
// other readers (a Python consumer maps it with mmap); PROTOCOL.md section
// 4.1.1 is its normative description for peers, kept in step by
// TestVMMLayoutDocumented:
//
//	offset 0, one 4096-byte header page, little-endian:
//	[0:8]   "CSIMVMM1"
//	[8:12]  version (1)
//	[12:16] host-global device of the memory
//	[16:24] size in bytes of the memory (a multiple of 2 MiB)
//	[24:32] global buffer id (never reused in the state directory)
//	[32:36] registry slot charged with the memory
//	[36:40] requested handle types (CUmemAllocationHandleType bits)
//	[40:56] creator: pid, Driver instance, process start time
//	[56:64] checksum: FNV-1a of the machine's secret and bytes [0:56]
//	offset 4096: the memory itself, size bytes
//
// The creator makes the memfd with MFD_ALLOW_SEALING, mode 0600, and seals
// it with F_SEAL_SHRINK, F_SEAL_GROW and F_SEAL_SEAL once header and size
// are written, so that no process it reaches can resize it (a shrunk
// memfd makes every access to a mapping of the lost pages fault, SIGBUS,
// in every process) or seal it against writing. An import refuses, with
// CUDA_ERROR_UNKNOWN, an fd whose seals lack F_SEAL_SHRINK or F_SEAL_GROW,
// include F_SEAL_WRITE or F_SEAL_FUTURE_WRITE, or whose size is not
// exactly 4096 + size; ExplainImport says which (api.ImportExplainer).
// It reads the seals before the size: once sealed, the size cannot change
// between the check and the mapping.
//
// A consumer that is not the sim makes the same checks, then maps
// [4096, 4096+size) of the fd MAP_SHARED and sees the same bytes as every
// other mapping. Export dups
// the memfd (cuMemExportToShareableHandle gives a new close-on-exec fd);
// import needs nothing but the fd, so an fd passed with SCM_RIGHTS imports
// in any process and any PID namespace; cuMemMap mmaps the memory. The
// kernel's reference counting on the memfd gives the real semantics:
// physical memory lives while any handle, fd or mapping of it exists,
// whoever created it and whether or not that process still runs. A bad
// checksum (an fd of another state directory, or not a VMM allocation at
// all) fails the import with CUDA_ERROR_UNKNOWN, as driver 580 does for an
// fd of /dev/null.
//
// Device memory accounting: cuMemCreate charges a registry slot, owned by
// the creating process, which holds it while it has a handle or a mapping
// of the allocation; every other process that imports the fd is a mapper of
// that slot while it has a handle or mapping. So cuMemGetInfo counts the
// memory while any live process holds a handle or mapping, and stops when
// the last such process lets go or dies (swept like the other slots). Not
// counted: memory that lives only as an fd in flight (exported, sent, not
// yet imported) after every holder has gone; an import then still works but
// charges nothing. A process importing when the slot's mapper table is full
// (32 processes) is not counted either.
//
// Address reservations (cuMemAddressReserve) come from their own 1 TiB
// region of the simulated address space, above the device regions, at
// 2 MiB granularity. A mapping has no access until cuMemSetAccess names the
// device of the thread's current context (read and read-write are not told
// apart). Mappings belong to the process, not to a context: destroying a
// context leaves them; process exit (Deinit) unmaps and releases
// everything.
//
// # Addresses
//
// Device pointers are simulated addresses local to a process: host-global
// device n owns the region 0x7f00_0000_0000 + n<<40, and allocations and
// mappings take the lowest free range of 2 MiB granules there, so a freed
// range is handed out again, as cuMemAlloc does. Each allocation, and each
// IPC open that maps, gets a fresh CU_POINTER_ATTRIBUTE_BUFFER_ID, so
// address reuse can be told apart. The sim remembers freed and closed
// ranges, to name the violation when one is used again.
//
// # Contexts, threads and the hot path
//
// The current context belongs to the OS thread (gettid), on a per-thread
// stack as in CUDA: cuCtxCreate pushes, cuCtxDestroy of the current context
// and cuCtxSetCurrent(NULL) pop, cuCtxSetCurrent replaces the top. A primary
// context keeps one handle for the life of the process; released to zero it
// is inactive (CUDA_ERROR_CONTEXT_IS_DESTROYED) until retained again.
//
// Contexts, streams and events are handles into lock-free tables;
// cuCtxGetCurrent, cuEventRecord, cuStreamWaitEvent and cuEventQuery take no
// lock, do no file I/O and allocate nothing (one gettid system call where
// the current context is needed). Work is synchronous: a copy has completed
// when its call returns, so a recorded event is complete. But the sim
// remembers which asynchronous work no host wait of any kind has followed
// yet, for one check below (pending.go).
//
// # Strictness
//
//   - cuMemFree of memory that another live process maps: refused with
//     CUDA_ERROR_ILLEGAL_STATE, violation "free-while-mapped", memory intact.
//     Destroying a context that owns such memory frees it anyway (the
//     mappers keep it alive) and records the same violation.
//   - cuIpcCloseMemHandle of a pointer this process did not open, or has
//     closed as often as it opened: CUDA_ERROR_INVALID_VALUE and violation
//     "close-unopened".
//   - Copies and sets on a range that is not wholly inside one live
//     allocation or mapping: CUDA_ERROR_INVALID_VALUE; if the address was
//     freed, closed or unmapped here, violation "access-after-free",
//     "access-after-close" or "access-after-unmap".
//   - Copies and sets on a VMM mapping that cuMemSetAccess has not opened to
//     the current context's device: CUDA_ERROR_INVALID_VALUE, violation
//     "access-denied" (a kernel would fault on the real device).
//   - cuMemRelease of a released handle: CUDA_ERROR_INVALID_VALUE,
//     violation "double-release"; cuMemMap of one, "map-released";
//     cuMemExportToShareableHandle of one, "use-after-release" (all
//     undefined on the real driver).
//   - cuIpcCloseMemHandle, or cuMemUnmap of another process's allocation,
//     after an asynchronous copy or set used the mapping and before the
//     process made any call that waits on the host (a stream, context or
//     event synchronization or query, a synchronous copy or set, a free,
//     destroying a context): violation "close-with-pending-work"; the
//     close goes ahead. On a GPU the work may still be reading the
//     mapping. The rule is generous on purpose (pending.go): it can miss,
//     and accuses only one correct program, named there (a process told
//     by another that its work is done, with no wait of its own).
//
// # Where the codes come from
//
// The documentation pages, and probes of the real driver (580.159.04, CUDA
// 13.0, on an H100 and on two H200s joined by NV18) for what they leave
// open: which calls need a current context, the order in which arguments
// are checked, the codes for stale, foreign and malformed handles, the
// one-context-per-device IPC rule, the context stack, CUDA_VISIBLE_DEVICES
// parsing. Method comments say "measured" for those. What is marked
// "unverified" is the sim's choice where no probe has looked yet.
//
// # Limits
//
// Linux only (flock, mmap, /proc, gettid). At most 8192 live allocations on
// the machine, 32 processes mapping one allocation (then
// CUDA_ERROR_MAP_FAILED), 2^20 live contexts, streams and events per
// process, 64 devices of at most 1 TiB. A kernel-reused thread id inherits
// the old thread's current context.
package sim
