#!/usr/bin/env python
"""Crash consistency: a writer process is killed with SIGKILL at a random moment, then the files it was
writing are checked.  Long runs of every writer, and the harness behind ``tests/test_crash_writers.py``.

    python fuzz/kill_at_random.py --writer mcf --runs 300          # nice -n 19 for long runs
    python fuzz/kill_at_random.py --writer all --runs 50 --seed 7
    python fuzz/kill_at_random.py --list

Each run starts a child (this file with ``--child``) that writes *generations* in a loop: generation
``g`` is fully determined by ``g`` (its bytes are known in advance), so after the kill the parent can say
exactly what a reader may find.  The child prints ``ready`` once imported and ``done g`` after each
generation is published; the parent sleeps a random time drawn from a seeded generator (so a failing
run is reproducible), sends SIGKILL and checks the invariant of the writer:

``mcf``, ``pack``, ``quantize``
    The destination is either the last published generation or the one being written, byte for byte
    (never a mix, never a truncated file); it opens and verifies.  Nothing else is visible except
    hidden temporary files ``.<name>.<pid>.<random>.tmp`` of the killed process (counted, then removed:
    no reader ever opens them, and no writer reuses them).
``megatron``, ``merge``
    ``prefix.idx`` + ``prefix.bin`` are both the previous dataset or both the new one, byte for byte.
    The only other state allowed is one the reader refuses to open with an :class:`mcf.MCFError`
    (a kill in the microseconds between the two renames): counted as ``refused``.  A pair made of two
    generations that the reader *opens* is a failure.
``megacontext``
    The tree opens with committed counts that never go back, the exact token stream and gists
    (tests/test_megacontext_crash.py's invariant), and ``verify`` reports no error.
``bucket``
    After ``rebuild`` every context the killed writer reported is listed and loads with its exact
    content; no half-written context directory is visible (only hidden ``.tmp-*`` directories).

Exit status 0 when every run held its invariant; the counts are printed as one JSON line at the end.

The bucket also has a deterministic harness (``--bucket-steps ROUNDS``, :func:`bucket_steps`): instead of
a random delay, a forked child counts every file-system mutation an operation makes (each ``open`` for
writing, ``write``, ``fsync``, ``rename``, ``mkdir``, ``unlink``, ``rmdir``, ``ftruncate``, and each write
or flush of a file object) and SIGKILLs itself right before the k-th, for k = 1, 2, ... until the operation
completes; this for an ingest and for a delete, with and without registry snapshots (journal compaction
forced on every update), each round.  After every kill: the registry files alone (``reconcile=False``)
are compared with the committed directories (counted: ``invisible`` committed contexts not listed,
``ghosts`` listed but gone), then healed by opening the bucket or, for a killed ingest, by re-ingesting
the same content in a handle that does not reconcile (the dedup repair), and must then list exactly the
committed contexts, each loading its exact content.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(ROOT))


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# ------------------------------------------------------------------------------------------------
# generations: what each child writes (deterministic, so the parent knows every byte in advance)
# ------------------------------------------------------------------------------------------------
MCF_VARIANTS = 3       # generation g writes variant g % 3 (three different sizes)
MEGATRON_VARIANTS = 3  # variants 0 and 1 have the same .bin size (a torn pair would look plausible)


def mcf_generation(path: str, v: int, atomic: bool = True) -> None:
    import mcf

    r = _rng("mcf", v)
    rows = 256 + 64 * v
    with mcf.Writer(path, atomic=atomic) as w:
        w.add_tensor("w.f32", r.standard_normal((rows, 512)).astype(np.float32))
        w.add_tensor("w.f16", r.standard_normal((rows, 256)).astype(np.float32), dtype="f16")
        w.add_tensor("w.q4", r.standard_normal((rows, 256)).astype(np.float32), method="q4")
        w.add_tensor("ids", np.arange(rows * 8, dtype=np.int32))
        w.add_resource("config.json", json.dumps({"variant": v}).encode())


def _write_safetensors(path: Path, tensors: dict) -> None:
    header, blobs, pos = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": {np.float32: "F32", np.float16: "F16"}[a.dtype.type], "shape": list(a.shape),
                        "data_offsets": [pos, pos + len(b)]}
        blobs.append(b)
        pos += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def pack_inputs(work: Path) -> list:
    """Two checkpoint directories (different sizes) that ``mcf pack`` turns into MCF files."""
    dirs = []
    for v in range(2):
        d = work / "inputs" / f"ckpt{v}"
        if not d.exists():
            d.mkdir(parents=True)
            r = _rng("pack", v)
            _write_safetensors(d / "model.safetensors", {
                f"layer.{k}.weight": r.standard_normal((128 + 64 * v, 256)).astype(np.float32) for k in range(4)})
            (d / "config.json").write_text(json.dumps({"model_type": "test", "variant": v}))
        dirs.append(d)
    return dirs


def quantize_inputs(work: Path) -> list:
    files = []
    for v in range(2):
        p = work / "inputs" / f"in{v}.mcf"
        if not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            mcf_generation(str(p), v)
        files.append(p)
    return files


def megatron_variant(v: int):
    """(tokens, lengths) of variant ``v``; variants 0 and 1 hold the same number of tokens."""
    r = _rng("megatron", v)
    n_docs = 3000
    lengths = r.integers(1, 200, n_docs)
    if v < 2:
        lengths = _rng("megatron-lengths").integers(1, 200, n_docs)  # same sizes, different tokens
    else:
        lengths = lengths + 7
    tokens = r.integers(0, 50_000, int(lengths.sum())).astype(np.uint16)
    return tokens, lengths


def megatron_generation(prefix: str, v: int) -> None:
    from mcf.megatron import Writer

    tokens, lengths = megatron_variant(v)
    with Writer(prefix, dtype=np.uint16) as w:
        w.add_documents(tokens, lengths)


def merge_inputs(work: Path) -> list:
    """Input shard sets: set 0 merges shards a+b, set 1 merges c (another size)."""
    shards = {}
    for name, v in (("a", 0), ("b", 1), ("c", 2)):
        p = work / "inputs" / f"shard_{name}"
        if not Path(str(p) + ".idx").exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            megatron_generation(str(p), v)
        shards[name] = str(p)
    return [[shards["a"], shards["b"]], [shards["c"]]]


def merge_generation(prefix: str, inputs: list) -> None:
    from mcf.megatron import merge

    merge(prefix, inputs)


# ------------------------------------------------------------------------------------------------
# children
# ------------------------------------------------------------------------------------------------
def child(name: str, work: str, gen: int) -> None:
    work_p = Path(work)
    if name == "megacontext":
        sys.path.insert(0, str(TESTS))
        import _megacontext_writer

        _megacontext_writer.main(str(work_p / "tree"), gen, 10**9)
        return
    from mcf import cli  # imported before "ready": the kill delays then count writing time only

    print("ready", flush=True)
    g = gen
    while True:
        if name in ("mcf", "mcf-unsafe"):  # mcf-unsafe: writes in place, to show the harness catches it
            mcf_generation(str(work_p / "out.mcf"), g % MCF_VARIANTS, atomic=name == "mcf")
        elif name == "pack":
            cli.main(["pack", str(pack_inputs(work_p)[g % 2]), "-o", str(work_p / "out.mcf"), "-q"])
        elif name == "quantize":
            cli.main(["quantize", str(quantize_inputs(work_p)[g % 2]), str(work_p / "out.mcf"), "--method",
                      "q4" if g % 2 else "k3", "-q"])
        elif name == "megatron":
            megatron_generation(str(work_p / "ds"), g % MEGATRON_VARIANTS)
        elif name == "merge":
            merge_generation(str(work_p / "ds"), merge_inputs(work_p)[g % 2])
        elif name == "bucket":
            from mcf.bucket.store import Bucket

            m = Bucket(work_p / "bucket").ingest("m", bucket_layers(g), content=f"ctx-{g}",
                                                 compression="lz4" if g % 2 else "none")
            print(f"done {g} {m['context_id']}", flush=True)
            g += 1
            continue
        else:
            raise SystemExit(f"unknown writer {name}")
        print(f"done {g}", flush=True)
        g += 1


def bucket_layers(g: int) -> list:
    r = _rng("bucket", g)
    return [(r.standard_normal((2, 48, 16)).astype(np.float32),) * 2 for _ in range(3)]


# ------------------------------------------------------------------------------------------------
# the parent: references, kills, checks
# ------------------------------------------------------------------------------------------------
class Failure(AssertionError):
    pass


class Harness:
    """Runs ``runs`` kill-and-check rounds of one writer in ``work`` (a scratch directory)."""

    def __init__(self, name: str, work: Path, seed: int = 0, max_delay: float | None = None):
        self.name = name
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.rng = _rng("kill", name, seed)
        self.max_delay = max_delay if max_delay is not None else DEFAULT_DELAY[name]
        self.next_gen = 0           # the generation the next child starts with
        self.last_done = None       # the last generation any child reported published
        self.counts = {"runs": 0, "killed": 0, "generations": 0, "temp_files_removed": 0, "refused": 0,
                       "rolled_forward": 0, "absent": 0}
        self.refs = {}
        self._megacontext_last = (0, 0, 0)
        self._bucket_ids: dict = {}     # generation -> context id, as the child reported them
        self._bucket_checked = 0
        self._prepare()

    # -- references ------------------------------------------------------------------------
    def _prepare(self) -> None:
        ref = self.work / "ref"
        ref.mkdir(exist_ok=True)
        n = self.name
        if n in ("mcf", "mcf-unsafe"):
            for v in range(MCF_VARIANTS):
                p = ref / f"v{v}.mcf"
                mcf_generation(str(p), v)
                self.refs[v] = p.read_bytes()
        elif n == "pack":
            import mcf
            for v, d in enumerate(pack_inputs(self.work)):
                p = ref / f"v{v}.mcf"
                from mcf import cli
                cli.main(["pack", str(d), "-o", str(p), "-q"])
                self.refs[v] = p.read_bytes()
                with mcf.open(p) as c:
                    assert len(c) == 4
        elif n == "quantize":
            from mcf import cli
            for v, src in enumerate(quantize_inputs(self.work)):
                p = ref / f"v{v}.mcf"
                cli.main(["quantize", str(src), str(p), "--method", "q4" if v % 2 else "k3", "-q"])
                self.refs[v] = p.read_bytes()
        elif n == "megatron":
            for v in range(MEGATRON_VARIANTS):
                megatron_generation(str(ref / f"v{v}"), v)
                self.refs[v] = ((ref / f"v{v}.idx").read_bytes(), (ref / f"v{v}.bin").read_bytes())
            assert len(self.refs[0][1]) == len(self.refs[1][1]) and self.refs[0][1] != self.refs[1][1]
        elif n == "merge":
            for v, inputs in enumerate(merge_inputs(self.work)):
                merge_generation(str(ref / f"v{v}"), inputs)
                self.refs[v] = ((ref / f"v{v}.idx").read_bytes(), (ref / f"v{v}.bin").read_bytes())
        elif n == "megacontext":
            import mcf.megacontext as mc
            with mc.create(self.work / "tree", embedding_dim=8, model_name="crash-test"):
                pass
        elif n == "bucket":
            pass
        else:
            raise ValueError(f"unknown writer {n!r}; one of {', '.join(WRITERS)}")

    def _variants(self) -> int:
        return {"mcf": MCF_VARIANTS, "mcf-unsafe": MCF_VARIANTS, "megatron": MEGATRON_VARIANTS}.get(self.name, 2)

    # -- one round -------------------------------------------------------------------------
    def run_once(self) -> None:
        delay = float(self.rng.uniform(0.0, self.max_delay))
        start = self.counts["runs"] if self.name == "megacontext" else self.next_gen  # megacontext: a seed
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", self.name, str(self.work),
                              str(start)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=str(ROOT))
        first = p.stdout.readline()
        if not first.startswith("ready"):
            p.kill()
            _, err = p.communicate()
            raise Failure(f"{self.name}: child did not start: {first!r} {err[-2000:]}")
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        out, err = p.communicate()
        self.counts["runs"] += 1
        if p.returncode != -signal.SIGKILL:
            raise Failure(f"{self.name}: child exited with {p.returncode} before the kill: {err[-2000:]}")
        self.counts["killed"] += 1
        lines = [line.split() for line in out.splitlines() if line.startswith("done ")]
        done = [int(f[1]) for f in lines]
        self._bucket_ids.update({int(f[1]): f[2] for f in lines if len(f) > 2})
        self.counts["generations"] += len(done)
        if done:
            self.last_done = done[-1]
        in_progress = (done[-1] + 1) if done else self.next_gen
        self.check(p.pid, in_progress)
        # the next child rewrites the unpublished generation, so in_progress is always last_done + 1
        self.next_gen = self.last_done + 1 if self.last_done is not None else 0

    # -- invariants ------------------------------------------------------------------------
    def check(self, pid: int, in_progress: int) -> None:
        getattr(self, f"_check_{self.name.replace('-', '_')}")(pid, in_progress)

    def _allowed(self, in_progress: int) -> dict:
        """variant -> generation: the last published generation and the one being written."""
        v = self._variants()
        gens = [in_progress] + ([self.last_done] if self.last_done is not None else [])
        return {g % v: g for g in gens}

    def _remove_temps(self, directory: Path, pid: int, base: str) -> None:
        for q in directory.iterdir():
            if q.name.startswith(f".{base}.") and q.name.endswith(".tmp"):
                if f".{pid}." not in q.name:
                    raise Failure(f"{self.name}: temp file of another process: {q.name}")
                q.unlink()
                self.counts["temp_files_removed"] += 1
            elif q.name.startswith(".mcf-megatron-"):
                raise Failure(f"{self.name}: visible spill file {q.name}")  # TemporaryFile: never named

    def _check_single_file(self, pid: int, in_progress: int) -> None:
        import mcf

        path = self.work / "out.mcf"
        self._remove_temps(self.work, pid, "out.mcf")
        names = sorted(q.name for q in self.work.iterdir() if q.name not in ("ref", "inputs"))
        if not path.exists():
            if self.last_done is not None:
                raise Failure(f"{self.name}: {path} vanished after generation {self.last_done} was published")
            self.counts["absent"] += 1
            if names:
                raise Failure(f"{self.name}: visible files without a result: {names}")
            return
        if names != ["out.mcf"]:
            raise Failure(f"{self.name}: unexpected files visible: {names}")
        data = path.read_bytes()
        allowed = self._allowed(in_progress)
        match = [v for v in allowed if self.refs[v] == data]
        if not match:
            raise Failure(f"{self.name}: {path} ({len(data)} bytes) is none of generations {sorted(allowed.values())}")
        with mcf.open(path) as c:
            if c.verify():
                raise Failure(f"{self.name}: verify: {c.verify()}")
        g = allowed[match[0]]
        self.last_done = g if self.last_done is None else max(self.last_done, g)

    _check_mcf = _check_pack = _check_quantize = _check_single_file
    _check_mcf_unsafe = _check_single_file

    def _check_megatron(self, pid: int, in_progress: int) -> None:
        import mcf
        import mcf.megatron as mt
        from mcf.megatron._publish import finish_interrupted

        # a kill between the two renames leaves ds.publish: the next reader (or writer) finishes that
        # publish from the complete temporary files it names, so do what mt.open would do, first
        if finish_interrupted(str(self.work / "ds")):
            self.counts["rolled_forward"] += 1
        self._remove_temps(self.work, pid, "ds.publish")
        self._remove_temps(self.work, pid, "ds.idx")
        self._remove_temps(self.work, pid, "ds.bin")
        visible = sorted(q.name for q in self.work.iterdir() if q.name not in ("ref", "inputs"))
        if set(visible) - {"ds.idx", "ds.bin"}:
            raise Failure(f"{self.name}: unexpected files visible: {visible}")
        idx = (self.work / "ds.idx").read_bytes() if "ds.idx" in visible else None
        binary = (self.work / "ds.bin").read_bytes() if "ds.bin" in visible else None
        allowed = self._allowed(in_progress)
        pair = [v for v in allowed if self.refs[v] == (idx, binary)]
        if pair:
            with mt.open(self.work / "ds") as ds:
                if ds.verify():
                    raise Failure(f"{self.name}: verify: {ds.verify()}")
            g = allowed[pair[0]]
            self.last_done = g if self.last_done is None else max(self.last_done, g)
            return
        if idx is None and binary is None and self.last_done is None:
            self.counts["absent"] += 1
            return
        # not a published dataset: the reader must refuse it
        try:
            with mt.open(self.work / "ds") as ds:
                ds.gather(np.arange(len(ds)))
        except mcf.MCFError:
            self.counts["refused"] += 1
            return
        raise Failure(f"{self.name}: a torn dataset opened: .idx of {self._which(idx, 0)}, .bin of "
                      f"{self._which(binary, 1)} (allowed: generations {sorted(allowed.values())})")

    _check_merge = _check_megatron

    def _which(self, data, k) -> str:
        return next((f"variant {v}" for v, r in self.refs.items() if r[k] == data), "no published variant")

    def _check_megacontext(self, pid: int, in_progress: int) -> None:
        import mcf.megacontext as mc

        sys.path.insert(0, str(TESTS))
        from test_megacontext_crash import check_consistent

        path = self.work / "tree"
        with mc.open(path) as t:
            counts = check_consistent(t)
        if not all(a >= b for a, b in zip(counts, self._megacontext_last)):
            raise Failure(f"megacontext: committed counts went back: {self._megacontext_last} -> {counts}")
        self._megacontext_last = counts
        errors = [p for p in mc.verify(path) if p.severity == "error"]
        if errors:
            raise Failure(f"megacontext: verify errors {errors}")

    def _check_bucket(self, pid: int, in_progress: int) -> None:
        from mcf.bucket.store import Bucket

        root = self.work / "bucket"
        if not root.exists():
            if self._bucket_ids:
                raise Failure("bucket: the directory vanished")
            return
        b = Bucket(root)
        reg = b.rebuild()
        if reg["skipped"]:
            raise Failure(f"bucket: rebuild skipped {reg['skipped']}")
        listed = {c["context_id"] for m in reg["models"] for c in m["contexts"]}
        visible = {q.name for q in (root / "contexts").iterdir() if not q.name.startswith(".")}
        if visible != listed:
            raise Failure(f"bucket: visible but not listed: {sorted(visible ^ listed)}")
        reported = set(self._bucket_ids.values())
        if not reported <= listed:
            raise Failure(f"bucket: published contexts lost: {sorted(reported - listed)[:5]}")
        extra = listed - reported
        if len(extra) > 1:
            raise Failure(f"bucket: {len(extra)} contexts nobody published: {sorted(extra)[:5]}")
        # the contexts new since the last check, and the one being written if it was committed, load exactly
        todo = {g: cid for g, cid in self._bucket_ids.items() if g >= self._bucket_checked}
        if extra:
            todo[in_progress] = extra.pop()
            self._bucket_ids[in_progress] = todo[in_progress]
            self.last_done = in_progress
        for g, cid in todo.items():
            got = b.load(cid, record_access=False)
            want = bucket_layers(g)
            if len(got) != len(want) or not all(
                    np.array_equal(np.asarray(k, np.float32), w[0].astype(np.float16).astype(np.float32))
                    for (k, _), w in zip(got, want)):
                raise Failure(f"bucket: context {cid} of generation {g} does not load its content")
        self._bucket_checked = max(self._bucket_ids, default=-1) + 1


# ------------------------------------------------------------------------------------------------
# the bucket, killed at every step of ingest and delete
# ------------------------------------------------------------------------------------------------
class _Steps:
    """Counts file-system mutations in a forked child and SIGKILLs it right before mutation ``kill_at``."""

    _OS = ("write", "fsync", "rename", "replace", "mkdir", "unlink", "rmdir", "ftruncate")
    _WRITE_FLAGS = 0
    for _f in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND", "O_TMPFILE"):
        _WRITE_FLAGS |= getattr(__import__("os"), _f, 0)

    def __init__(self, kill_at: int) -> None:
        import os

        self.n, self.kill_at = 0, kill_at
        real = {name: getattr(os, name) for name in self._OS}
        real_open, real_fdopen = os.open, os.fdopen

        def step():
            self.n += 1
            if self.n == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        def counted(fn):
            def call(*a, **k):
                step()
                return fn(*a, **k)
            return call

        def open_(path, flags, *a, **k):
            if flags & self._WRITE_FLAGS:
                step()
            return real_open(path, flags, *a, **k)

        class File:  # a file object whose writes and flushes are steps too
            def __init__(self, f):
                self._f = f

            def write(self, data):
                step()
                return self._f.write(data)

            def flush(self):
                step()
                return self._f.flush()

            def __getattr__(self, name):
                return getattr(self._f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._f.close()

        def fdopen(fd, mode="r", *a, **k):
            f = real_fdopen(fd, mode, *a, **k)
            return File(f) if any(c in mode for c in "wa+") else f

        for name, fn in real.items():
            setattr(os, name, counted(fn))
        os.open, os.fdopen = open_, fdopen


def _committed(root: Path) -> set:
    """Context directories that exist (a commit is one rename of a complete directory)."""
    d = root / "contexts"
    return {q.name for q in d.iterdir() if q.name.startswith("ctx_")} if d.exists() else set()


def _unlisted(bucket, on_disk: set, counts: dict, when: str = "") -> tuple:
    """The committed contexts the bucket's registry does not list (invisible) and the listed ones that are
    not committed (ghosts), added to ``counts["invisible" + when]`` and ``counts["ghosts" + when]``."""
    listed = {c["context_id"] for m in bucket.registry()["models"] for c in m["contexts"]}
    invisible, ghosts = on_disk - listed, listed - on_disk
    counts["invisible" + when] += len(invisible)
    counts["ghosts" + when] += len(ghosts)
    return invisible, ghosts


def bucket_steps(work: Path, rounds: int = 1, log=None) -> dict:
    """Kill an ingest and a delete at every step, ``rounds`` times each with and without snapshots;
    raises :class:`Failure` on any violation, returns the counts (see the module docstring)."""
    import os

    from mcf.bucket import _layout as L
    from mcf.bucket import _registry
    from mcf.bucket.store import Bucket, content_hash, context_id_for

    root = Path(work) / "bucket"
    counts = {"kills": 0, "completed": 0, "ingest_steps": 0, "delete_steps": 0, "committed_before_kill": 0,
              "invisible_before_heal": 0, "ghosts_before_heal": 0, "healed_by_dedup": 0, "healed_on_open": 0,
              "invisible": 0, "ghosts": 0}
    gens: dict = {}  # context id -> generation, for content checks
    g = 0
    with Bucket(root) as b:
        for _ in range(2):
            gens[b.ingest("m", bucket_layers(g), content=f"ctx-{g}", compression="lz4")["context_id"]] = g
            g += 1

    def kill_run(op, k: int, compact: bool):
        """Fork; the child does ``op`` and is killed before its k-th mutation.  True when it completed."""
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                if compact:
                    _registry.JOURNAL_COMPACT_BYTES = 0
                bk = Bucket(root)  # opened (and reconciled) before counting starts
                _Steps(k)
                op(bk)
            except BaseException:
                os._exit(3)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            return False
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            return True
        raise Failure(f"bucket-steps: child failed (status {status}) at step {k}")

    def check(kind: str, k: int, target: str, gen: int | None, use_dedup: bool) -> None:
        on_disk = _committed(root)
        with Bucket(root, reconcile=False) as raw:
            inv, gho = _unlisted(raw, on_disk, counts, "_before_heal")
        if inv or gho:
            if use_dedup and kind == "ingest" and inv == {target} and not gho:
                with Bucket(root, reconcile=False) as bd:
                    m = bd.ingest("m", bucket_layers(gen), content=f"ctx-{gen}", compression="lz4")
                if not m.get("deduplicated") or m["context_id"] != target:
                    raise Failure(f"bucket-steps: re-ingest after a kill at {kind} step {k} did not deduplicate")
                counts["healed_by_dedup"] += 1
            else:
                Bucket(root).close()
                counts["healed_on_open"] += 1
        with Bucket(root, reconcile=False) as after:
            bad_inv, bad_gho = _unlisted(after, on_disk, counts)
            if bad_inv or bad_gho:
                raise Failure(f"bucket-steps: after healing a kill at {kind} step {k}: invisible {sorted(bad_inv)}, "
                              f"ghosts {sorted(bad_gho)}")
            if kind == "ingest" and target in on_disk:
                got = after.load(target, record_access=False)
                want = bucket_layers(gen)
                if not all(np.array_equal(np.asarray(kk, np.float32), w[0].astype(np.float16).astype(np.float32))
                           for (kk, _), w in zip(got, want)):
                    raise Failure(f"bucket-steps: context of generation {gen} does not load its content")

    for r in range(rounds):
        for compact in (False, True):
            # ingest: a new generation for every kill point, until one completes
            k = 1
            while True:
                gen, g = g, g + 1
                target = context_id_for("m", content_hash(f"ctx-{gen}"), "float16", L.KVShape(3, 2, 16, 48))
                done = kill_run(lambda bk, gen=gen: bk.ingest("m", bucket_layers(gen), content=f"ctx-{gen}",
                                                              compression="lz4"), k, compact)
                gens[target] = gen
                if target in _committed(root) and not done:
                    counts["committed_before_kill"] += 1
                check("ingest", k, target, gen, use_dedup=k % 2 == 1)
                if done:
                    counts["completed"] += 1
                    if target not in _committed(root):
                        raise Failure("bucket-steps: a completed ingest is not committed")
                    counts["ingest_steps"] = max(counts["ingest_steps"], k - 1)
                    break
                counts["kills"] += 1
                k += 1
            # delete: a committed context for every kill point (ingested first, unkilled), until one completes
            k = 1
            while True:
                gen, g = g, g + 1
                with Bucket(root) as bk:
                    target = bk.ingest("m", bucket_layers(gen), content=f"ctx-{gen}", compression="lz4")["context_id"]
                gens[target] = gen
                done = kill_run(lambda bk, t=target: bk.delete(t), k, compact)
                check("delete", k, target, gen, use_dedup=False)
                if done:
                    counts["completed"] += 1
                    if target in _committed(root):
                        raise Failure("bucket-steps: a completed delete left the context")
                    counts["delete_steps"] = max(counts["delete_steps"], k - 1)
                    break
                counts["kills"] += 1
                k += 1
        if log:
            log(f"bucket-steps: round {r + 1}/{rounds}: {counts}")
    return counts


DEFAULT_DELAY = {"mcf": 0.4, "mcf-unsafe": 0.4, "pack": 0.5, "quantize": 0.5, "megatron": 0.5, "merge": 0.5,
                 "megacontext": 0.3, "bucket": 0.4}
WRITERS = tuple(w for w in DEFAULT_DELAY if w != "mcf-unsafe")


def run(name: str, runs: int, work: Path, seed: int = 0, max_delay: float | None = None, log=None) -> dict:
    h = Harness(name, work, seed, max_delay)
    for i in range(runs):
        h.run_once()
        if log and (i + 1) % 25 == 0:
            log(f"{name}: {i + 1}/{runs} runs, {h.counts}")
    return h.counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writer", help=f"one of {', '.join(WRITERS)}, or all")
    ap.add_argument("--runs", type=int, default=20, help="kills per writer")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill delays")
    ap.add_argument("--max-delay", type=float, help="longest delay before the kill (default: per writer)")
    ap.add_argument("--dir", help="scratch directory (default: a fresh temporary one, removed at the end)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--bucket-steps", type=int, metavar="ROUNDS",
                    help="kill a bucket ingest and delete at every step, ROUNDS times (with and without snapshots)")
    ap.add_argument("--child", nargs=3, metavar=("WRITER", "DIR", "GEN"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return 0
    if args.list:
        print("\n".join(WRITERS))
        return 0
    if args.bucket_steps:
        base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="mcf-kill-"))
        t0 = time.time()
        try:
            counts, status, rc = bucket_steps(base, args.bucket_steps,
                                              log=lambda m: print(m, file=sys.stderr, flush=True)), "ok", 0
        except Failure as exc:
            counts, status, rc = {}, f"FAILED: {exc}", 1
        finally:
            if not args.dir:
                shutil.rmtree(base, ignore_errors=True)
        print(json.dumps({"writer": "bucket-steps", "status": status, "seconds": round(time.time() - t0, 1), **counts}))
        return rc
    names = WRITERS if args.writer == "all" else [args.writer]
    if args.writer not in WRITERS + ("all", "mcf-unsafe"):
        ap.error(f"--writer must be one of {', '.join(WRITERS)} or all")
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="mcf-kill-"))
    rc = 0
    try:
        for n in names:
            t0 = time.time()
            try:
                counts = run(n, args.runs, base / n, args.seed, args.max_delay,
                             log=lambda m: print(m, file=sys.stderr, flush=True))
                status = "ok"
            except Failure as exc:
                counts, status, rc = {}, f"FAILED: {exc}", 1
            print(json.dumps({"writer": n, "status": status, "seconds": round(time.time() - t0, 1), **counts}),
                  flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
