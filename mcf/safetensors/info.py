"""What ``mcf info`` shows of a safetensors checkpoint (a file, a sharded directory or its index, or a URL):
the shards, the ``__metadata__`` of each, how many tensors of each dtype, and the tensor table with each
tensor's shard, dtype, shape, size and offset.  The loaders read these checkpoints as they read MCF files,
so the command that describes one describes the other.

Names and metadata come from whoever wrote the file: the text report prints them through
:func:`mcf._core.console.printable`, the JSON one through ``json_text`` (escape sequences shown, not run).
"""

from __future__ import annotations

import sys
from collections import Counter

from mcf._core.console import human, printable, write_tensor_table
from mcf.safetensors.reader import Checkpoint

__all__ = ["info_dict", "print_info"]


def info_dict(ckpt: Checkpoint) -> dict:
    shard_of = {id(f): i for i, f in enumerate(ckpt.files)}
    tensors = [ckpt.tensors[n] for n in ckpt.storage_order()]
    return {
        "format": "safetensors",
        "index": ckpt.index,
        "shards": [{"file": f.source.name, "size": f.source.size, "tensors": len(f.tensors),
                    "metadata": dict(f.metadata)} for f in ckpt.files],
        "dtypes": dict(Counter(t.element.name for t in tensors)),
        "total_bytes": sum(t.nbytes for t in tensors),
        "tensors": [{"name": t.name, "dtype": t.element.name, "shape": list(t.shape), "size": t.nbytes,
                     "offset": t.offset, "shard": shard_of[id(t.file)]} for t in tensors],
    }


def print_info(ckpt: Checkpoint, *, out=None) -> None:
    w = (out or sys.stdout).write
    d = info_dict(ckpt)
    n = len(d["shards"])
    where = f"index {printable(d['index'])}, " if d["index"] else ""
    w(f"safetensors checkpoint: {where}{_count(n, 'file')}, {_count(len(d['tensors']), 'tensor')}, "
      f"{human(d['total_bytes'])} of tensor data\n")
    for i, s in enumerate(d["shards"]):
        w(f"  [{i}] {printable(s['file'])}: {human(s['size'])} ({s['size']} bytes), {_count(s['tensors'], 'tensor')}\n")
        for k, v in s["metadata"].items():
            w(f"      {printable(k)}: {printable(v if len(v) <= 120 else v[:117] + '...')}\n")
    dtypes = ", ".join(f"{k} x {c}" for k, c in sorted(d["dtypes"].items(), key=lambda kv: (-kv[1], kv[0])))
    w(f"\ndtypes: {dtypes or 'none'}\n")
    shard = n > 1
    write_tensor_table(w, d["tensors"], "dtype", 7, totals=False, head=" shard" if shard else "",
                       tail=(lambda t: f"  [{t['shard']}]") if shard else None)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"
