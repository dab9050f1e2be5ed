"""Plain-numpy / plain-struct references for the MegaContext tests, written from the seeds and
FORMATS.md section 3 without using mcf.megacontext's own code."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np

HEADER = 64
MAGIC_LE = bytes([0x54, 0x43, 0x43, 0x4D])
GIST_NP = {1: np.dtype("<f2"), 2: np.dtype(ml_dtypes.bfloat16), 3: np.dtype("<f4")}


def canonical_header(level, block_size, dim, code, count, name=b"", magic=MAGIC_LE) -> bytes:
    """Seed 000: magic | version | level | block_size | embedding_dim | dtype_code | u64 count @14 |
    char[32] model_name @22 | 10 reserved @54."""
    return magic + struct.pack("<HHHHHQ", 1, level, block_size, dim, code, count) + name.ljust(32, b"\0") + bytes(10)


def legacy_header(level, block_size, dim, code, name=b"", magic=MAGIC_LE) -> bytes:
    """Seed 001: magic | version | level | block_size | embedding_dim | dtype_code | char[32] model_name
    @14 | 18 reserved @46 (no count)."""
    return magic + struct.pack("<HHHHH", 1, level, block_size, dim, code) + name.ljust(32, b"\0") + bytes(18)


def write_tree_files(dirpath, tokens, lod1, lod2, *, block_size=32, dim=None, code=1, name=b"ref",
                     legacy=False, magic=MAGIC_LE):
    """Write LOD0/1/2.ctx with struct + numpy only (no metadata.json)."""
    import os

    dim = dim if dim is not None else lod1.shape[1]
    for level, data in ((0, np.asarray(tokens, "<u4")), (1, lod1), (2, lod2)):
        c = 0 if level == 0 else code
        n = data.shape[0]
        h = (legacy_header(level, block_size, dim, c, name, magic) if legacy
             else canonical_header(level, block_size, dim, c, n, name, magic))
        with open(os.path.join(dirpath, f"LOD{level}.ctx"), "wb") as f:
            f.write(h + np.ascontiguousarray(data).tobytes())


def mean_pool(rows, group, out_dtype) -> np.ndarray:
    """Mean of each group of rows: float64 sums in row order, divided, rounded to float32, then to
    out_dtype (round to nearest even via numpy / ml_dtypes)."""
    r = np.asarray(rows).astype(np.float64)
    g = r.reshape(-1, group, r.shape[-1])
    acc = np.zeros((g.shape[0], g.shape[2]), np.float64)
    for i in range(group):          # explicit row order, independent of numpy's reduction order
        acc += g[:, i, :]
    return (acc / group).astype(np.float32).astype(out_dtype)


def numpy_assembly(tokens, lod1, lod2, plan, block_size, table=None, out_dtype=None):
    """(levels, positions, token_ids, gists, matrix) of a plan, with numpy indexing."""
    levels, positions, ids, gists, mat = [], [], [], [], []
    t = len(tokens)
    for level, index in plan:
        if level == 0:
            blk = np.asarray(tokens[index * block_size:min(t, (index + 1) * block_size)], np.uint32)
            for r, tok in enumerate(blk):
                levels.append(0)
                positions.append(index * block_size + r)
                ids.append(tok)
                if table is not None:
                    mat.append(np.asarray(table[tok]).astype(np.float32))
        else:
            row = (lod1 if level == 1 else lod2)[index]
            levels.append(level)
            positions.append(index * block_size ** level)
            gists.append(row)
            if table is not None:
                mat.append(np.asarray(row).astype(np.float32))
    d = lod1.shape[1]
    matrix = None
    if table is not None:
        odt = np.dtype(out_dtype) if out_dtype is not None else np.asarray(table).dtype
        matrix = np.stack(mat).astype(odt) if mat else np.empty((0, d), odt)
    g = np.stack(gists) if gists else np.empty((0, d), lod1.dtype)
    return (np.array(levels, np.uint8), np.array(positions, np.int64), np.array(ids, np.uint32), g, matrix)


def token_stream(n, seed=0, vocab=50000) -> np.ndarray:
    """A deterministic token stream: position i always holds the same id for a given seed."""
    i = np.arange(n, dtype=np.uint64)
    x = (i * np.uint64(2654435761) + np.uint64(seed * 97 + 13)) % np.uint64(vocab)
    return x.astype(np.uint32)


def token_stream_at(start, n, seed=0, vocab=50000) -> np.ndarray:
    """Positions [start, start+n) of :func:`token_stream`."""
    i = np.arange(start, start + n, dtype=np.uint64)
    x = (i * np.uint64(2654435761) + np.uint64(seed * 97 + 13)) % np.uint64(vocab)
    return x.astype(np.uint32)


def gist_rows(level, start, stop, d, version=1) -> np.ndarray:
    """Deterministic gist rows: exact in fp16 (multiples of 1/8 below 13); version 2 negates them."""
    i = np.arange(start, stop, dtype=np.int64)[:, None]
    v = ((i * 37 + level * 11 + np.arange(d)[None, :]) % 101).astype(np.float32) / 8
    return (v if version == 1 else -v - 1).astype(np.float16)
