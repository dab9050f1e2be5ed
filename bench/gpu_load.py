"""Loading a checkpoint onto a GPU: mcf's device ring (``mcf.torch.load_file(path, device="cuda")``) against the
loaders people use for the same job, from the page cache and cold, with the machine's own limits as yardsticks.

    python bench/gpu_load.py --dir DIR                        # one GPU, an 8 GiB checkpoint, <= 5 minutes
    python bench/gpu_load.py --dir DIR --quick                # one round of a 2 GiB checkpoint
    python bench/gpu_load.py --device cpu --size-gb 1 --quick # a smoke test without a GPU

What is measured, and why this way:

- **The checkpoint**: random bfloat16 tensors of Llama-like shapes (8 GiB by default, ``--size-gb``) in
  safetensors shards with their index, written once into ``--dir`` (fsynced, so that a cold run can evict
  them) and reused while its manifest matches.
- **Every load in a fresh process** (this script run with ``--child``): torch imported and the device
  initialised first; then the files are evicted from the page cache (cold: ``posix_fadvise(DONTNEED)`` on each
  file, no root needed; the share still resident is reported) or read once (warm); then the peak RSS is reset
  (``/proc/self/clear_refs``) and the load timed up to ``torch.cuda.synchronize()``.  GB/s = the checkpoint's
  bytes / that time.  Host memory = the peak RSS (``VmHWM``) above the RSS before the load, less the result's
  own bytes when the result is in host memory (``--device cpu``).  Three tensors are checked against the file.
- **The loaders**, each where it imports (a missing one is skipped, with the reason printed): mcf
  (``mcf.torch.load_file(dir, device=...)``: the ring, 4 pinned buffers of 64 MiB; on ``--device cpu`` the
  same ring is asked for explicitly), mcf's plain load followed by ``.to(device)`` (the path this replaced,
  for reference), ``safetensors.torch.load_file(file, device=...)`` per shard and, where safetensors has it,
  its ``backend="pread"``; fastsafetensors (``SafeTensorsFileLoader``, ``nogds=True``); Run:ai Model Streamer
  (``SafetensorsStreamer``, each tensor copied to the device as it arrives); instanttensor (``safe_open`` over
  every shard; CUDA only).  Each with its defaults.
- **Yardsticks**, in fresh processes too: the storage's speed, one plain sequential read of every file with
  16 MiB ``readinto`` calls (cold: evicted first; warm: from the page cache), and the pinned host-to-device
  copy bandwidth measured with torch (256 MiB, non-blocking copies timed with CUDA events; on the CPU, copies
  into fresh host memory).
- **Rounds**: every case once per round and state, in a shuffled order; medians over rounds.  The run stops
  starting processes before ``--max-seconds`` (default 290 s) would be passed and says what it left out.

Targets, printed with met / NO at the end, for each state:

- mcf >= 0.9x min(the storage's sequential read, the pinned host-to-device bandwidth);
- mcf >= 1.2x the best peer that ran;
- mcf's host memory <= the ring + 64 MiB (320 MiB by default) above the RSS before the load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from host_state import load_average, machine  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
RING_BYTES = 4 * 64 * MiB          # mcf's default ring: 4 buffers of 64 MiB
STAGING = 64 * MiB                  # and at most this much decoding staging beside it
POOL = 64 * MiB                     # random bytes the checkpoint's tensors are cut from

# (case, label, role): "mcf" is the target, "peer" a loader it is compared with, "info" shown only,
# "yardstick" a limit of the machine
CASES = [
    ("mcf", "mcf.torch.load_file(dir, device=...)", "mcf"),
    ("mcf.plain_then_to", "mcf.torch.load_file(dir) then .to(device)", "info"),
    ("safetensors", "safetensors.torch.load_file(shard, device=...)", "peer"),
    ("safetensors.pread", "safetensors.torch.load_file(shard, device=..., backend='pread')", "peer"),
    ("fastsafetensors", "fastsafetensors SafeTensorsFileLoader, nogds=True", "peer"),
    ("runai", "Run:ai Model Streamer SafetensorsStreamer, .to(device)", "peer"),
    ("instanttensor", "instanttensor safe_open(shards)", "peer"),
]
YARDSTICKS = [
    ("seqread", "plain sequential read of the files (16 MiB readinto)", "yardstick"),
    ("h2d", "pinned host-to-device copies (torch)", "yardstick"),
]


# -- the checkpoint ---------------------------------------------------------------------------------------------
def _shapes(size: int):
    """Llama-like bfloat16 tensors until ``size`` bytes: an embedding, then layers (attention, MLP, norms)."""
    hidden, inter, kv, vocab = 4096, 14336, 1024, 32000
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    total = vocab * hidden * 2
    i = 0
    while total < size:
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (kv, hidden)),
                            ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
                            ("mlp.down_proj.weight", (hidden, inter)), ("input_layernorm.weight", (hidden,)),
                            ("post_attention_layernorm.weight", (hidden,))):
            out.append((p + name, shape))
            total += 2 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
            if total >= size:
                break
        i += 1
    return out


def ensure_checkpoint(root: str, size: int) -> dict:
    """The checkpoint of ``size`` bytes under ``root`` (written on first use): ``{"dir", "files", "bytes",
    "tensors"}``."""
    import numpy as np

    d = os.path.join(root, f"bf16-{size / GiB:g}GiB")
    manifest = os.path.join(d, "manifest.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            m = json.load(f)
        if all(os.path.exists(p) and os.path.getsize(p) == n for p, n in zip(m["files"], m["sizes"])):
            return m
    os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    shapes = _shapes(size)
    shard_bytes = max(256 * MiB, min(2 * GiB, size // 4))
    shards, cur, held = [], [], 0
    for name, shape in shapes:
        n = 2 * int(np.prod(shape))
        if cur and held + n > shard_bytes:
            shards.append(cur)
            cur, held = [], 0
        cur.append((name, shape, n))
        held += n
    shards.append(cur)
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 1 << 16, POOL // 2, dtype=np.uint16)
    pool &= 0xBFFF                   # the exponent's top bit cleared: finite bfloat16 values, |x| < 2
    pool = memoryview(pool.view(np.uint8).tobytes())
    files, sizes, weight_map, k, total = [], [], {}, 0, 0
    for s, part in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        path = os.path.join(d, fname)
        header, pos = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, n in part:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + n]}
            pos += n
            weight_map[name] = fname
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, len(h).to_bytes(8, "little") + h)
            for _, _, n in part:
                at = (k * 7919 * 64) % POOL
                k += 1
                while n:
                    take = min(n, POOL - at)
                    view = pool[at:at + take]
                    while view:
                        view = view[os.write(fd, view):]
                    n -= take
                    at = 0
            os.fsync(fd)
        finally:
            os.close(fd)
        files.append(path)
        sizes.append(os.path.getsize(path))
        total += pos
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    m = {"dir": d, "files": files, "sizes": sizes, "bytes": total, "tensors": len(shapes)}
    with open(manifest, "w") as f:
        json.dump(m, f)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    print(f"wrote {total / 1e9:.2f} GB in {len(files)} shards to {d} in {time.perf_counter() - t0:.1f} s", flush=True)
    return m


# -- the page cache ---------------------------------------------------------------------------------------------
def evict(files) -> None:
    from bench_common import evict_page_cache

    evict_page_cache(*files)


def warm(files) -> None:
    buf = bytearray(16 * MiB)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def resident(files) -> float:
    """The share of the files' pages in the page cache (``mincore`` over a private mapping of each), or -1 where
    it cannot be told."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        have = pages = 0
        for p in files:
            n = os.path.getsize(p)
            if not n:
                continue
            count = -(-n // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * count)()
            with open(p, "rb") as f:
                mm = mmap.mmap(f.fileno(), n, access=mmap.ACCESS_COPY)   # writable, so ctypes can take its address
                try:
                    first = ctypes.c_char.from_buffer(mm)
                    addr = ctypes.addressof(first)
                    del first
                    if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), vec) != 0:
                        return -1.0
                finally:
                    mm.close()
            have += sum(v & 1 for v in vec)
            pages += count
        return have / pages if pages else 0.0
    except (OSError, AttributeError, ValueError, TypeError, BufferError):
        return -1.0


