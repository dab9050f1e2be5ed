"""One checkpoint loaded on every rank of a ``torch.distributed`` process group, its bytes read once.

Without a group each rank reads everything it returns, so N ranks of one node read a checkpoint N times
over (from a disk, a network filesystem or an object store).  With ``group=`` the ranks share the reads:

- **Agreement first.**  Every rank plans its load as usual (:mod:`mcf.loading.plan`), then the ranks
  exchange a small fingerprint with one ``all_gather``: each file's name, size, ETag and a digest of its
  header (names, dtypes, shapes, offsets), and a 16-byte digest of each piece of the plan.  Files that
  differ between ranks are refused on every rank (:class:`mcf.InvalidArgumentError`) before a byte of
  tensor data is read; so are copies of a file on one host whose modification times differ (on
  different hosts the copies of one checkpoint are compared by size and header, their times being when
  each was copied).
- **Shared pieces are read once.**  A piece every rank plans the same way (every tensor of a replicated
  load; the norms and biases of a tensor-parallel one) is read by one rank only: the shared pieces, in
  rank 0's order, are cut into N consecutive shares of about equal stored bytes (a tensor read straight
  into its result may be cut inside, on a 64 KiB boundary; a decoded one between its stages, which each
  name the elements they write, ``Stage.span``).  Every rank computes the same cut from the same
  exchanged plan.  A piece that differs between ranks (a rank's own shard) is read by its rank.
- **Failures are everyone's.**  A rank that fails while it opens or plans takes part in the exchange with
  its error instead; after the reads the ranks exchange a status flag before any broadcast.  Either way
  every rank raises (the failing one its own error, the others :class:`mcf.MCFIOError` naming it), and a
  rank that dies or hangs makes the group's collectives fail within the group's timeout, which every
  rank raises as :class:`mcf.MCFIOError`.
- **Then the shares are broadcast** from their readers, in place where a region is large (CPU groups:
  gloo) or packed into buckets of :data:`BUCKET_BYTES` (small regions, and every region on an NCCL group,
  whose buckets live on the rank's current CUDA device), a few broadcasts in flight, taken from the
  readers in turn so that every link carries data both ways.

:func:`group_load` is the entry: the loaders (:mod:`mcf.torch`) open and plan inside it, and hand the
plan and their allocation callback to :meth:`GroupLoad.load` in place of :func:`mcf.loading.plan.execute`.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import socket
import struct
from collections import deque
from typing import Callable

import numpy as np

from mcf._core.memory import allocating
from mcf._core.optional import require
from mcf.container.layout import SectionType
from mcf.container.reader import Container
from mcf.errors import ArgumentTypeError, InvalidArgumentError, MCFIOError
from mcf.gguf.reader import GGUFFile
from mcf.loading.dtypes import ELEMENTS
from mcf.loading.plan import Piece, execute

__all__ = ["GroupLoad", "group_load", "file_fingerprints", "assign", "BUCKET_BYTES"]

#: the largest single broadcast; small regions are packed into buckets of this size
BUCKET_BYTES = 32 << 20
#: on a CPU group, a region of at least this many bytes is broadcast from the result itself
IN_PLACE_FROM = 1 << 20
#: where a tensor read straight into its result may be cut between two ranks (bytes of the result)
CUT_ALIGN = 64 << 10
#: broadcasts in flight at once
WINDOW = 4

_BYTES = ELEMENTS["U8"]


@contextlib.contextmanager
def group_load(group, *, what: str = "load"):
    """Around a loader's opening and planning: yields None without a group, else a :class:`GroupLoad`.
    An exception raised inside before :meth:`GroupLoad.load` exchanged the plans is announced to the other
    ranks (which then raise :class:`mcf.MCFIOError`) and re-raised here."""
    if group is None:
        yield None
        return
    gl = GroupLoad(group, what=what)
    try:
        yield gl
    except Exception as exc:
        gl.abandon(exc)
        raise


class GroupLoad:
    """This rank's part in a load shared by the ranks of ``group`` (a ``torch.distributed`` process group of
    which this process is a member)."""

    def __init__(self, group, *, what: str = "load"):
        torch = require("torch", feature="group= (distributed loading)", extra="torch")
        dist = torch.distributed
        if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
            raise ArgumentTypeError(f"group must be a torch.distributed process group (such as "
                                    f"torch.distributed.group.WORLD after init_process_group), got "
                                    f"{type(group).__name__}")
        self.torch, self.dist, self.group, self.what = torch, dist, group, what
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise InvalidArgumentError("group=: this process is not a member of the group it was given")
        self.size = dist.get_world_size(group)
        self.exchanged = False
        backend = str(dist.get_backend(group))
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    # -- the collectives, every failure an MCFIOError ------------------------------------------------
    def _collective(self, fn, where: str):
        try:
            return fn()
        except RuntimeError as exc:   # torch.distributed's errors (DistBackendError, timeouts) are RuntimeErrors
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise MCFIOError(f"{where}: the ranks' {self.what} failed in the process group (rank {self.rank} of "
                             f"{self.size}): a rank died, hung past the group's timeout or could not be "
                             f"reached: {first}") from None

    def _gather(self, obj, where: str) -> list:
        out = [None] * self.size
        self._collective(lambda: self.dist.all_gather_object(out, obj, group=self.group), where)
        return out

    def abandon(self, exc: BaseException) -> None:
        """Tell the other ranks this one failed before the plans were exchanged (they are waiting in it)."""
        if self.exchanged:
            return
        self.exchanged = True
        with contextlib.suppress(MCFIOError):   # the group itself is gone: the others fail on their own
            self._gather({"error": _describe(exc)}, "group=")

    # -- the load ------------------------------------------------------------------------------------
    def load(self, pieces: list, alloc: Callable, *, weights, threads=None, chunk_bytes=None,
             fresh: bool = True) -> dict:
        """``name -> result`` for ``pieces``, as :func:`mcf.loading.plan.execute` returns it (``alloc`` and
        ``fresh`` as there: ``fresh=False`` when ``alloc`` hands out memory that exists already, the
        caller's own tensors of :mod:`mcf.loaders.into`), every shared piece read by one rank of the group
        and broadcast to the others.  ``weights``: the open :class:`mcf.loaders.weights.Weights` (or
        :class:`mcf.loaders.gguf_weights.GGUFWeights`) the pieces come from (its files are compared between
        ranks)."""
        where = weights.where
        keys = [piece_key(p) for p in pieces]
        mine = {"host": socket.gethostname(), "files": file_fingerprints(weights), "keys": b"".join(keys)}
        self.exchanged = True
        every = self._gather(mine, where)
        _check_agreement(every, where)
        if self.size == 1:
            return execute(pieces, alloc, threads=threads, chunk_bytes=chunk_bytes, fresh=fresh)
        by_key = dict(zip(keys, pieces))
        common = set(keys)
        for m in every:
            ks = m["keys"]
            common &= {ks[i:i + 16] for i in range(0, len(ks), 16)}
        first = every[0]["keys"]
        shared = [by_key[k] for k in (first[i:i + 16] for i in range(0, len(first), 16)) if k in common]
        shares = assign(shared, self.size)
        transfers = _transfers(shares, self.device.type == "cpu")
        shared_names = {p.name for p in shared}
        local = [p for p in pieces if p.name not in shared_names]

        results, outs, flats, error = {}, {}, {}, None
        try:
            total = 0
            for p in pieces:   # the whole result on every rank, each piece allocated as the caller does it
                nbytes = _nbytes(p)
                total += nbytes
                with allocating(nbytes, p.source.name, p.name, total=total) if fresh else contextlib.nullcontext():
                    results[p.name], outs[p.name] = alloc(p)
                flats[p.name] = np.asarray(outs[p.name]).reshape(-1).view(np.uint8)
            buckets = self._buckets(transfers, where)   # a refused allocation is told to every rank too
            plan, buffers = _share_plan(shares[self.rank], outs, flats)
            for p in local:
                plan.append(p)
                buffers[p.name] = (results[p.name], outs[p.name])
            # every result exists by now: the share's pieces are read into it
            execute(plan, lambda sp: buffers[sp.name], threads=threads, chunk_bytes=chunk_bytes, fresh=False)
        except Exception as exc:   # told to every rank before anything is broadcast
            error = exc
        status = self._gather(None if error is None else _describe(error), where)
        if error is not None:
            raise error
        failed = [(r, s) for r, s in enumerate(status) if s is not None]
        if failed:
            r, s = failed[0]
            raise MCFIOError(f"{where}: rank {r} of the group could not read its share ({s})"
                             + (f"; {len(failed) - 1} other rank(s) failed too" if len(failed) > 1 else ""))
        self._broadcast(transfers, buckets, flats, where)
        return {p.name: results[p.name] for p in pieces}

    def _buckets(self, transfers: list, where: str) -> list:
        """The staging buckets of the packed transfers, one per broadcast in flight (on the group's device)."""
        packed = [sum(hi - lo for _, lo, hi in tr) for _, tr, in_place in transfers if not in_place]
        if not packed:
            return []
        nbytes, count = max(packed), min(WINDOW, len(packed))
        if self.device.type != "cpu":   # torch's CUDA allocator refuses with its own error, exchanged as any
            return [self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device) for _ in range(count)]
        with allocating(nbytes * count, where, None, what="the broadcast buckets"):
            return [self.torch.empty(nbytes, dtype=self.torch.uint8) for _ in range(count)]

    def _broadcast(self, transfers: list, buckets: list, flats: dict, where: str) -> None:
        torch, dist = self.torch, self.dist
        pending = deque()
        packed = 0

        def finish(item):
            work, src, tr, bucket = item
            self._collective(work.wait, where)
            if bucket is not None and src != self.rank:
                _unpack(tr, bucket, flats)

        def run():
            nonlocal packed
            for src, tr, in_place in transfers:
                if len(pending) == WINDOW:
                    finish(pending.popleft())
                if in_place:
                    name, lo, hi = tr[0]
                    tensor, bucket = torch.from_numpy(flats[name][lo:hi]), None
                else:   # the bucket of the transfer WINDOW before, which finish() has waited for
                    bucket = buckets[packed % len(buckets)][:sum(hi - lo for _, lo, hi in tr)]
                    packed += 1
                    if src == self.rank:
                        _pack(tr, bucket, flats, torch)
                    tensor = bucket
                work = dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group,
                                      async_op=True)
                pending.append((work, src, tr, bucket))
            while pending:
                finish(pending.popleft())

        self._collective(run, where)


