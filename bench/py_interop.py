#!/usr/bin/env python3
"""bench/py_interop.py: the Python consumer handing each lease to CuPy, JAX
or torch (through __cuda_array_interface__), every byte checked on the GPU;
for bench/python-gpu-check.sh. bench/py_consumer.py is the torch DLPack one.

Against the Go example producer (ring or fresh, with -fill: every byte of
batch n is n % 251 + 1, PROTOCOL.md 4.2), for each lease: an array of the
lease with no copy, (x != want).sum() added to a device counter on the
consumer's stream, and a release ordered after that work. One host sync at
the end reads the counter (JAX: see below).

--framework:

  cupy         cupy.asarray(lease): __cuda_array_interface__ v3. The lease
               makes the legacy default stream wait on the producer's event
               and names it in the dict ("stream": 1). CuPy, consuming CAI
               v3, calls cudaStreamSynchronize on that stream (a host wait,
               cupy/_core/core.pyx _convert_object_with_cuda_array_interface;
               none with CUPY_CUDA_ARRAY_INTERFACE_SYNC=0). This consumer's
               work runs on its own cupy.cuda.Stream(non_blocking=True), which
               does not wait for the legacy stream by itself: so it also
               records an event on the dict's stream and makes its stream
               wait on it (on the GPU), which is correct with or without
               CuPy's host wait. Release: lease.release(stream=stream.ptr).
  cupy-dlpack  DLPack, two ways, alternating per batch (--dlpack both; or
               protocol, or capsule): "protocol" is cupy.from_dlpack(lease)
               inside `with stream:` (CuPy passes its current stream's
               pointer to lease.__dlpack__, which makes that stream wait on
               the producer's event); "capsule" is
               lease.__dlpack__(stream=stream.ptr) then cupy.from_dlpack of
               the capsule (CuPy's backward-compatible path; where a CuPy
               refuses bare capsules, the capsule is handed over through an
               object whose __dlpack__ returns it). No host wait per batch.
  jax          jax.numpy.from_dlpack(lease) (or jax.dlpack.from_dlpack):
               JAX passes the stream it uses for external ready events to
               lease.__dlpack__, which makes it wait on the producer's event.
               JAX has no user stream to order a release on, so a lease is
               released from the host once the jitted check that read it is
               done (block_until_ready), with up to credits/2 batches in
               flight. Exit 3 (skipped) without jax or without a JAX GPU
               backend. XLA_PYTHON_CLIENT_PREALLOCATE=false unless set.
  torch-cai    torch.as_tensor(lease, device=cuda:N): __cuda_array_interface__.
               torch ignores the dict's "stream" key (torch/csrc/utils/
               tensor_numpy.cpp tensor_from_cuda_array_interface), so a torch
               consumer on a stream of its own must order it itself: this one
               records an event on the dict's stream (1, the legacy default
               stream: torch's default stream, handle 0, in a build without
               per-thread default streams) and makes its stream wait on it.
               Release: lease.release(stream=stream.cuda_stream).
  host         no framework: the bytes read on the host (lease.host() on the
               simulator, lease.read() on a GPU), released from the host. It
               runs on the simulator, to test this script's loop and report.

Prints one JSON line with the keys of bench/py_consumer.py's report
(handoffs, handoffs_per_s, verified, verify_errors, check, ...) and
zero_copy ("k/n": batches whose array pointed at the lease's memory).
Exit 0 ok, 1 wrong data or failure, 3 skipped (no such framework, no GPU
for it, no CUDA backend; the line says why), 4 no producer, 5 the producer
vanished.
"""

import argparse
import collections
import os
import sys
import time
import traceback

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python"))

FRAMEWORKS = ("cupy", "cupy-dlpack", "jax", "torch-cai", "host")


class Skip(Exception):
    """The framework or a GPU for it is missing: exit 3, not a failure."""


from py_consumer import batch_of, finish, out  # noqa: E402  (the same report line, ended the same way)


