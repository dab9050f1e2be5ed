# Buffer intake, the same for every compiled module: what a kernel reads from and writes into.
# Inline, so each .pyx that cimports it compiles its own copy of these few lines (no extra module).

cdef inline object flat_bytes(object src):
    """``src`` (bytes, memoryview, any numpy array) as a flat C-contiguous uint8 array: a view when it
    already is one, a copy only when it is not contiguous."""
    import numpy as np

    a = np.asarray(src)
    if a.dtype != np.uint8 or a.ndim != 1 or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return a


cdef inline int check_out(object out, str what) except -1:
    """Raise mcf.InvalidArgumentError unless ``out`` is a writeable C-contiguous numpy array, the only
    kind of destination a kernel writes into (sizes and dtypes are each caller's own check)."""
    import numpy as np

    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
        from mcf.errors import InvalidArgumentError

        raise InvalidArgumentError(f"{what} must be a writeable C-contiguous numpy array")
    return 0
