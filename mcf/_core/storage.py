"""Which storage a file lives on, and how the read engine reads from it by default.

A mapping is the fastest way to read a file on a local disk and the worst on a network or FUSE
filesystem: every page fault there is a round trip, readahead is small, and a server that goes away
turns a memory access into SIGBUS (Qwen3-32B took 4 min 18 s with mmap against 32 s without on one such
mount, sglang#7469; TRT-LLM#17368 is the SIGBUS on Lustre).  So the kind of filesystem decides the
default: ``statfs`` gives its magic number, :data:`FILESYSTEMS` turns that into a name and a kind (on
macOS, statfs gives the type's name, and :data:`FILESYSTEM_NAMES` the kind), and :data:`DEFAULTS` gives
each kind its settings.  ``mmap=``, ``threads=``, ``chunk_bytes=``, ``direct=`` and (on
:meth:`mcf.io.Source.read_into` / ``read_ranges``) ``streams=`` override them per call.

The kinds:

- ``local``: a block-device filesystem (ext4, xfs, btrfs, zfs, f2fs...), or memory (tmpfs, ramfs,
  overlay): mapped; the engine's workers read in per-worker streams, each with its own readahead window.
- ``network``: NFS, CIFS/SMB, Lustre, GPFS, CephFS, BeeGFS, 9p, AFS, OCFS2, GFS2...: never mapped; many
  requests in flight, since each one waits for a server.
- ``fuse``: every FUSE filesystem (s3fs, gcsfuse, sshfs, GlusterFS's client, virtiofs...; statfs cannot
  tell them apart, fuseblk included): treated as ``network``, because most are.
- ``unknown``: a magic number not in the table: the ``local`` settings, mcf's behaviour before this
  table existed.
- ``object``: object stores and HTTP (``mcf.remote``), listed here so that every kind's figures live in
  one table.

The settings (O_DIRECT is off for every kind):

=========  ======  =======  =======  =======  ===========================================================
kind       mmap    threads  chunk    streams  why
=========  ======  =======  =======  =======  ===========================================================
local      yes     16       8 MiB    yes      the best cold median of every sweep here; streams: fio's way (below)
network    no      16       2 MiB    no       Run:ai Model Streamer's filesystem defaults: latency-bound
fuse       no      16       2 MiB    no       as network
unknown    yes     16       8 MiB    yes      as local
object     no      16       8 MiB    no       requests in flight x ranged GET size (:mod:`mcf.remote`), below
=========  ======  =======  =======  =======  ===========================================================

``streams``: how the engine's workers share a plan (csrc/readengine.c).  Yes: the plan is cut into one
contiguous part per worker, and each worker reads its part front to back through a descriptor of its own
(the file reopened: the kernel keeps readahead state per open file description), advised
``POSIX_FADV_SEQUENTIAL``, as ``fio --numjobs=N --offset_increment`` reads a file.  No: every worker takes
the next request in file order through the source's one descriptor, which keeps ``threads`` requests in
flight on a server, where readahead matters less than round trips (and reopening a file costs one).

Per-worker streams, cold, on this machine's disk (``bench/test_bench_cold_read.py``, figures in docs/io.md,
"Per-worker streams": a 1.67 GB checkpoint, page cache evicted with ``posix_fadvise``, three runs of 3-5
interleaved rounds at load averages up to 6): 16 workers read into touched memory at 2.60-2.76 GB/s in
streams against 1.67-2.56 sharing one stream, 0.86x fio's best sequential read in each run (a 6-round
sweep: 0.95-1.09x); with 4 workers the sequential advice (its doubled readahead window) and the descriptor
of their own each mattered (2.2-3.0 GB/s with both, 1.5-1.8 without the advice, 2.4 through the shared
descriptor); prefetching with ``POSIX_FADV_WILLNEED`` and O_DIRECT gained nothing.

How ``local``'s workers x chunk were chosen (``bench/read_engine_settings.py``, in the one-stream layout,
before per-worker streams; figures in docs/io.md): a 1.5 GB file of
random bytes on this machine's virtio disk (ext4, 8 MiB readahead, 2 cores shared with other work),
read as 258 tensors of 1 KiB..64 MiB into one fresh arena, page cache dropped before every cold run,
settings interleaved over 3, 7 and 9 rounds at load averages of 4 to 18.  Single runs varied 3x with the
other work on the disk, so only what held in all three sweeps decided:

- Cold, 16 workers x 8 MiB had the best median every time (1.36, 1.23, 1.04 GB/s against fio's
  sequential-read best of 1.34, 1.54, 1.65); one worker (0.54, 0.17) and chunks of 512 KiB (0.68, 0.23)
  never came close, two workers once (1.31, then 0.22); 16 x 2 MiB, Run:ai's filesystem setting,
  trailed 16 x 8 MiB (1.14, 0.55, 0.87): larger requests match the disk's readahead.  A single-threaded
  copy out of a mapping: 0.25-0.36.
- Warm, every multi-threaded setting was within the noise of the others (0.6-1.3 GB/s): the time goes
  to faulting in the fresh arena's pages in this VM (the same read into a reused arena: 1.9-2.6 GB/s).
- O_DIRECT (4 x 8 MiB, 16 x 2 MiB) gained nothing cold (0.80-1.09, fio's own O_DIRECT 0.72-1.04 against
  1.34-1.65 buffered) and lost warm, where it cannot use the page cache (0.47-1.08 against 0.61-1.30),
  so it stays an option (``direct=True``: a file larger than the page cache, or one whose cache must
  not be disturbed).
- io_uring through the maintained ``liburing`` binding (one ring, 4 or 16 reads of 2 MiB in flight)
  reached 0.61-1.05 cold and 0.83-0.98 warm: no gain over the thread pool that would pay for a second
  I/O path, so it is not used.

The ``network`` and ``fuse`` rows are Run:ai's defaults as published: there is no network filesystem on
these machines to tune them against, and their reads are bound by round trips, where the number of
requests in flight matters more than their size.  The ``object`` row started from Run:ai's object-store
defaults (8 x 8 MiB); 8 MiB x 16 in flight came out best of a sweep on loopback SeaweedFS and nginx
(docs/remote.md, "Cost"), and on a real link one connection to an object store carries ~100 MB/s, so a
fast link needs many (obstore and InstantTensor keep more in flight too).  :class:`mcf.remote.RemoteFile`
takes its ``concurrency`` and ``request_size`` from this row; a loader's ``threads=`` and
``chunk_bytes=`` override them for one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

__all__ = ["Storage", "ReadDefaults", "ReadStats", "FILESYSTEMS", "FILESYSTEM_NAMES", "DEFAULTS", "KINDS",
           "storage_for_magic", "storage_for_name", "defaults_for", "FUSE_MAGIC"]

KINDS = ("local", "network", "fuse", "unknown", "object")

FUSE_MAGIC = 0x65735546

# statfs f_type -> (filesystem, kind).  Sources: linux/magic.h, and coreutils' stat.c for the filesystems
# that live outside the kernel tree (GPFS, Lustre, BeeGFS, PanFS, ZFS, OpenAFS).
FILESYSTEMS: dict[int, tuple[str, str]] = {
    # local disks and memory
    0xEF53: ("ext2/3/4", "local"),
    0x58465342: ("xfs", "local"),
    0x9123683E: ("btrfs", "local"),
    0x2FC12FC1: ("zfs", "local"),
    0xF2F52010: ("f2fs", "local"),
    0xCA451A4E: ("bcachefs", "local"),
    0x3153464A: ("jfs", "local"),
    0x52654973: ("reiserfs", "local"),
    0x5346544E: ("ntfs", "local"),
    0x7366746E: ("ntfs3", "local"),
    0x4D44: ("vfat", "local"),
    0x2011BAB0: ("exfat", "local"),
    0x15013346: ("udf", "local"),
    0x9660: ("iso9660", "local"),
    0x73717368: ("squashfs", "local"),
    0xE0F5E1E2: ("erofs", "local"),
    0x01021994: ("tmpfs", "local"),
    0x858458F6: ("ramfs", "local"),
    0x958458F6: ("hugetlbfs", "local"),
    0x794C7630: ("overlay", "local"),
    # network and cluster filesystems
    0x6969: ("nfs", "network"),
    0x517B: ("smb", "network"),
    0xFF534D42: ("cifs", "network"),
    0xFE534D42: ("smb2", "network"),
    0x0BD00BD0: ("lustre", "network"),
    0x47504653: ("gpfs", "network"),
    0x00C36400: ("ceph", "network"),
    0x19830326: ("beegfs", "network"),
    0xAAD7AAEA: ("panfs", "network"),
    0x01021997: ("9p", "network"),
    0x5346414F: ("afs", "network"),
    0x6B414653: ("kafs", "network"),
    0x7461636F: ("ocfs2", "network"),
    0x01161970: ("gfs2", "network"),
    0x73757245: ("coda", "network"),
    0x20030528: ("orangefs", "network"),
    0x786F4256: ("vboxsf", "network"),
    # FUSE (fuse and fuseblk share the magic number)
    FUSE_MAGIC: ("fuse", "fuse"),
}

# macOS names the filesystem instead (statfs f_fstypename; its f_type numbers are its own): name -> kind
FILESYSTEM_NAMES: dict[str, str] = {
    "apfs": "local", "hfs": "local", "msdos": "local", "exfat": "local", "ntfs": "local", "udf": "local",
    "cd9660": "local", "devfs": "local", "tmpfs": "local",
    "nfs": "network", "smbfs": "network", "afpfs": "network", "webdav": "network", "cifs": "network",
    "macfuse": "fuse", "osxfuse": "fuse", "fuse": "fuse", "fusefs": "fuse",
}


@dataclass(frozen=True)
class Storage:
    """Where a file lives: ``kind`` (one of :data:`KINDS`), the ``filesystem``'s name and its statfs
    ``magic`` number (None when not a file on a filesystem)."""
    kind: str
    filesystem: str
    magic: int | None = None


@dataclass(frozen=True)
class ReadDefaults:
    """What the engine does on one kind of storage unless told otherwise: ``mmap=None`` maps or not,
    ``threads`` workers read requests of at most ``chunk_bytes``, with O_DIRECT when ``direct``, in
    per-worker streams (one contiguous part and one descriptor each) when ``streams``, else all from one
    stream."""
    mmap: bool
    threads: int
    chunk_bytes: int
    direct: bool
    streams: bool = False


MiB = 1 << 20
_NETWORK = ReadDefaults(mmap=False, threads=16, chunk_bytes=2 * MiB, direct=False)
_LOCAL = ReadDefaults(mmap=True, threads=16, chunk_bytes=8 * MiB, direct=False, streams=True)
DEFAULTS: dict[str, ReadDefaults] = {
    "local": _LOCAL,
    "network": _NETWORK,
    "fuse": _NETWORK,
    "unknown": _LOCAL,
    "object": ReadDefaults(mmap=False, threads=16, chunk_bytes=8 * MiB, direct=False),
}


@dataclass(frozen=True)
class ReadStats:
    """What one call of the read engine did (:attr:`mcf.io.Source.read_stats`): the ``storage`` it read
    from, the ``threads`` that ran, the ``chunk_bytes`` requested, whether ``direct`` (O_DIRECT) reads
    were made, the ``ranges`` left after coalescing, the read ``requests`` issued, the ``bytes_read``
    from storage (O_DIRECT alignment padding included), and the ``streams``: workers that read their own
    contiguous part through a descriptor of their own (0 when the workers shared one stream, or the file
    could not be reopened)."""
    storage: Storage
    threads: int
    chunk_bytes: int
    direct: bool
    ranges: int
    requests: int
    bytes_read: int
    streams: int = 0


@lru_cache(maxsize=64)   # one per filesystem seen: opening a file stays one statfs and one lookup
def storage_for_magic(magic: int) -> Storage:
    """The :class:`Storage` of a filesystem from its statfs ``f_type``."""
    name, kind = FILESYSTEMS.get(magic, (f"0x{magic:x}", "unknown"))
    return Storage(kind, name, magic)


@lru_cache(maxsize=64)
def storage_for_name(name: str) -> Storage:
    """The :class:`Storage` of a filesystem from its type name (macOS's statfs ``f_fstypename``; FUSE
    filesystems there are named after the FUSE implementation, ``macfuse`` and the like)."""
    kind = FILESYSTEM_NAMES.get(name)
    if kind is None and "fuse" in name:
        kind = "fuse"
    return Storage(kind or "unknown", name, None)


def defaults_for(kind: str) -> ReadDefaults:
    """The engine's settings on storage of ``kind``."""
    return DEFAULTS[kind]
