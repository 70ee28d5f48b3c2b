"""The dtype and shape convention of PROTOCOL.md section 4.2."""

from ._errors import ViewError

# name: (itemsize, __cuda_array_interface__ typestr or None, DLPack (code, bits))
DTYPES = {
    "bool": (1, "|b1", (6, 8)),
    "int8": (1, "|i1", (0, 8)), "int16": (2, "<i2", (0, 16)),
    "int32": (4, "<i4", (0, 32)), "int64": (8, "<i8", (0, 64)),
    "uint8": (1, "|u1", (1, 8)), "uint16": (2, "<u2", (1, 16)),
    "uint32": (4, "<u4", (1, 32)), "uint64": (8, "<u8", (1, 64)),
    "float16": (2, "<f2", (2, 16)), "float32": (4, "<f4", (2, 32)),
    "float64": (8, "<f8", (2, 64)),
    "bfloat16": (2, None, (4, 16)),
    "complex64": (8, "<c8", (5, 64)), "complex128": (16, "<c16", (5, 128)),
}


def view_of(meta, size):
    """Returns (dtype name, shape tuple) for an offer of size bytes.

    Raises ViewError when the metadata does not describe the buffer: an
    unknown dtype, a shape that is not an array of non-negative integers,
    or one whose bytes exceed size. Metadata that is not a map, or lacks the
    keys, means a flat array of uint8.
    """
    m = meta if isinstance(meta, dict) else {}
    dtype = m.get("dtype", "uint8")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ViewError("offer dtype %r is not one of PROTOCOL.md section 4.2's: %s" % (dtype, ", ".join(DTYPES)))
    item = DTYPES[dtype][0]
    if "shape" not in m:
        return dtype, (size // item,)
    shape = m["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ViewError("offer shape %r is not an array of non-negative integers" % (shape,))
    if len(shape) > 32:
        raise ViewError("offer shape has %d dimensions, limit 32" % len(shape))
    n = item
    for d in shape:
        n *= d
    if n > size:
        raise ViewError("offer shape %r of %s is %d bytes, more than the %d bytes offered" % (shape, dtype, n, size))
    return dtype, tuple(shape)


def strides_of(shape, item):
    """C-order strides in bytes."""
    out = []
    s = item
    for d in reversed(shape):
        out.append(s)
        s *= max(d, 1)
    return tuple(reversed(out))
