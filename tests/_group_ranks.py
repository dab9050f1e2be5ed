"""Ranks of a gloo process group on loopback for tests/test_load_group.py: processes started once by
``torch.multiprocessing`` (spawn), each running the tasks it is sent and answering with what its rank saw.

    with Ranks(4, tmp_path) as ranks:                    # four processes: the world, and a group of ranks 0 and 1
        answers = ranks.run("load", [args_of_rank_0, args_of_rank_1, ...], group=2)

A task is a function of this module, ``task(rank, group, **args) -> picklable``; its answer is
``("ok", value)`` or ``("error", exception class name, message)``.  Every wait is bounded, and the
processes are stopped by their PIDs on exit.  Nothing listens beyond loopback: the ranks meet through a
file store (torch's TCP store would listen on every interface) and gloo's sockets are on ``lo``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import queue
import signal

WAIT = 90.0          # the longest a test waits for a rank's answer (seconds): well past every group timeout
GROUP_TIMEOUT = 20   # the process groups' timeout (seconds): a dead rank's peers fail within it


class Ranks:
    """``n`` ranks in one gloo process group (the world) plus the group of ranks 0 and 1."""

    def __init__(self, n: int, scratch, timeout: float = GROUP_TIMEOUT, backend: str = "gloo"):
        """``scratch``: a directory of the test's (tmp_path) for the ranks' rendezvous file; ``timeout``: the
        groups' (the processes start under :data:`GROUP_TIMEOUT` whatever it is); ``backend="nccl"``: rank
        ``r`` on CUDA device ``r``."""
        import torch.multiprocessing as mp

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        ctx = mp.get_context("spawn")
        self.n = n
        self.answers = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(n)]
        store = os.path.join(os.fspath(scratch), "store")
        self.procs = [ctx.Process(target=_serve, args=(r, n, store, timeout, backend, self.tasks[r], self.answers),
                                  daemon=True) for r in range(n)]
        for p in self.procs:
            p.start()

    def run(self, task: str, args: list, *, group: int | None = None, answering=None, wait: float = WAIT) -> list:
        """Run ``task`` on the ranks of ``group`` (its size: 2 or the world's ``n``), rank ``r`` with keyword
        arguments ``args[r]``; their answers in rank order (None for a rank not in ``answering``, which
        is not waited for)."""
        size = group or self.n
        for r in range(size):
            self.tasks[r].put((task, size, args[r]))
        out = [None] * size
        for _ in range(size if answering is None else len(answering)):
            try:
                r, answer = self.answers.get(timeout=wait)
            except queue.Empty:
                raise AssertionError(f"{task}: no answer from every rank within {wait} s: {out}") from None
            out[r] = answer
        return out

    def kill(self, rank: int) -> None:
        p = self.procs[rank]
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(10)

    def close(self) -> None:
        for r, p in enumerate(self.procs):
            if p.is_alive():
                self.tasks[r].put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve(rank, n, store, timeout, backend, tasks, answers):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
    timeout = datetime.timedelta(seconds=timeout)
    groups = {n: dist.new_group(list(range(n)), timeout=timeout)}
    if n > 2:
        pair = dist.new_group([0, 1], timeout=timeout)   # every rank takes part in making it
        if rank < 2:
            groups[2] = pair
    while True:
        item = tasks.get()
        if item is None:
            break
        task, size, args = item
        try:
            answer = ("ok", globals()[task](rank, groups[size], **args))
        except Exception as exc:  # noqa: BLE001 - every error is the answer
            answer = ("error", type(exc).__name__, str(exc))
        answers.put((rank, answer))
    answers.close()
    answers.join_thread()   # the last answer is out
    os._exit(0)   # nothing of torch's teardown to wait for (the group dies with the processes)


# -- what the ranks are asked to do --------------------------------------------------------------------------
def digests(sd: dict) -> dict:
    """``name -> (dtype, shape, digest of the bytes)``: what two loads are compared by."""
    import torch

    out = {}
    for k, t in sd.items():
        t = t.cpu()
        raw = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        out[k] = (str(t.dtype), tuple(t.shape), hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest())
    return out


def _opened(path):
    """An open MCF container or safetensors checkpoint, and its sources (whose ``bytes_read`` the rank counts)."""
    import mcf
    from mcf.safetensors import open_checkpoint

    if str(path).endswith(".mcf"):
        c = mcf.open(path)
        return c, [c.source]
    if str(path).endswith(".gguf"):
        from mcf.gguf import open as open_gguf

        g = open_gguf(path)
        return g, [g.source]
    ck = open_checkpoint(path)
    return ck, [f.source for f in ck.files]


def load(rank, group, *, path, fn="load_file", staging=None, env=None, **kwargs):
    """``fn`` of mcf.torch on ``path`` with ``group=``: the digests of its tensors, and the bytes this rank's
    sources read."""
    import mcf.torch as mtorch
    from mcf.loading import plan

    if staging is not None:
        plan.STAGING_BYTES = staging   # small stages, so that decoded tensors are cut between ranks
    if env:
        os.environ.update(env)
    obj, sources = _opened(path)
    with obj:
        sd = getattr(mtorch, fn)(obj, group=group, **kwargs)
        return {"tensors": digests(sd), "bytes_read": sum(s.bytes_read for s in sources)}


def load_path(rank, group, *, path, fn="load_file", **kwargs):
    """The same on a path mcf opens itself (a missing one, a URL): only the digests."""
    import mcf.torch as mtorch

    return digests(getattr(mtorch, fn)(path, group=group, **kwargs))


def fail_reading(rank, group, *, path, truncate):
    """Load ``path`` (pread, no mapping); ``truncate`` cuts the file to 16 bytes after the ranks exchanged
    their plans, before this rank reads its share: its reads fail."""
    import mcf.loaders.distributed as distributed
    import mcf.torch as mtorch

    real = distributed.execute

    def cut_then_read(*a, **kw):
        if truncate:
            os.truncate(path, 16)
        return real(*a, **kw)

    distributed.execute = cut_then_read
    try:
        return digests(mtorch.load_file(path, group=group, mmap=False))
    finally:
        distributed.execute = real


def die_reading(rank, group, *, path, die):
    """Load ``path``; with ``die`` this process kills itself after the plans were exchanged, before it reads."""
    import mcf.loaders.distributed as distributed
    import mcf.torch as mtorch

    real = distributed.execute

    def killed(*a, **kw):
        if die:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **kw)

    distributed.execute = killed
    return digests(mtorch.load_file(path, group=group))


def bad_arguments(rank, group, *, path):
    """The errors of arguments a group load refuses, on every rank alike."""
    import mcf.torch as mtorch

    out = []
    for kwargs in ({"copy": False}, {"names": ["no.such.tensor"]}, {"ring_bytes": 4096}):
        try:
            mtorch.load_file(path, group=group, **kwargs)
            out.append(None)
        except Exception as exc:  # noqa: BLE001 - the answer
            out.append((type(exc).__name__, str(exc)))
    return out


def destinations(specs: dict, strided=()) -> dict:
    """``name -> tensor`` of zeros for ``specs`` (name -> (shape, dtype)); the names in ``strided`` are
    transposed views of a holder (not contiguous)."""
    import torch

    out = {}
    for n, (shape, dtype) in specs.items():
        if n in strided:
            out[n] = torch.zeros(tuple(reversed(shape)), dtype=dtype).T
        else:
            out[n] = torch.zeros(shape, dtype=dtype)
    return out


def module(specs: dict, *, meta: bool = False):
    """A module whose state dict holds ``specs`` (name -> (shape, dtype)): float tensors as parameters,
    the others as buffers; on the meta device with ``meta``."""
    import torch

    root = torch.nn.Module()
    with torch.device("meta") if meta else contextlib.nullcontext():
        for n, (shape, dtype) in specs.items():
            *path, leaf = n.split(".")
            mod = root
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            t = torch.zeros(shape, dtype=dtype)
            if t.is_floating_point():
                mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
            else:
                mod.register_buffer(leaf, t)
    return root


def fill_in_place(rank, group, *, path, specs, strided=(), fn="load_into", meta=False, staging=None, **kwargs):
    """``mcf.torch.load_into`` (or ``load_model`` into :func:`module`) of ``path`` with ``group=``: the digests
    of the filled tensors, the bytes this rank's sources read, and whether every tensor that had memory kept
    it (its ``data_ptr``)."""
    import mcf.torch as mtorch
    from mcf.loading import plan

    if staging is not None:
        plan.STAGING_BYTES = staging
    obj, sources = _opened(path)
    if fn == "load_into":
        held = destinations(specs, strided)
        target = held
    else:
        target = module(specs, meta=meta)
        held = target.state_dict()
    before = {k: t.data_ptr() for k, t in held.items() if not t.is_meta}
    zeros = digests({k: t for k, t in held.items() if not t.is_meta})
    try:
        with obj:
            result = getattr(mtorch, fn)(target, obj, group=group, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the answer, with whether anything was written
        untouched = digests({k: t for k, t in held.items() if not t.is_meta}) == zeros
        return {"error": (type(exc).__name__, str(exc)), "untouched": untouched}
    if fn == "load_model":
        held = target.state_dict()
    return {"result": result, "tensors": digests(held), "bytes_read": sum(s.bytes_read for s in sources),
            "kept": all(held[k].data_ptr() == v for k, v in before.items())}