# -- one measurement, in this process (--child) ------------------------------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return -1


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Skip(Exception):
    """The case cannot run here (a package that does not import, a device it does not load to)."""


def _setup(case: str, m: dict, dev):
    """``load() -> dict of tensors`` for ``case`` (imports done here, untimed)."""
    files, d = m["files"], m["dir"]
    if case == "mcf":
        import mcf.torch
        if dev.type == "cpu":   # a CPU load takes the ring only when asked to
            return lambda: mcf.torch.load_file(d, device=dev, ring_buffers=4, ring_bytes=64 * MiB)
        return lambda: mcf.torch.load_file(d, device=dev)
    if case == "mcf.plain_then_to":
        import mcf.torch
        return lambda: {k: v.to(dev) for k, v in mcf.torch.load_file(d).items()}
    if case in ("safetensors", "safetensors.pread"):
        import inspect

        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise Skip(f"safetensors does not import: {exc}") from None
        kw = {}
        if case == "safetensors.pread":
            if "backend" not in inspect.signature(load_file).parameters:
                import safetensors
                raise Skip(f"safetensors {safetensors.__version__} has no backend= (pread) in load_file")
            kw["backend"] = "pread"
        where = str(dev) if dev.type == "cpu" else dev.index if dev.index is not None else 0

        def load():
            out = {}
            for f in files:
                out.update(load_file(f, device=where, **kw))
            return out
        return load
    if case == "fastsafetensors":
        try:
            import fastsafetensors
            from fastsafetensors import SafeTensorsFileLoader
        except ImportError as exc:
            raise Skip(f"fastsafetensors does not import: {exc}") from None
        group = getattr(fastsafetensors, "SingleGroup", None)
        held = []

        def load():
            loader = SafeTensorsFileLoader(group() if group else None, dev, nogds=True)
            loader.add_filenames({0: list(files)})
            fb = loader.copy_files_to_device()
            held.append((loader, fb))
            return {k: fb.get_tensor(k) for k in loader.get_keys()}
        return load
    if case == "runai":
        try:
            from runai_model_streamer import SafetensorsStreamer
        except ImportError as exc:
            raise Skip(f"runai-model-streamer does not import: {exc}") from None

        def load():
            out = {}
            with SafetensorsStreamer() as s:
                if hasattr(s, "stream_files"):
                    s.stream_files(list(files))
                else:
                    for f in files:
                        s.stream_file(f)
                for name, t in s.get_tensors():   # a view of its buffer: copied out as it arrives
                    out[name] = t.to(dev, copy=True)
            return out
        return load
    if case == "instanttensor":
        if dev.type != "cuda":
            raise Skip("instanttensor loads onto CUDA devices only")
        try:
            from instanttensor import safe_open
        except ImportError as exc:
            raise Skip(f"instanttensor does not import: {exc}") from None

        def load():
            out = {}
            with safe_open(list(files), framework="pt", device=dev.index or 0) as f:
                for name, t in f.tensors():   # a view of its buffer: cloned, as its README says
                    out[name] = t.clone()
            return out
        return load
    raise Skip(f"unknown case {case!r}")


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _check(out: dict, m: dict) -> bool:
    """Three tensors (first, middle, last of the checkpoint) against the file's bytes, and every tensor there."""
    import torch

    index = []
    for p in m["files"]:
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h = json.loads(f.read(n))
        h.pop("__metadata__", None)
        index += [(p, 8 + n, k, v) for k, v in h.items()]
    if len(out) != len(index):
        return False
    for p, base, name, info in (index[0], index[len(index) // 2], index[-1]):
        a, b = info["data_offsets"]
        take = min(b - a, 1 << 16)
        fd = os.open(p, os.O_RDONLY)
        try:
            want = os.pread(fd, take, base + a) + os.pread(fd, take, base + b - take)
        finally:
            os.close(fd)
        t = out[name].detach().reshape(-1).view(torch.uint8)
        got = t[:take].cpu().numpy().tobytes() + t[t.numel() - take:].cpu().numpy().tobytes()
        if got != want or t.numel() != b - a:
            return False
    return True


def child(spec: dict) -> dict:
    import torch

    dev = torch.device(spec["device"])
    m = spec["checkpoint"]
    if dev.type == "cuda":
        torch.cuda.init()
        x = torch.ones(1 << 20, device=dev)
        x.add_(1)
        torch.cuda.synchronize(dev)
        del x
    case = spec["case"]
    res = {"case": case, "state": spec["state"], "round": spec["round"]}
    try:
        load = None if case in ("seqread", "h2d") else _setup(case, m, dev)
    except Skip as exc:
        return {**res, "skip": str(exc)}
    if case == "h2d":
        return {**res, **_h2d(dev)}
    files = m["files"]
    if spec["state"] == "cold":
        evict(files)
    else:
        warm(files)
    res["resident"] = resident(files)
    res["peak_reset"] = _reset_peak()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    if case == "seqread":
        nbytes = 0
        buf = bytearray(16 * MiB)
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while True:
                    n = f.readinto(buf)
                    if not n:
                        break
                    nbytes += n
        seconds = time.perf_counter() - t0
        return {**res, "seconds": seconds, "bytes": nbytes, "gbps": nbytes / seconds / 1e9}
    out = load()
    _sync(dev)
    if dev.type == "cpu":   # a mapped result pays its page faults here, as a first use would
        for t in out.values():
            if t.numel():
                int(t.detach().reshape(-1).view(torch.uint8)[::4096].sum())
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    host_result = m["bytes"] if dev.type == "cpu" else 0
    ok = _check(out, m)
    return {**res, "seconds": seconds, "bytes": m["bytes"], "gbps": m["bytes"] / seconds / 1e9, "rss_before": base,
            "peak": peak, "host_above": peak - base - host_result, "ok": ok}


def _h2d(dev) -> dict:
    """Bandwidth of copies from pinned host memory to the device (on the CPU: into fresh host memory)."""
    import torch

    n = 256 * MiB
    if dev.type == "cuda":
        src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        src.fill_(1)
        dst = torch.empty(n, dtype=torch.uint8, device=dev)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 8
        start.record()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
        return {"seconds": seconds, "bytes": reps * n, "gbps": reps * n / seconds / 1e9, "pinned": True}
    src = torch.ones(n, dtype=torch.uint8)
    reps = 4
    t0 = time.perf_counter()
    for _ in range(reps):
        dst = torch.empty(n, dtype=torch.uint8)
        dst.copy_(src)
        del dst
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes": reps * n, "gbps": reps * n / seconds / 1e9, "pinned": False}


# -- the run ----------------------------------------------------------------------------------------------------
def _run_child(spec: dict, timeout: float) -> dict:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                       capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"case": spec["case"], "state": spec["state"], "round": spec["round"], "error": tail[:300]}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "mcf-gpu-bench"),
                    help="where the checkpoint is written once and reused (a directory on the storage to measure)")
    ap.add_argument("--device", default="cuda", help="the torch device to load onto (cpu: a smoke test)")
    ap.add_argument("--size-gb", type=float, default=None, help="checkpoint size in GiB (default 8; 2 with --quick)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of every case and state (default 2; 1 with --quick)")
    ap.add_argument("--states", default="cold,warm", help="cold, warm or both")
    ap.add_argument("--cases", default=",".join(c for c, _, _ in CASES), help="loaders to run")
    ap.add_argument("--quick", action="store_true", help="one round of a 2 GiB checkpoint")
    ap.add_argument("--max-seconds", type=float, default=290, help="start no process that would end past this")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    t_start = time.monotonic()
    size = int((args.size_gb if args.size_gb is not None else 2 if args.quick else 8) * GiB)
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else 2
    states = [s for s in args.states.split(",") if s]
    wanted = set(args.cases.split(","))
    cases = [c for c in CASES if c[0] in wanted]
    if args.device.startswith("cuda"):
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                               capture_output=True, text=True)
        if probe.stdout.strip() != "True":
            print("no CUDA device here: run with --device cpu --size-gb 1 for a smoke test", file=sys.stderr)
            return 2
    m = ensure_checkpoint(args.dir, size)
    host = machine()
    print(f"checkpoint {m['bytes'] / 1e9:.2f} GB, {m['tensors']} bf16 tensors in {len(m['files'])} shards; "
          f"device {args.device}; {host['cpus']} CPUs, {host['mem_gib']} GiB; load average {load_average():.2f}",
          flush=True)
    plan = [(r, s, c) for r in range(rounds) for s in states
            for c in ([y for y in YARDSTICKS if y[0] != "h2d" or s == states[0]] if r == 0 else []) + cases]
    for r in range(rounds):   # shuffle each round's order, the yardsticks first
        block = [x for x in plan if x[0] == r]
        ys = [x for x in block if x[2][2] == "yardstick"]
        rest = [x for x in block if x[2][2] != "yardstick"]
        random.Random(r).shuffle(rest)
        plan = [x for x in plan if x[0] != r] + ys + rest
    results, took, left = [], [], []
    for r, state, (case, label, role) in plan:
        spent = time.monotonic() - t_start
        guess = (statistics.median(took) * 1.5 if took else 30) + 5
        if spent + guess > args.max_seconds:
            left.append(f"{case}/{state}/round {r + 1}")
            continue
        spec = {"case": case, "state": state, "round": r, "device": args.device, "checkpoint": m}
        t0 = time.monotonic()
        try:
            res = _run_child(spec, timeout=max(10.0, args.max_seconds - spent))
        except subprocess.TimeoutExpired:
            res = {"case": case, "state": state, "round": r, "error": "timed out"}
        took.append(time.monotonic() - t0)
        res.update(label=label, role=role)
        results.append(res)
        if "skip" in res:
            if not any(x.get("skip") and x["case"] == case for x in results[:-1]):
                print(f"  skip {case}: {res['skip']}", flush=True)
        elif "error" in res:
            print(f"  FAIL {case} ({state}): {res['error']}", flush=True)
        else:
            extra = f", host +{res['host_above'] / MiB:.0f} MiB" if "host_above" in res else ""
            res_note = f", resident {res['resident']:.0%}" if res.get("resident", -1) >= 0 else ""
            bad = "" if res.get("ok", True) else "  WRONG BYTES"
            print(f"  {case:<18} {state:<5} {res['gbps']:7.2f} GB/s{extra}{res_note}{bad}", flush=True)
    _summary(results, states, left, args, m)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": host, "checkpoint": m, "results": results}, f, indent=1)
    return 0