def _nbytes(p: Piece) -> int:
    return -(-math.prod(p.shape) * p.element.bits // 8)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# -- what the ranks compare -------------------------------------------------------------------------------
def _file_name(source) -> str:
    return os.path.basename(str(source.name).split("?")[0].rstrip("/")) or str(source.name)


def file_fingerprints(weights) -> list:
    """``[{name, size, version, header}]`` for each file of an open :class:`mcf.loaders.weights.Weights`:
    its base name (ranks may hold copies in different directories), size, :attr:`mcf.io.Source.version` and
    a digest of what says where its tensors are (a safetensors file's header; an MCF file's section
    directory, tensor index and quantization records; a GGUF file's header, metadata and tensor infos),
    re-read from the file (a URL's from its block cache)."""
    out = []
    obj = weights.obj
    if isinstance(obj, GGUFFile):
        src = obj.source
        files = [(src, hashlib.blake2b(src.read(0, min(obj.data_offset, src.size)), digest_size=16).hexdigest())]
    elif isinstance(obj, Container):
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((obj.header, obj.sections)).encode())
        for t in (SectionType.TENSOR_INDEX, SectionType.QUANT_INFO):
            h.update(obj.section_bytes(t) or b"")
        files = [(obj.source, h.hexdigest())]
    else:
        files = []
        for f in obj.files:
            src = f.source
            (hlen,) = struct.unpack("<Q", src.read(0, 8))
            files.append((src, hashlib.blake2b(src.read(0, 8 + hlen), digest_size=16).hexdigest()))
    for src, header in files:
        out.append({"name": _file_name(src), "size": src.size, "version": src.version, "header": header})
    return out


