"""``threads=`` of every compiled function that takes it: one rule (mcf/_core/_kernel_args.pxd), the same bytes
on any number of threads.

The rule: a Python or numpy integer, a value below 1 meaning one thread; a float (even 2.0), a bool, None or a
string is :class:`mcf.InvalidArgumentError`, never truncated.  The copies this replaced had drifted: the GGUF
decoder took ``threads=2.7`` as 2, MegaContext's assembly raised a bare TypeError for it.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib

import numpy as np
import pytest

import mcf
import mcf.megacontext as mc
from mcf._core import _kernels, _mx
from mcf._core.dtypes import parse_dtype
from mcf._core.scaled import scaled_layout
from mcf.gguf import _gguf
from mcf.megacontext import _megacontext

pytestmark = pytest.mark.forced_variants  # .ci/run runs this file once per forced kernel variant

PKG = pathlib.Path(mcf.__file__).parent
GOOD = [1, 2, 3, np.int64(2), np.uint8(2), np.intp(4), 64, 0, -3]   # below 1: one thread
BAD = [2.7, 2.0, np.float64(2.0), True, False, np.bool_(True), None, "2", 2 + 0j]


def _kernels_dequantize(ctx, threads):
    rng = np.random.default_rng(1)
    payload = mcf.quantize(rng.standard_normal((37, 333)).astype(np.float32), "k4")[0]
    return _kernels.dequantize(payload, parse_dtype("k4").code, 37, 333, threads=threads).tobytes()


def _mx_dequantize(ctx, threads):
    shape = (64, 64)
    lay = scaled_layout(parse_dtype("mxfp4"), shape)
    payload = np.random.default_rng(2).integers(0, 256, lay.nbytes, dtype=np.uint8)
    _, off, size, _, _ = lay.region("scales")
    payload[off:off + size] = np.arange(120, 120 + size) % 16 + 120     # E8M0 scales 2**-7 .. 2**8, no NaN
    return _mx.dequantize(payload, "mxfp4", shape, threads=threads).tobytes()


def _gguf_dequantize_blocks(ctx, threads):
    nb = 80                                             # Q8_0: f16 scale + 32 int8 codes per block
    blocks = np.random.default_rng(3).integers(0, 256, (nb, 34), dtype=np.uint8)
    blocks[:, :2] = np.full(nb, 0.25, np.float16).view(np.uint8).reshape(nb, 2)
    out = np.empty(nb * 32, np.float32)
    return _gguf.dequantize_blocks(blocks, 8, nb, out, threads=threads).tobytes()


def _megacontext_assemble(ctx, threads):
    t = ctx["tree"]
    n0, n1, n2 = t.counts
    plan = mc.plan_tail(t, 12, 4)
    srcs = (t.level_source(0, n0), t.level_source(1, n1), None)
    res = _megacontext.assemble(srcs, (n0, n1, n2), t.block_size, t.embedding_dim,
                                (t.gist_dtype_of(1).code, t.gist_dtype_of(2).code), plan.levels, plan.indices,
                                table=ctx["table"], threads=threads)
    return b"".join(a.tobytes() for a in res if a is not None)


_PAGE_KEYS = [f"k{i}" for i in range(5)]


def _pages(ctx, threads, write: bool) -> bytes:
    """A batch of the pages area with ``threads`` handed to the compiled call as given (the store's own
    argument check bypassed): the bytes read back, and each page's answer."""
    store = ctx["pages"]
    store.threads = threads
    try:
        if write:
            datas = [bytes([i]) * (1000 + 4096 * i) for i in range(len(_PAGE_KEYS))]
            ok = store.put_many(_PAGE_KEYS, datas, replace=True)
        else:
            ok = []
        outs = [bytearray(1000 + 4096 * i) for i in range(len(_PAGE_KEYS))]
        store.threads = 1 if write else threads
        ok += store.get_many_into(_PAGE_KEYS, outs)
    finally:
        store.threads = 1
    return bytes(ok) + b"".join(outs)


# (compiled module, function) -> a call with the given threads= returning the bytes it produced
CALLS = {
    ("mcf.bucket._pageio", "read_pages"): lambda ctx, threads: _pages(ctx, threads, False),
    ("mcf.bucket._pageio", "write_pages"): lambda ctx, threads: _pages(ctx, threads, True),
    ("mcf._core._kernels", "dequantize"): _kernels_dequantize,
    ("mcf._core._mx", "dequantize"): _mx_dequantize,
    ("mcf.gguf._gguf", "dequantize_blocks"): _gguf_dequantize_blocks,
    ("mcf.megacontext._megacontext", "assemble"): _megacontext_assemble,
}

# threads= that is not a kernel split: the read engine's workers, where None means the storage kind's default
# (mcf._core.storage) and the count is capped (mcf._core._io checks both)
READ_ENGINE = {("mcf._core._io", "Source.read_into"), ("mcf._core._io", "Source.read_ranges")}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    path = tmp_path_factory.mktemp("threads") / "tree"
    rng = np.random.default_rng(4)
    t = mc.create(path, embedding_dim=8, block_size=4, gist_dtype="fp32", vocab_size=50)
    t.append_tokens(rng.integers(0, 50, 4 * 12, dtype=np.uint32))
    t.append_gists(1, rng.standard_normal((12, 8)).astype(np.float32))
    from mcf.bucket.pages import PageStore

    pages = PageStore(tmp_path_factory.mktemp("pages"), "ns", threads=1)
    pages.put_many(_PAGE_KEYS, [bytes([i]) * (1000 + 4096 * i) for i in range(len(_PAGE_KEYS))])
    yield {"tree": t, "table": rng.standard_normal((50, 8)).astype(np.float32), "pages": pages}
    pages.close()
    t.close()


def _functions_with_threads():
    """(module, name) of every function or method of a compiled module (mcf/**/_*.pyx) with a threads= parameter."""
    found = set()
    for pyx in sorted(PKG.rglob("_*.pyx")):
        name = ".".join(pyx.relative_to(PKG.parent).with_suffix("").parts)
        mod = importlib.import_module(name)
        members = [(n, f) for n, f in vars(mod).items() if callable(f) and getattr(f, "__module__", None) == name]
        members += [(f"{c}.{n}", f) for c, cls in vars(mod).items() if inspect.isclass(cls)
                    and cls.__module__ == name for n, f in vars(cls).items() if callable(f)]
        for qual, f in members:
            try:
                params = inspect.signature(f).parameters
            except (TypeError, ValueError):   # no signature to read (a builtin slot wrapper)
                continue
            if "threads" in params:
                found.add((name, qual))
    return found


def test_every_compiled_function_with_threads_is_checked_here():
    assert _functions_with_threads() - READ_ENGINE == set(CALLS)


@pytest.mark.parametrize("where", sorted(CALLS), ids=lambda w: f"{w[0]}.{w[1]}")
def test_threads_refuses_non_integers_and_gives_the_bytes_of_one_thread(where, ctx):
    call = CALLS[where]
    one = call(ctx, 1)
    for good in GOOD:
        assert call(ctx, good) == one, good
    for bad in BAD:
        with pytest.raises(mcf.InvalidArgumentError, match="threads must be an integer"):
            call(ctx, bad)