def _summary(results, states, left, args, m) -> None:
    ran = [r for r in results if "gbps" in r]

    def med(case, state=None):
        v = [r["gbps"] for r in ran if r["case"] == case and (state is None or r["state"] == state)]
        return statistics.median(v) if v else None

    def host(case, state):
        v = [r["host_above"] for r in ran if r["case"] == case and r["state"] == state and "host_above" in r]
        return max(v) if v else None

    print(f"\n{m['bytes'] / 1e9:.2f} GB onto {args.device}: medians of GB/s over rounds, the largest host memory above "
          "the RSS before the load (less the result, when it is in host memory)")
    print(f"{'loader':<62} {'state':<5} {'GB/s':>7} {'host MiB':>9}")
    for case, label, _ in CASES + YARDSTICKS:
        for state in states if case != "h2d" else ["-"]:   # the copy bandwidth does not depend on the cache
            g = med(case) if case == "h2d" else med(case, state)
            if g is None:
                continue
            h = host(case, state)
            print(f"{label:<62} {state:<5} {g:7.2f} {'' if h is None else f'{h / MiB:9.0f}'}")
    skipped = sorted({(r["case"], r["skip"]) for r in results if "skip" in r})
    for case, why in skipped:
        print(f"skipped {case}: {why}")
    for r in results:
        if "error" in r:
            print(f"failed {r['case']} ({r['state']}, round {r['round'] + 1}): {r['error']}")
    if any(not r.get("ok", True) for r in ran):
        print("WRONG BYTES in: " + ", ".join(sorted({r["case"] for r in ran if not r.get("ok", True)})))
    print("\ntargets")
    h2d = med("h2d")
    for state in states:
        mine, seq = med("mcf", state), med("seqread", state)
        if mine is None:
            print(f"  {state}: mcf did not run")
            continue
        limits = [x for x in (seq, h2d) if x is not None]
        if limits:
            floor = min(limits)
            print(f"  {state}: mcf {mine:.2f} GB/s >= 0.9x min(sequential read {seq or float('nan'):.2f}, "
                  f"H2D {h2d or float('nan'):.2f}) = {0.9 * floor:.2f}: {'met' if mine >= 0.9 * floor else 'NO'} "
                  f"({mine / floor:.2f}x)")
        peers = {c: med(c, state) for c, _, role in CASES if role == "peer" and med(c, state) is not None}
        if peers:
            best = max(peers, key=peers.get)
            print(f"  {state}: mcf >= 1.2x the best peer ({best}, {peers[best]:.2f} GB/s): "
                  f"{'met' if mine >= 1.2 * peers[best] else 'NO'} ({mine / peers[best]:.2f}x)")
        else:
            print(f"  {state}: no peer ran")
        h = host("mcf", state)
        if h is not None:
            cap = RING_BYTES + STAGING
            print(f"  {state}: mcf host memory {h / MiB:.0f} MiB <= ring + 64 MiB = {cap / MiB:.0f} MiB: "
                  f"{'met' if h <= cap else 'NO'}")
    if m["bytes"] < 8e9:
        print(f"  (a {m['bytes'] / 1e9:.2f} GB checkpoint: the targets are set for 8 GB or more)")
    if left:
        print(f"\nleft out to stay within --max-seconds {args.max_seconds:g}: " + ", ".join(left))


if __name__ == "__main__":
    sys.exit(main())