def piece_key(p: Piece) -> bytes:
    """16 bytes that are equal for two ranks' pieces exactly when they read the same bytes of the same
    (base-named) files into the same result."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((p.name, tuple(p.shape), p.element.name, p.size, _file_name(p.source),
                   p.stages is None)).encode())
    if p.stages is None:
        h.update(np.asarray(p.offsets, np.int64).tobytes())
    else:
        for st in p.stages:
            h.update(repr((st.nbytes, st.span,
                           None if st.sources is None else [_file_name(s) for s in st.sources])).encode())
            for a in (st.offsets, st.sizes, st.dst):
                if a is not None:
                    h.update(np.asarray(a, np.int64).tobytes())
    return h.digest()


def _check_agreement(every: list, where: str) -> None:
    """Raise on every rank alike (each sees the same ``every``): a rank's failure, or files that differ."""
    failed = [(r, m["error"]) for r, m in enumerate(every) if "error" in m]   # (never this rank: it re-raises)
    if failed:
        r, why = failed[0]
        raise MCFIOError(f"{where}: rank {r} of the group could not open or plan the load ({why})"
                         + (f"; {len(failed) - 1} other rank(s) failed too" if len(failed) > 1 else ""))
    ref = every[0]
    for r, m in enumerate(every[1:], 1):
        names = [f["name"] for f in m["files"]]
        if names != [f["name"] for f in ref["files"]]:
            raise InvalidArgumentError(f"{where}: the ranks of the group load different files: rank 0 opened "
                                       f"{[f['name'] for f in ref['files']]}, rank {r} {names}")
        for a, b in zip(ref["files"], m["files"]):
            for field, label in (("size", "a size of"), ("header", "a header digest")):
                if a[field] != b[field]:
                    raise InvalidArgumentError(f"{where}: {a['name']} differs between ranks: rank 0 sees {label} "
                                               f"{a[field]}, rank {r} {b[field]}; every rank must load the same "
                                               "checkpoint")
            va, vb = a["version"] or {}, b["version"] or {}
            if va.get("etag") != vb.get("etag"):
                raise InvalidArgumentError(f"{where}: {a['name']} differs between ranks: rank 0 read ETag "
                                           f"{va.get('etag')}, rank {r} {vb.get('etag')} (the object changed "
                                           "between their openings?)")
    for r, m in enumerate(every):   # copies on one host: the same file, or equally old ones
        for q in range(r):
            if every[q]["host"] != m["host"]:
                continue
            for a, b in zip(every[q]["files"], m["files"]):
                va, vb = a["version"] or {}, b["version"] or {}
                same_file = (va.get("device"), va.get("inode")) == (vb.get("device"), vb.get("inode"))
                if not same_file and va.get("mtime_ns") != vb.get("mtime_ns"):
                    raise InvalidArgumentError(
                        f"{where}: ranks {q} and {r} on host {m['host']} read different copies of {a['name']} "
                        f"modified at different times ({va.get('mtime_ns')} and {vb.get('mtime_ns')} ns); point "
                        "every rank of a host at the same file")


