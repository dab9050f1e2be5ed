"""The shard directory of a distributed write: how shards are named, checked, resumed and committed.

Every write task publishes its documents as Megatron datasets (a ``.bin``/``.idx`` pair each, written
by :class:`mcf.megatron.Writer`, so each pair appears atomically).  Rows carry an order key
``(group, position)``: for the tokenizer, the group is the input chunk and the position the line's
document number in it.  A task writes one shard per group it holds, named by its range::

    g000000000012-000000000000-000000004213-end

that is group 12, documents ``[0, 4213)``, and ``-end``: the group's end marker (a row that says "this
group has 4213 documents") is in this shard.  The names alone therefore tell which groups are complete,
which is what a resumed job needs, and a retried task rewrites the same names with the same bytes.

The commit step sorts the shards by ``(group, first)``, refuses overlapping ranges (a document written
twice), checks that every group with an end marker is tiled exactly by its shards (no document lost)
and that every expected group has one, then merges the shards in order with :func:`mcf.megatron.merge`
(or writes a shard list).  Without an order key a task writes one shard named ``t<task index>``, and
the shards are taken in task order.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from dataclasses import asdict, dataclass

from mcf._core.fs import MAX_JSON_BYTES, read_regular
from mcf.errors import FormatError, InvalidArgumentError, os_error

__all__ = ["ShardRun", "run_name", "parse_run_name", "check_runs", "scan_runs", "complete_groups",
           "commit_runs", "remove_our_files", "DirectoryLock", "PLAN_FILE"]

PLAN_FILE = "plan.json"
LOCK_FILE = ".lock"
_NAME = re.compile(r"^g(\d{12})-(\d{12})-(\d{12})(-end)?$")
_TASK = re.compile(r"^t(\d{6,})$")
# temporaries of mcf's writers: .<name>.<pid>.<random>.tmp (mcf._core.fs.create_temp), and publish intents
_TEMP = re.compile(r"^\.(?:g\d{12}-\d{12}-\d{12}(?:-end)?|t\d{6,}|plan\.json)\.(?:bin|idx|json|publish)?.*\.tmp$")


@dataclass(frozen=True)
class ShardRun:
    """One shard of a distributed write: documents ``[first, stop)`` of ``group`` (``group`` None for
    shards named by task), with ``end`` when the group's end marker is in it (the group then has
    ``stop`` documents)."""

    name: str
    group: int | None
    first: int
    stop: int
    end: bool
    documents: int
    sequences: int
    tokens: int

    @property
    def gap_free(self) -> bool:
        return self.group is None or self.documents == self.stop - self.first

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ShardRun":
        return cls(**d)


def run_name(group: int, first: int, stop: int, end: bool) -> str:
    for v in (group, first, stop):
        if not 0 <= v < 10**12:
            raise InvalidArgumentError(f"shard key {v} does not fit 12 digits")
    return f"g{group:012d}-{first:012d}-{stop:012d}{'-end' if end else ''}"


def task_name(task: int) -> str:
    return f"t{int(task):06d}"


def parse_run_name(name: str):
    """``(group, first, stop, end)`` of a shard name, ``(None, task, task, False)`` of a task-named one,
    or None for any other name."""
    m = _NAME.match(name)
    if m:
        return int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4) is not None
    m = _TASK.match(name)
    if m:
        return None, int(m.group(1)), int(m.group(1)), False
    return None


def check_runs(runs, *, expected_groups=None, where: str = "the shard directory") -> list:
    """``runs`` sorted into dataset order, after checking that no document is there twice, that every
    group with an end marker is complete, and that each of ``expected_groups`` has one."""
    runs = list(runs)
    keyed = [r for r in runs if r.group is not None]
    if keyed and len(keyed) != len(runs):
        raise InvalidArgumentError(f"{where}: shards named by order key and by task index are mixed")
    if not keyed:
        out = sorted(runs, key=lambda r: r.first)
        for a, b in zip(out, out[1:]):
            if a.first == b.first:
                raise FormatError("two shards of the same write task", path=where, field=b.name)
        return out
    out = sorted(runs, key=lambda r: (r.group, r.first, r.stop, r.end))
    groups: dict = {}
    for r in out:
        groups.setdefault(r.group, []).append(r)
    for g, rs in groups.items():
        for a, b in zip(rs, rs[1:]):
            if a.end:
                raise FormatError(f"documents [{b.first}, {b.stop}) of group {g} lie past its end marker "
                                  f"({a.stop} documents)", path=where, field=b.name)
            if b.first < a.stop:
                raise FormatError(f"documents [{b.first}, {b.stop}) of group {g} overlap [{a.first}, {a.stop}): "
                                  "written twice, or the keys of two write tasks interleave", path=where, field=b.name)
        ends = [r for r in rs if r.end]
        if ends:
            n = ends[-1].stop
            pos = 0
            for r in rs:
                if r.first != pos or not r.gap_free:
                    missing = f"[{pos}, {r.first})" if r.first != pos else f"some of [{r.first}, {r.stop})"
                    raise FormatError(f"group {g} of {n} documents is missing documents {missing}", path=where,
                                      field=r.name)
                pos = r.stop
    if expected_groups is not None:
        want = set(expected_groups)
        done = {g for g, rs in groups.items() if any(r.end for r in rs)}
        missing = sorted(want - done)
        if missing:
            raise FormatError(f"{len(missing)} group(s) have no end marker (incomplete), first {missing[:5]}",
                              path=where, field="groups")
        extra = sorted(set(groups) - want)
        if extra:
            raise FormatError(f"shards of unexpected groups {extra[:5]}", path=where, field="groups")
    return out


def _runs_of_groups(runs) -> dict:
    groups: dict = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    return groups


def complete_groups(runs) -> dict:
    """``{group: [runs]}`` of the groups that ``runs`` tile completely (end marker included)."""
    out = {}
    for g, rs in _runs_of_groups(runs).items():
        try:
            check_runs(rs)
        except FormatError:
            continue
        if g is not None and any(r.end for r in rs):
            out[g] = sorted(rs, key=lambda r: r.first)
    return out


def scan_runs(directory: str) -> list:
    """The shards published in ``directory`` (both files present), with their counts from the headers.
    A publish interrupted between its two renames is finished first."""
    from mcf.megatron._publish import INTENT_SUFFIX, finish_interrupted
    from mcf.megatron.reader import open as open_dataset

    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise os_error(exc, directory) from None
    for n in names:
        if n.endswith(INTENT_SUFFIX) and parse_run_name(n[: -len(INTENT_SUFFIX)]):
            finish_interrupted(os.path.join(directory, n[: -len(INTENT_SUFFIX)]))
    names = set(os.listdir(directory))
    runs = []
    for n in sorted(names):
        if not n.endswith(".idx"):
            continue
        stem = n[:-4]
        parsed = parse_run_name(stem)
        if parsed is None or stem + ".bin" not in names:
            continue
        with open_dataset(os.path.join(directory, stem)) as ds:     # validated: a damaged shard is redone
            runs.append(ShardRun(stem, parsed[0], parsed[1], parsed[2], parsed[3], ds.num_documents, len(ds),
                                 ds.num_tokens))
    return runs


def remove_our_files(directory: str, keep=(), *, plan: bool = False) -> int:
    """Remove the shards (pairs), writer temporaries and publish intents in ``directory`` whose names
    are ours and not in ``keep``; the plan file too when ``plan``.  Other files are left alone.
    Returns how many files were removed."""
    from mcf.megatron._publish import INTENT_SUFFIX

    keep = set(keep)
    removed = 0
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    for n in names:
        stem = n
        for ext in (".idx", ".bin", INTENT_SUFFIX):
            if n.endswith(ext):
                stem = n[: -len(ext)]
                break
        ours = (stem != n and parse_run_name(stem) is not None and stem not in keep) or _TEMP.match(n) \
            or (plan and n == PLAN_FILE)
        if ours:
            try:
                os.unlink(os.path.join(directory, n))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


class DirectoryLock:
    """An exclusive ``flock`` on ``DIRECTORY/.lock`` for the lifetime of one job (a second job on the
    same shard directory fails at once instead of mixing its shards in)."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            self._fd = -1
            raise InvalidArgumentError(f"{directory}: another job is writing into this shard directory") from None

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def read_plan(directory: str):
    """The plan file of a shard directory as a dict, or None when there is none (or it is unreadable)."""
    try:
        doc = json.loads(read_regular(os.path.join(directory, PLAN_FILE), limit=MAX_JSON_BYTES, what=PLAN_FILE))
    except (OSError, ValueError, RecursionError):  # missing, not a regular file, too large, not JSON
        return None
    return doc if isinstance(doc, dict) else None