class _Premade:
    """Hands a capsule made already (lease.__dlpack__(stream=...)) to a
    from_dlpack that takes only objects with __dlpack__: the stream it
    passes is ignored, the capsule's stream wait is done."""

    __slots__ = ("cap", "dev", "streams")

    def __init__(self, cap, dev, streams):
        self.cap, self.dev, self.streams = cap, dev, streams

    def __dlpack_device__(self):
        return self.dev

    def __dlpack__(self, stream=None, **_kw):
        self.streams[stream] += 1
        cap, self.cap = self.cap, None
        if cap is None:
            raise RuntimeError("the capsule was consumed already")
        return cap


# --- frameworks: load (import; Skip), setup (device, stream; Skip), ctx
# (the context the loop runs in), check (queue the check of one lease and
# release it), finish (wait for the work; the count of wrong bytes), abort
# (best-effort wait before the consumer closes after an error).

class _NoHold:
    """Frameworks that release each lease in check() hold none."""

    def holds(self):
        return False

    def drain(self):
        pass


class Host(_NoHold):
    impl = "cudashare-python"
    backend = "auto"

    def __init__(self, a):
        self.a = a
        self.views = 0
        self.copies = 0
        self.bad = 0
        self.info = {}

    def load(self):
        try:
            from cudashare import NotSupported
        except ImportError as e:
            raise Skip("the cudashare package does not import (%s): is msgpack installed?" % e)
        self.NotSupported = NotSupported

    def setup(self):
        pass

    def ctx(self):
        import contextlib
        return contextlib.nullcontext()

    def check(self, lease, want):
        try:
            lease.synchronize()      # the producer's writes are done
            b = bytes(lease.host())  # the simulator's mapping (bytes() copies it for count())
        except self.NotSupported:
            b = lease.read()         # a GPU: copied to the host after the producer's event
            self.copies += 1
        self.views += 1
        self.bad += len(b) - b.count(want)
        del b
        lease.release()

    def finish(self):
        return self.bad

    def abort(self):
        pass


class Cupy(_NoHold):
    backend = "cuda"

    def __init__(self, a, mode):
        self.a = a
        self.mode = mode          # "cai", or "protocol" / "capsule" / "both" (DLPack)
        self.impl = "cudashare-python+cupy-" + ("cai" if mode == "cai" else "dlpack")
        self.views = 0
        self.copies = 0
        self.info = {}
        self.streams_seen = collections.Counter()
        self.capsule_via = None   # "cupy.from_dlpack(capsule)" or "wrapper"
        self.paths = collections.Counter()

    def load(self):
        try:
            import cupy
        except ImportError as e:
            raise Skip("no cupy here (%s)" % e)
        self.cp = cupy
        self.info["cupy"] = cupy.__version__

    def setup(self):
        cp = self.cp
        try:
            ndev = cp.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDARuntimeError: no driver, no device
            raise Skip("cupy sees no GPU (%s)" % e)
        if ndev <= self.a.device:
            raise Skip("cupy sees %d GPU(s), no device %d" % (ndev, self.a.device))
        self.info["cupy_cai_sync"] = os.environ.get("CUPY_CUDA_ARRAY_INTERFACE_SYNC", "1 (default)")
        cp.cuda.Device(self.a.device).use()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.sp = self.stream.ptr
        with self.stream:
            self.acc = cp.zeros((), dtype=cp.int64)  # queued on stream: before the adds
        self.ev = cp.cuda.Event(disable_timing=True)
        self.legacy = getattr(cp.cuda.runtime, "streamLegacy", 1)
        self.i = 0

    def ctx(self):
        return self.stream  # CuPy's current stream inside the loop

    def _after(self, s):
        """Orders this consumer's stream after the CAI's stream s (on the GPU)."""
        if s is None:
            return
        self.cp.cuda.runtime.eventRecord(self.ev.ptr, self.legacy if s == 1 else s)
        self.stream.wait_event(self.ev)

    def _from_capsule(self, lease):
        cp = self.cp
        cap = lease.__dlpack__(stream=self.sp)  # self.sp waits on the producer's event
        if self.capsule_via != "wrapper":
            try:
                x = cp.from_dlpack(cap)
                self.capsule_via = "cupy.from_dlpack(capsule)"
                return x
            except (TypeError, AttributeError):
                if self.capsule_via is not None:
                    raise
                # This CuPy takes only objects with __dlpack__; the capsule
                # was not consumed (still "dltensor").
                self.capsule_via = "wrapper"
        return cp.from_dlpack(_Premade(cap, lease.__dlpack_device__(), self.streams_seen))

    def check(self, lease, want):
        cp = self.cp
        if self.mode == "cai":
            cai = lease.__cuda_array_interface__  # the legacy stream waits on the producer's event
            x = cp.asarray(lease)                 # CuPy host-syncs cai["stream"] (CAI v3)
            self._after(cai["stream"])
            p = cai["data"][0]
            if "cai_pointer_device" not in self.info:
                # CAI names no device: CuPy takes the pointer's from
                # cudaPointerGetAttributes, and asarray copies an array of
                # another device to the current one (cupy/_core/core.pyx
                # _array_from_cupy_ndarray). Say what the driver told it.
                self.info["cai_pointer_device"] = "%d (current %d)" % (
                    cp.cuda.runtime.pointerGetAttributes(p).device, cp.cuda.Device().id)
        else:
            m = self.mode
            if m == "both":
                m = "protocol" if self.i % 2 == 0 else "capsule"
            self.i += 1
            self.paths[m] += 1
            if m == "protocol":
                x = cp.from_dlpack(lease)         # CuPy passes self.sp (its current stream)
            else:
                x = self._from_capsule(lease)
            p = lease.ptr
        self.views += 1
        if x.data.ptr != p:
            self.copies += 1
        if x.dtype != cp.uint8 or x.ndim != 1:
            x = x.view(cp.uint8).reshape(-1)
        self.acc += (x != want).sum()
        del x
        lease.release(stream=self.sp)  # after the check queued on the stream: no host wait

    def finish(self):
        self.stream.synchronize()
        if self.capsule_via:
            self.info["capsule_via"] = self.capsule_via
        if self.streams_seen:
            self.info["wrapper_streams"] = {str(k): v for k, v in self.streams_seen.items()}
        if self.paths:
            self.info["dlpack_paths"] = dict(self.paths)
        return int(self.acc.get())

    def abort(self):
        self.stream.synchronize()