# -- who reads what -------------------------------------------------------------------------------------
def _units(shared: list) -> list:
    """``(piece, weight, kind, a, b, stages)`` in plan order: ``"cut"`` units (bytes ``a..b`` of a result read
    straight into it: cuttable), ``"stage"`` units (one stage, writing result bytes ``a..b``) and ``"whole"``
    units (a decoded piece whose stages do not say what they write)."""
    out = []
    for p in shared:
        if p.stages is None:
            n = len(p.offsets) * p.size
            if n:
                out.append((p, n, "cut", 0, n, None))
        elif p.stages and all(st.span is not None for st in p.stages):
            isz = p.element.bits // 8
            for st in p.stages:
                out.append((p, int(np.asarray(st.sizes).sum()), "stage", st.span[0] * isz,
                            (st.span[0] + st.span[1]) * isz, [st]))
        elif p.stages:
            out.append((p, sum(int(np.asarray(st.sizes).sum()) for st in p.stages), "whole", 0, _nbytes(p),
                        list(p.stages)))
    return out


def assign(shared: list, n: int) -> list:
    """The shares of ``n`` ranks: for each, ``[(piece, kind, a, b, stages)]``, about ``1/n`` of the stored
    bytes of ``shared`` each, consecutive in plan order.  Deterministic: every rank computes the same."""
    units = _units(shared)
    total = sum(u[1] for u in units)
    bounds = [total * r // n for r in range(n + 1)]
    shares = [[] for _ in range(n)]
    pos = 0
    for p, w, kind, a, b, stages in units:
        if kind == "cut":   # bytes a..b (= 0..w) of the result, cut where the ranks' bounds fall
            cuts = [0]
            for r in range(1, n):
                c = min(max(bounds[r] - pos, 0), w)
                if 0 < c < w:
                    c -= c % CUT_ALIGN
                cuts.append(max(c, cuts[-1]))
            cuts.append(w)
            for r in range(n):
                if cuts[r + 1] > cuts[r]:
                    shares[r].append((p, kind, cuts[r], cuts[r + 1], None))
        else:   # to the rank whose bytes hold the unit's middle
            mid = 2 * pos + w
            r = next(r for r in range(n) if 2 * bounds[r] <= mid < 2 * bounds[r + 1]) if mid < 2 * total else n - 1
            shares[r].append((p, kind, a, b, stages))
        pos += w
    return shares


def _share_plan(share: list, outs: dict, flats: dict):
    """Pieces :func:`mcf.loading.plan.execute` reads this rank's share with, and ``name -> (None, out)`` for
    its ``alloc``: byte pieces over the result's bytes for cut units, the stages of decoded ones."""
    plan, buffers = [], {}
    staged = {}
    for k, (p, kind, lo, hi, stages) in enumerate(share):
        if kind != "cut":
            staged.setdefault(p.name, (p, []))[1].extend(stages)
            continue
        for i, (offs, size, start) in enumerate(_cut_ranges(np.asarray(p.offsets, np.int64), p.size, lo, hi)):
            name = f"{p.name}\x00{k}.{i}"
            nbytes = offs.shape[0] * size
            plan.append(Piece(name, p.source, (nbytes,), _BYTES, offs, size))
            buffers[name] = (None, flats[p.name][start:start + nbytes])
    for name, (p, stages) in staged.items():
        sub = f"{name}\x00stages"
        plan.append(Piece(sub, p.source, p.shape, p.element, stages=stages))
        buffers[sub] = (None, outs[name])
    return plan, buffers


def _cut_ranges(offsets: np.ndarray, size: int, lo: int, hi: int) -> list:
    """Bytes ``lo..hi`` of a result that ranges of ``size`` bytes at ``offsets`` fill in order, as
    ``[(file offsets, range size, result start)]``: a partial first range, whole ones, a partial last one."""
    parts = []
    j, pos = lo // size, lo
    if lo % size:
        end = min(hi, (j + 1) * size)
        parts.append((offsets[j:j + 1] + lo % size, end - lo, lo))
        j, pos = j + 1, end
    k = hi // size
    if pos < hi and k > j:
        parts.append((offsets[j:k], size, j * size))
        pos = k * size
    if pos < hi:
        parts.append((offsets[k:k + 1], hi - pos, pos))
    return parts


# -- the broadcasts -------------------------------------------------------------------------------------
def _transfers(shares: list, in_place_ok: bool) -> list:
    """``(src, [(name, lo, hi)], in_place)`` in the order every rank issues them: each rank's regions cut to
    :data:`BUCKET_BYTES`, small ones packed together, the ranks' turns interleaved."""
    per_src = []
    for src, share in enumerate(shares):
        out, bucket, held = [], [], 0
        for p, _, lo, hi, _ in share:
            for a in range(lo, hi, BUCKET_BYTES):
                b = min(hi, a + BUCKET_BYTES)
                if in_place_ok and b - a >= IN_PLACE_FROM:
                    out.append((src, [(p.name, a, b)], True))
                    continue
                if held + b - a > BUCKET_BYTES:
                    out.append((src, bucket, False))
                    bucket, held = [], 0
                bucket.append((p.name, a, b))
                held += b - a
        if bucket:
            out.append((src, bucket, False))
        per_src.append(out)
    order = []
    for i in range(max((len(t) for t in per_src), default=0)):
        order.extend(t[i] for t in per_src if i < len(t))
    return order


def _pack(regions, bucket, flats, torch) -> None:
    pos = 0
    for name, lo, hi in regions:
        bucket[pos:pos + hi - lo].copy_(torch.from_numpy(flats[name][lo:hi]))
        pos += hi - lo


def _unpack(regions, bucket, flats) -> None:
    data = bucket.cpu().numpy()
    pos = 0
    for name, lo, hi in regions:
        flats[name][lo:hi] = data[pos:pos + hi - lo]
        pos += hi - lo
