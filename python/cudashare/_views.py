"""Lease.array's views: what keeps a lease alive while a framework's cached
view of it may be in use (a Pin in the view's DLPack slot), how a lease the
application dropped with its view is found (orphans), and the object a
framework's from_dlpack takes (Capsule). Split out of _lease.py by idea."""

import sys

MAX_VIEWS = 64          # framework views that array() keeps per allocation (ranges x dtypes x shapes x converters)
MAX_VIEWS_TOTAL = 1024  # and per consumer, over all its allocations


class Pin:
    """What the DLPack slot of array()'s view keeps alive: the lease the
    view was last handed to, until that lease's release (a cached view), or
    for as long as the view lives (one not cached, as __dlpack__'s). key:
    the view's in its allocation's cache."""

    __slots__ = ("lease", "key")

    def __init__(self, lease, key):
        self.lease = lease
        self.key = key


def unpin(lease, pins):
    """Undoes Lease._pin for every pin of a released lease."""
    if type(pins) is list:
        for p in pins:
            if p.lease is lease:
                p.lease = None
    elif pins.lease is lease:
        pins.lease = None


def address_of(v):
    """The address of a framework's array, or None if it does not say:
    torch's data_ptr(), the CUDA array interface (CuPy, Numba), the array
    interface (NumPy)."""
    try:
        return int(v.data_ptr())
    except Exception:
        pass
    for name in ("__cuda_array_interface__", "__array_interface__"):
        try:
            return int(getattr(v, name)["data"][0])
        except Exception:
            pass
    return None


def _refs(o):
    return sys.getrefcount(o)


def _calibrate():
    o = Pin(None, None)  # held by o, here,
    keep = [o]            # and by keep: two holders
    n = _refs(o) - 2
    del keep
    return n


# What _refs counts beyond an object's holders (its argument, the frame):
# measured, not assumed, as interpreters differ (3.14 borrows references).
_EXTRA = _calibrate()


def orphans(outstanding):
    """The leases among outstanding (seq -> weakref) that nothing but
    their pins references, and whose cached views nothing but the cache
    does: leases the application dropped without release, which the
    garbage collector cannot reach (the pins are held by DLPack slots, a
    module global). The caller holds the consumer's lock."""
    out = []
    for ref in list(outstanding.values()):
        l = ref()
        if l is None or l._pins is None or l.released:
            continue
        # Its pins that still name it (another lease of the same range may
        # have taken one since), each once.
        ps = []
        for p in (l._pins if type(l._pins) is list else (l._pins,)):
            if p.lease is l and not any(q is p for q in ps):
                ps.append(p)
        # Held by each of those and by l here: anyone else is a user.
        if not ps or _refs(l) - _EXTRA > len(ps) + 1:
            continue
        views = l._a.views
        if views is None:
            continue
        for p in ps:
            ent = views.get(p.key)
            if ent is None or ent[1] is not p:
                break
            v = ent[0]
            # Held by its cache entry and by v here.
            if _refs(v) - _EXTRA > 2:
                break
        else:
            out.append(l)
        v = ent = None
    return out


class Capsule:
    """One capsule, handed to a framework's from_dlpack by the DLPack
    protocol (torch, CuPy and JAX take an object with __dlpack__, not all
    a bare capsule). The stream the framework names waits on the producer's
    event too, as Lease.__dlpack__'s does."""

    __slots__ = ("_cap", "_dev", "_lease")

    def __init__(self, cap, dev, lease):
        self._cap = cap
        self._dev = dev
        self._lease = lease

    def __dlpack__(self, stream=None, **_kw):
        cap, self._cap = self._cap, None
        if cap is None:
            raise BufferError("cudashare: this capsule was taken already")
        if stream is not None:
            self._lease._order(stream)
        return cap

    def __dlpack_device__(self):
        return self._dev