class Jax:
    backend = "cuda"

    def holds(self):
        return bool(self.pending)

    def drain(self):
        """Releases the held leases, after the checks that read them."""
        while self.pending:
            l, r = self.pending.popleft()
            r.block_until_ready()
            l.release()

    impl = "cudashare-python+jax"

    def __init__(self, a):
        self.a = a
        self.views = 0
        self.copies = 0
        self.info = {}
        self.pending = collections.deque()
        # Leases held while their check runs: below the credits, or the
        # producer could offer nothing more and next() would wait forever.
        self.window = max(0, min(a.credits - 1, a.credits // 2))
        self.old_api = False

    def load(self):
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the producer needs the GPU's memory too
        try:
            import jax
            import jax.numpy as jnp
        except ImportError as e:
            raise Skip("no jax here (%s)" % e)
        self.jax, self.jnp = jax, jnp
        self.info["jax"] = jax.__version__
        try:
            import jaxlib
            self.info["jaxlib"] = jaxlib.__version__
        except Exception:
            pass

    def setup(self):
        jax, jnp = self.jax, self.jnp
        try:
            gpus = jax.devices("gpu")
        except RuntimeError as e:
            raise Skip("jax has no GPU backend (jax[cuda12] not installed?): %s" % e)
        dev = [d for d in gpus if getattr(d, "id", None) == self.a.device]
        if not dev:
            raise Skip("jax sees GPUs %s, no device %d" % ([d.id for d in gpus], self.a.device))
        self.dev = dev[0]
        jax.config.update("jax_enable_x64", True)
        self.acc = jax.device_put(jnp.zeros((), dtype=jnp.int64), self.dev)
        self.step = jax.jit(lambda acc, x, want: acc + jnp.sum(x != want, dtype=jnp.int64))
        f = getattr(jnp, "from_dlpack", None)
        self.from_dlpack = f if f is not None else jax.dlpack.from_dlpack

    def ctx(self):
        import contextlib
        return contextlib.nullcontext()

    def check(self, lease, want):
        jax = self.jax
        if not self.old_api:
            try:
                x = self.from_dlpack(lease)  # JAX's stream waits on the producer's event
            except TypeError:
                # A JAX that takes only capsules: it names no stream, so
                # wait on the host, then a capsule that waits on nothing.
                self.old_api = True
                self.info["jax_api"] = "capsule (host wait per batch)"
        if self.old_api:
            lease.synchronize()
            x = jax.dlpack.from_dlpack(lease.__dlpack__(stream=-1))
        try:
            p = x.unsafe_buffer_pointer()
        except Exception:
            p = None  # not told: left out of zero_copy
        if p is not None:
            self.views += 1
            if p != lease.ptr:
                self.copies += 1
        if x.dtype != self.jnp.uint8 or x.ndim != 1:
            x = x.view(self.jnp.uint8).reshape(-1)
        self.acc = self.step(self.acc, x, want)
        del x
        self.pending.append((lease, self.acc))
        while len(self.pending) > self.window:
            l, r = self.pending.popleft()
            r.block_until_ready()  # the check that read l is done
            l.release()

    def finish(self):
        while self.pending:
            l, r = self.pending.popleft()
            r.block_until_ready()
            l.release()
        return int(self.acc)

    def abort(self):
        try:
            self.acc.block_until_ready()
        except Exception:
            pass


class TorchCai(_NoHold):
    backend = "cuda"
    impl = "cudashare-python+torch-cai"

    def __init__(self, a):
        self.a = a
        self.views = 0
        self.copies = 0
        self.info = {}

    def load(self):
        try:
            import torch
        except ImportError as e:
            raise Skip("no torch here (%s)" % e)
        self.torch = torch
        self.info["torch"] = torch.__version__

    def setup(self):
        torch = self.torch
        if not torch.cuda.is_available():
            raise Skip("torch sees no GPU")
        self.dev = torch.device("cuda", self.a.device)
        torch.cuda.set_device(self.dev)
        self.stream = torch.cuda.Stream(self.dev)
        self.sp = self.stream.cuda_stream
        with torch.cuda.stream(self.stream):
            self.acc = torch.zeros((), dtype=torch.int64, device=self.dev)  # on stream: before the adds
        self.ev = torch.cuda.Event()
        self.cai_streams = {}  # CAI stream handle -> torch stream to record the event on

    def ctx(self):
        return self.torch.cuda.stream(self.stream)

    def _after(self, s):
        """Orders this consumer's stream after the CAI's stream s (on the GPU):
        torch does not (it reads no "stream" key)."""
        if s is None:
            return
        ts = self.cai_streams.get(s)
        if ts is None:
            torch = self.torch
            if s == 1:
                # cudaStreamLegacy: torch's default stream is the null
                # stream, which is the legacy one (torch is not built with
                # per-thread default streams); ExternalStream(1) would be
                # taken for one of torch's own stream ids.
                ts = torch.cuda.default_stream(self.dev)
                if ts.cuda_stream != 0:
                    raise RuntimeError("torch's default stream is %#x, not the null (legacy) stream" % ts.cuda_stream)
            else:
                ts = torch.cuda.ExternalStream(s, device=self.dev)
            self.cai_streams[s] = ts
        self.ev.record(ts)
        self.stream.wait_event(self.ev)

    def check(self, lease, want):
        torch = self.torch
        cai = lease.__cuda_array_interface__      # the legacy stream waits on the producer's event
        x = torch.as_tensor(lease, device=self.dev)  # CAI, no copy; torch ignores cai["stream"]
        self._after(cai["stream"])
        self.views += 1
        if x.data_ptr() != cai["data"][0]:
            self.copies += 1
        if x.dtype != torch.uint8 or x.dim() != 1:
            x = x.view(torch.uint8).reshape(-1)
        self.acc.add_((x != want).sum())
        del x
        lease.release(stream=self.sp)  # after the check queued on the stream: no host wait

    def finish(self):
        self.stream.synchronize()
        return int(self.acc.item())

    def abort(self):
        self.stream.synchronize()


def make(a):
    if a.framework == "cupy":
        return Cupy(a, "cai")
    if a.framework == "cupy-dlpack":
        return Cupy(a, a.dlpack)
    if a.framework == "jax":
        return Jax(a)
    if a.framework == "torch-cai":
        return TorchCai(a)
    return Host(a)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--framework", choices=FRAMEWORKS, required=True)
    ap.add_argument("--dlpack", choices=["both", "protocol", "capsule"], default="both",
                    help="cupy-dlpack: cupy.from_dlpack(lease), of a capsule, or alternating per batch")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--credits", type=int, default=8)
    ap.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the producer's socket")
    ap.add_argument("--batches", type=int, default=0, help="stop after this many (0: until the producer ends)")
    a = ap.parse_args()
    fw = make(a)
    rep = {"role": "consumer", "impl": fw.impl, "framework": a.framework, "device": a.device,
           "credits": a.credits, "workers": 1, "verify": a.framework + "-full", "handoffs": 0, "seconds": 0.0,
           "handoffs_per_s": 0.0, "verified": 0, "verify_errors": 0, "errors": 0, "mappings": 0, "exit": 0}
    if a.framework == "cupy-dlpack":
        rep["dlpack"] = a.dlpack
    try:
        fw.load()
    except Skip as e:
        rep["skipped"] = str(e)
        rep["exit"] = 3
        return out(rep, 3)
    try:
        import cudashare
    except ImportError as e:
        rep["skipped"] = "the cudashare package does not import (%s): is msgpack installed?" % e
        rep["exit"] = 3
        return out(rep, 3)
    try:
        fw.setup()
    except Skip as e:
        rep["skipped"] = str(e)
        rep.update(fw.info)
        rep["exit"] = 3
        return out(rep, 3)
    rep.update(fw.info)
    try:
        c = cudashare.connect(a.socket, device=a.device, credits=a.credits, backend=fw.backend, wait=a.wait,
                              handle_sigterm=True)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        rep.update(error="no producer at %s: %s" % (a.socket, e), exit=4)
        return out(rep, 4)
    except cudashare.NotSupported as e:
        if fw.backend == "cuda":
            # The framework saw a GPU: cudashare's own CUDA backend failing
            # there is a failure, not a skip.
            rep.update(error="the Python consumer's CUDA backend: %s" % e, exit=1)
            return out(rep, 1)
        rep["skipped"] = "no CUDA backend for the Python consumer: %s" % e
        rep["exit"] = 3
        return out(rep, 3)
    rep["driver"] = c.backend
    end = "producer said goodbye"
    lat = []
    n = 0
    t0 = t1 = None
    wrong = None
    st = {}
    try:
        with fw.ctx():
            while True:
                # A framework that releases from the host after its check
                # (JAX) holds leases: once no offer comes (the producer has
                # none left, or waits for those), they must go back.
                try:
                    lease = c.next(timeout=0.01) if fw.holds() else c.next()
                except cudashare.Timeout:
                    fw.drain()
                    continue
                except cudashare.Closed:
                    break
                now = time.monotonic_ns()
                if t0 is None:
                    t0 = now
                batch = batch_of(lease, now, rep, lat)
                if batch is None:
                    lease.release()
                    continue
                fw.check(lease, batch % 251 + 1)  # queues the check, releases the lease after it
                n += 1
                t1 = time.monotonic_ns()
                if a.batches and n >= a.batches:
                    end = "count"
                    break
        wrong = fw.finish()  # the one host sync (JAX: the last batches' checks)
    except cudashare.ProducerGone as e:
        end = "producer vanished"
        rep.update(error=str(e), exit=5)
    except cudashare.CudashareError as e:
        end = "error"
        rep.update(error="%s: %s" % (type(e).__name__, e), exit=1)
    except Exception as e:  # the framework's: shown, not a traceback without a report
        traceback.print_exc()
        end = "error"
        rep.update(error="%s: %s" % (type(e).__name__, e), exit=1)
    finally:
        if wrong is None:
            try:
                fw.abort()  # queued work done before close() unmaps
            except Exception:
                traceback.print_exc()
        st = c.stats()
        c.close()
    rep.update(fw.info)
    rep["end"] = end
    rep["handoffs"] = n
    rep["mappings"] = st.get("mappings", 0)
    rep["ordered_releases"] = st.get("ordered_releases")
    rep["zero_copy"] = "%d/%d" % (fw.views - fw.copies, fw.views)
    ok = wrong == 0 and not rep["verify_errors"]
    rep["check"] = "every byte of every batch (%s): %s wrong" % (a.framework, "?" if wrong is None else wrong)
    return finish(rep, n, ok, t0, t1, lat)


if __name__ == "__main__":
    sys.exit(main())
