"""A lease: one offer this consumer holds until it releases it.

A lease talks to its consumer through a small interface, and to nothing
else of it (no lock, no driver): _release(lease, stream), _pin(lease,
pin), _keep_view(lease, key, view, pin), _wait_event(event, stream),
_sync_event(event), _copy_to_host(ptr, n), and the constants _on_host and
_dl_device. The consumer's _Alloc record (alloc) is the lease's to read:
its mapping, its views cache, whether its memory died (dead)."""

from typing import Any, Callable, Optional, Tuple

from . import _backends as backends, _dlpack as dlpack, _meta as meta, _views as views, _wire as wire
from ._errors import Closed, NotSupported, ProducerGone


class Lease:
    """One offered buffer, valid until ``release``.

    Views of it (``__cuda_array_interface__``, ``__dlpack__``, ``host()``,
    ``read()``) are valid only until release: after that the producer
    rewrites the buffer. A lease used as a context manager is released on
    exit. A lease dropped without release is released by the garbage
    collector with a ResourceWarning and counted in
    ``Consumer.stats()["leaked"]``, as the Go package does; a framework
    tensor made from it keeps it alive.

    A lease is its offer (PROTOCOL.md section 4): seq, alloc_id,
    generation, offset, size, meta, handle_kind, device_uuid and
    received_ns (when it arrived, time.monotonic_ns) are the ones to read;
    the consumer parses the offer straight into the lease.
    """

    __slots__ = wire.OFFER_FIELDS + ("_c", "_a", "_mapping", "_event", "_waited", "_pins", "released",
                                     "__weakref__")

    # Offer fields, set by _wire.parse_offer.
    seq: int
    alloc_id: int
    generation: int
    offset: int
    size: int
    meta: Any
    handle_kind: int
    device_uuid: bytes
    received_ns: int
    released: bool

    parse = classmethod(wire.parse_offer)

    def _bind(self, consumer, alloc, event):
        self._c = consumer
        self._a = alloc          # the consumer's record of the allocation
        self._mapping = alloc.mapping
        self._event = event      # the producer's opened event, or None
        self._waited = None      # the stream last made to wait on it (most use one)
        self._pins = None        # array()'s cached views that keep it alive until its release
        self.released = False

    # --- where the data is ---

    @property
    def ptr(self) -> int:
        """The address of the offered range: a device pointer on the cuda
        backend, a host address on the sim one. Raises NotSupported where
        the data is not reachable (sim, legacy IPC handle)."""
        self._check()
        if self._mapping.ptr is None:
            raise NotSupported(
                "lease %d: the simulator's legacy IPC memory lives in the Go simulator and is not "
                "reachable from Python; start the producer with -sharing vmm to read data on the simulator" % self.seq)
        return self._mapping.ptr + self.offset

    def _check(self):
        if self.released:
            raise Closed("lease %d was released; its buffer belongs to the producer again" % self.seq)
        if self._a.dead:
            raise ProducerGone("lease %d: its producer is gone, and its legacy IPC (ipc) memory with it" % self.seq)

    def _wait(self, stream):
        """Orders stream after the producer's writes (its event), once."""
        w = self._waited
        if self._event is None or w == stream:
            return
        if w is not None and type(w) is set:
            if stream in w:
                return
        self._c._wait_event(self._event, stream)
        if w is None:
            self._waited = stream
        elif type(w) is set:
            w.add(stream)
        else:
            self._waited = {w, stream}

    def synchronize(self) -> None:
        """Waits on the host until the producer's writes are done."""
        self._check()
        if self._event is not None:
            self._c._sync_event(self._event)

    def view(self) -> Tuple[str, Tuple[int, ...]]:
        """(dtype name, shape) from the offer's meta (PROTOCOL.md §4.2);
        raises ViewError if they do not fit the buffer."""
        return meta.view_of(self.meta, self.size)

    def read(self, n: Optional[int] = None, offset: int = 0) -> bytes:
        """Copies n bytes at offset of the lease to host bytes (after the
        producer's writes). For checks and tests, not for data paths."""
        ptr = self.ptr
        n = self.size - offset if n is None else n
        if offset < 0 or n < 0 or offset + n > self.size:
            raise ValueError("read [%d, %d) of a %d-byte lease" % (offset, offset + n, self.size))
        self.synchronize()
        return self._c._copy_to_host(ptr + offset, n)

    def host(self) -> memoryview:
        """A writable memoryview of the lease in host memory: the sim
        backend's mapping, without a copy. Raises NotSupported on cuda."""
        if not self._c._on_host:
            raise NotSupported("host() needs the sim backend; on a GPU use read(), __cuda_array_interface__ or __dlpack__")
        import ctypes
        arr = (ctypes.c_ubyte * self.size).from_address(self.ptr)
        return memoryview(arr).cast("B")

    @property
    def __cuda_array_interface__(self):
        """Version 3, with the stream the producer's event was waited on
        (the legacy default stream, 1), or None when there was no event.

        The interface names no device, so a framework asks the driver, which
        names the GPU where the memory lives: for a VMM lease mapped on
        another GPU that is the producer's, and cupy.asarray then copies the
        batch to the current device (measured on two H200s). __dlpack__
        names the consumer's device and is zero-copy there too."""
        if self._c._on_host:
            raise AttributeError("__cuda_array_interface__: the sim backend's memory is host memory (use __dlpack__ or host())")
        dtype, shape = self.view()
        typestr = meta.DTYPES[dtype][1]
        if typestr is None:
            raise AttributeError("__cuda_array_interface__ has no typestr for %s; use __dlpack__" % dtype)
        ptr = self.ptr
        stream = None
        if self._event is not None:
            self._wait(0)
            stream = 1
        return {"version": 3, "shape": shape, "typestr": typestr, "data": (ptr, False),
                "strides": None, "stream": stream}

    @property
    def __array_interface__(self):
        """On the sim backend, numpy.asarray(lease) views the mapping."""
        if not self._c._on_host:
            raise AttributeError("__array_interface__: device memory (use __cuda_array_interface__)")
        dtype, shape = self.view()
        typestr = meta.DTYPES[dtype][1]
        if typestr is None:
            raise AttributeError("no array-interface typestr for %s" % dtype)
        return {"version": 3, "shape": shape, "typestr": typestr, "data": (self.ptr, False), "strides": None}

    def __dlpack_device__(self) -> Tuple[int, int]:
        return self._c._dl_device

    def __dlpack__(self, stream=None, **_kw):
        """A "dltensor" capsule. stream is the consumer's stream (DLPack: an
        int, 1 the legacy default stream, 2 per-thread, None: legacy); it is
        made to wait on the producer's event (one cuStreamWaitEvent, once
        per lease and stream), so no host sync happens. The tensor made of
        it is a view valid until this lease's release."""
        if self.released:
            self._check()
        m = self.meta
        if type(m) is dict and "dtype" not in m and "shape" not in m:
            dtype, shape = "uint8", (self.size,)
        else:
            dtype, shape = meta.view_of(m, self.size)
        p = self._mapping.ptr
        if p is None:
            p = self.ptr  # raises NotSupported
        c = self._c
        if not c._on_host and self._event is not None:
            s = 0 if stream is None or stream == 1 else stream
            if s != -1:  # -1: the consumer asked for no synchronization
                if self._waited != s:
                    self._wait(s)
        dt, did = c._dl_device
        return dlpack.capsule(p + self.offset, shape, meta.DTYPES[dtype][2], dt, did, self)

    def array(self, convert: Callable[[Any], Any], stream: Any) -> Any:
        """The lease as convert makes it (torch.from_dlpack or
        cupy.from_dlpack; numpy.from_dlpack on the sim backend), with no
        copy: made once per allocation, range, dtype, shape and convert, and
        the same object returned to every later lease of that range. A
        ring's buffer becomes a tensor once, not once per batch: no DLPack
        capsule and no framework call per lease.

        stream (a CUstream int, or a framework's stream: see release();
        None or 1: the legacy default stream; -1: none) is made to wait on
        the producer's event, once per lease and stream, as
        __dlpack__(stream) does. It is not optional: a framework's current
        stream is often another one (torch.cuda.Stream() is non-blocking),
        and the stream the converter names is ordered only when the view is
        made (the first lease of its range). Run the work on stream, and
        release on it.

        The object is a view of memory that belongs to this lease only: use it
        between array() and release(), as every view; until the release it
        keeps the lease alive, as a tensor of __dlpack__ does. A lease
        dropped without release together with its view is given back (and
        counted leaked, with a warning) when next() waits, or when its
        allocation is retired; "its view" counts what refers to the view's
        Python object, which a slice of it does in torch 2.11 (checked) but
        may not in older torch: there, hold the lease or the view while a
        slice is in use (releasing the lease is the contract anyway). The next
        lease of the range gets the same object: change it only through new
        views (x.view(...), x[...]), not in place (shape, dtype,
        requires_grad). An object that is not at the lease's address (a
        converter that copies, or one whose address this package cannot
        read) is never reused: each call then makes a new one. The consumer
        drops its views when the allocation is retired or the consumer
        closes; it keeps at most MAX_VIEWS (_views.py) per allocation and
        views.MAX_VIEWS_TOTAL in all (beyond that each call makes a new one)."""
        if self.released:
            self._check()
        m = self.meta
        if type(m) is dict and "dtype" not in m and "shape" not in m:
            key = (convert, self.offset, self.size)
        else:
            key = (convert, self.offset, self.size) + meta.view_of(m, self.size)
        cache = self._a.views
        ent = None if cache is None else cache.get(key)
        if ent is None:
            return self._new_view(convert, key, stream)
        if ent[1].lease is not self:
            self._c._pin(self, ent[1])
        if self._event is not None:
            self._order(stream)
        return ent[0]

    def _order(self, stream):
        """Makes stream (as array() takes it) wait on the producer's event,
        once per stream."""
        if self._event is None or self._c._on_host:
            return
        s = 0 if stream is None else (stream if type(stream) is int else backends.stream_handle(stream))
        if s == 1:
            s = 0
        if s != -1 and self._waited != s:
            self._wait(s)

    def _pin_locked(self, pin):
        """Makes pin (a cached view's) keep this lease alive until its
        release (_unpin_locked). Under the consumer's lock (its _pin)."""
        if self.released:
            return
        pin.lease = self
        ps = self._pins
        if ps is None:
            self._pins = pin
        elif type(ps) is list:
            if not any(p is pin for p in ps):
                ps.append(pin)
        elif ps is not pin:
            self._pins = [ps, pin]

    def _new_view(self, convert, key, stream):
        if len(key) == 3:
            dtype, shape = "uint8", (self.size,)
        else:
            dtype, shape = key[3], key[4]
        p = self._mapping.ptr
        if p is None:
            p = self.ptr  # raises NotSupported
        p += self.offset
        # Ordered first: a converter that copies reads after the producer.
        self._order(stream)
        c = self._c
        dt, did = c._dl_device
        pin = views.Pin(self, key)
        v = convert(views.Capsule(dlpack.capsule(p, shape, meta.DTYPES[dtype][2], dt, did, pin), (dt, did), self))
        if views.address_of(v) != p:
            return v  # a copy, or unknown: never reused; its pin keeps this lease for as long as it lives
        return c._keep_view(self, key, v, pin)

    def _unpin_locked(self):
        """At the release: array()'s cached views stop keeping this lease
        alive. Under the consumer's lock."""
        ps = self._pins
        if ps is not None:
            self._pins = None
            views.unpin(self, ps)

    # --- giving it back ---

    def release(self, stream: Any = None) -> None:
        """Gives the buffer back. Without stream, the caller has finished
        every use of it (synchronized). With stream, the release is
        stream-ordered: the producer waits for the work queued there so
        far. A stream is a CUstream int, an object with __cuda_stream__
        (the CUDA stream protocol: cuda.core), torch's (.cuda_stream),
        CuPy's (.ptr), or one whose .handle is a CUstream (cuda.core's
        CUstream object, Numba's ctypes pointer); JAX has no stream object
        to pass. Idempotent."""
        if self.released:
            return
        self._c._release(self, stream)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def __repr__(self):
        return "<cudashare.Lease seq=%s alloc=%s size=%s%s>" % (
            getattr(self, "seq", "?"), getattr(self, "alloc_id", "?"), getattr(self, "size", "?"),
            " released" if getattr(self, "released", True) else "")