def write_plan(directory: str, plan: dict) -> None:
    from mcf._core.fs import write_atomic, write_all

    data = (json.dumps(plan, indent=1) + "\n").encode("utf-8")
    write_atomic(os.path.join(directory, PLAN_FILE), lambda fd: write_all(fd, data), durable=True)


def commit_runs(directory: str, runs, *, output_prefix, dtype, merge: bool = True, expected_groups=None,
                remove_directory: bool = True, progress=None) -> dict:
    """Check ``runs`` (see :func:`check_runs`) and publish them: merged into ``output_prefix`` (atomic,
    with the existing streaming merge), or listed in ``output_prefix + ".shards.json"``.  After a merge
    the shards are removed (and the directory, if it is left empty and ``remove_directory``).  Returns
    the counts and what was written."""
    from mcf.megatron.sharded import Shard, write_shard_list
    from mcf.megatron.writer import Writer, merge as merge_datasets

    ordered = check_runs(runs, expected_groups=expected_groups, where=directory)
    with_docs = [r for r in ordered if r.documents]
    prefixes = [os.path.join(directory, r.name) for r in with_docs]
    totals = {"shards": len(ordered), "documents": sum(r.documents for r in ordered),
              "sequences": sum(r.sequences for r in ordered), "tokens": sum(r.tokens for r in ordered)}
    if merge:
        if prefixes:
            merge_datasets(output_prefix, prefixes, progress=progress)
        else:
            with Writer(output_prefix, dtype=dtype):
                pass
        remove_our_files(directory, plan=True)
        if remove_directory:
            try:
                os.unlink(os.path.join(directory, LOCK_FILE))
            except FileNotFoundError:
                pass
            try:
                os.rmdir(directory)
            except OSError:
                pass    # not empty: files that are not ours stay
        return dict(totals, output=output_prefix)
    listed = with_docs or ordered[:1]
    shard_list = output_prefix + ".shards.json"
    write_shard_list(shard_list, [Shard(os.path.join(directory, r.name), r.sequences, r.documents, r.tokens)
                                  for r in listed], dtype=dtype)
    remove_our_files(directory, keep={r.name for r in ordered})
    return dict(totals, output=shard_list)
