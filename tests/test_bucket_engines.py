"""The engine plugins (mcf.bucket.engines) driven by the engines' own classes, imported from their wheels,
on the CPU; the configuration blocks of docs/bucket.md §12 are the ones tested.  An engine that does not
import here is skipped with the reason (they are installed with ``pip install --no-deps``: tools/kv_engines.txt)."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from _doc_blocks import blocks_of


def _doc_file(name: str) -> str:
    (block,) = [b for b in blocks_of("bucket.md") if b.file == name]
    return block.body


def _with_root(text: str, root) -> str:
    return text.replace("/data/mcb", str(root))


# -- SGLang -------------------------------------------------------------------------------------------

def _sglang():
    pytest.importorskip("torch", reason="SGLang's classes need torch")
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage, HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except ImportError as exc:
        pytest.skip(f"SGLang does not import here ({exc}): the pinned engines: tools/kv_engines.txt")
    return HiCacheFile, HiCacheStorage, HiCacheStorageConfig, StorageBackendFactory


def _sg_config(cfg_cls, extra):
    return cfg_cls(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                   enable_storage_metrics=False, is_page_first_layout=True, model_name="meta-llama/Llama-3.1-8B",
                   extra_config=extra)


class _HostPool:
    """SGLang's MHA host pool's page arithmetic (pool_host/mha.py: kv_buffer, get_data_page,
    set_from_flat_data_page, get_page_buffer_meta) over a CPU tensor; the real class is not built here
    because its module imports torchvision."""

    def __init__(self, layout, *, pages=8, page_size=4, layers=3, heads=2, dim=8):
        import torch

        self.layout, self.page_size = layout, page_size
        self.layer_num, self.head_num, self.head_dim = layers, heads, dim
        self.size = pages * page_size
        shape = (2, layers, self.size, heads, dim) if layout == "layer_first" else (2, self.size, layers, heads, dim)
        self.kv_buffer = torch.randn(shape).to(torch.bfloat16)
        self.v_buffer = self.kv_buffer[1]
        self.dtype = torch.bfloat16

    def get_data_page(self, index, flat=True):
        page = (self.kv_buffer[:, :, index:index + self.page_size] if self.layout == "layer_first"
                else self.kv_buffer[:, index:index + self.page_size])
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        import torch

        return torch.zeros(2 * self.layer_num * self.page_size * self.head_num * self.head_dim, dtype=self.dtype)

    def set_from_flat_data_page(self, index, data_page):
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index:index + self.page_size] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            self.kv_buffer[:, index:index + self.page_size] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)

    def get_page_buffer_meta(self, indices):
        item = self.dtype.itemsize
        base, ptrs = self.kv_buffer.data_ptr(), []
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        for index in indices.tolist()[::self.page_size]:
            if self.layout == "layer_first":
                for layer in range(self.layer_num):
                    k = base + index * self.head_num * self.head_dim * item + layer * self.size * self.head_num * \
                        self.head_dim * item
                    ptrs += [k, k + v_offset]
                size = item * self.page_size * self.head_num * self.head_dim
            else:
                k = base + index * self.layer_num * self.head_num * self.head_dim * item
                ptrs += [k, k + v_offset]
                size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)


def test_sglang_factory_makes_the_backend_from_the_documented_config(tmp_path):
    _, HiCacheStorage, HiCacheStorageConfig, StorageBackendFactory = _sglang()
    from mcf.bucket.engines.sglang import BucketHiCacheStorage

    extra = json.loads(_with_root(_doc_file("sglang-hicache.json"), tmp_path))
    backend = StorageBackendFactory.create_backend("dynamic", _sg_config(HiCacheStorageConfig, extra), None)
    assert isinstance(backend, BucketHiCacheStorage) and isinstance(backend, HiCacheStorage)
    assert backend.store.namespace == "sglang-meta-llama-Llama-3.1-8B-tp0of1"
    backend.close()


def test_sglang_answers_as_hicachefile(tmp_path):
    """The same operations on SGLang's HiCacheFile and on the bucket give the same answers and bytes."""
    torch = pytest.importorskip("torch", reason="the engines' classes need torch")

    HiCacheFile, _, HiCacheStorageConfig, StorageBackendFactory = _sglang()
    from mcf.bucket.engines.sglang import BucketHiCacheStorage

    ref = HiCacheFile(_sg_config(HiCacheStorageConfig, {"file_storage_path": str(tmp_path / "hf")}))
    ours = BucketHiCacheStorage(_sg_config(HiCacheStorageConfig, {"root": str(tmp_path / "mcb")}))
    pages = [torch.randn(2 * 3 * 4 * 2 * 8).to(torch.bfloat16) for _ in range(6)]
    keys = [f"{i:064x}" for i in range(6)]
    ops = [("batch_exists", keys), ("batch_set", [0, 1, 2]), ("set", 4), ("batch_exists", keys), ("exists", 3),
           ("exists", 4), ("batch_exists", keys[3:]), ("batch_get", [0, 3, 4, 1]), ("get", 2), ("get", 5),
           ("set", 0), ("batch_set", [3]), ("batch_exists", keys), ("batch_get", list(range(6)))]

    def run(b):
        out = []
        for op, arg in ops:
            if op == "batch_exists":
                out.append(b.batch_exists(arg))
            elif op == "exists":
                out.append(b.exists(keys[arg]))
            elif op == "set":
                out.append(b.set(keys[arg], pages[arg]))
            elif op == "batch_set":
                out.append(b.batch_set([keys[i] for i in arg], [pages[i] for i in arg]))
            elif op == "get":
                t = torch.zeros_like(pages[arg])
                r = b.get(keys[arg], t)
                out.append(None if r is None else r.view(torch.int16).tolist())
            else:
                ts = [torch.zeros_like(pages[i]) for i in arg]
                rs = b.batch_get([keys[i] for i in arg], ts)
                out.append([None if r is None else r.view(torch.int16).tolist() for r in rs])
        return out

    assert run(ours) == run(ref)
    for k in keys:   # and the same bytes on disk
        path = tmp_path / "hf" / f"{k}_meta-llama-Llama-3.1-8B_0_1.bin"
        assert path.exists() == ours.exists(k)
        assert not path.exists() or path.read_bytes() == bytes(ours.store.get(k)[1])
    ours.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_sglang_interface_v1_in_place(tmp_path, layout):
    torch = pytest.importorskip("torch", reason="the engines' classes need torch")

    HiCacheFile, _, HiCacheStorageConfig, _ = _sglang()
    from mcf.bucket.engines.sglang import BucketHiCacheStorage

    ours = BucketHiCacheStorage(_sg_config(HiCacheStorageConfig, {"root": str(tmp_path), "interface_v1": 1}))
    ref = HiCacheFile(_sg_config(HiCacheStorageConfig, {"file_storage_path": str(tmp_path / "hf")}))
    pool = _HostPool(layout)
    ours.register_mem_pool_host(pool)
    keys = [f"{i:064x}" for i in range(3)]
    src = torch.arange(0, 12)                                     # pages 0, 1, 2 of the pool
    assert ours.batch_set_v1(keys, src) == [True] * 3
    for i, k in enumerate(keys):   # a v1 page holds the flat data page, as HiCacheFile stores it
        ref.set(k, pool.get_data_page(4 * i, flat=True))
        assert bytes(ours.store.get(k)[1]) == (tmp_path / "hf" / f"{k}_meta-llama-Llama-3.1-8B_0_1.bin").read_bytes()
    stored = [pool.get_data_page(4 * i).clone() for i in range(3)]
    untouched = pool.get_data_page(20).clone()
    dst = torch.arange(16, 28)                                    # into pages 4, 5, 6
    assert ours.batch_get_v1(keys[:1] + [f"{9:064x}"] + keys[2:], dst) == [True, False, True]
    assert torch.equal(pool.get_data_page(16), stored[0]) and torch.equal(pool.get_data_page(24), stored[2])
    assert torch.equal(pool.get_data_page(20), untouched)
    assert ours.batch_get_v1(keys, torch.arange(0, 5)) == [False] * 3     # indices that are not whole pages
    ours.close()


# -- LMCache ------------------------------------------------------------------------------------------

def _lmcache():
    pytest.importorskip("torch", reason="LMCache's classes need torch")
    try:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend
    except ImportError as exc:
        pytest.skip(f"LMCache does not import here ({exc}): the pinned engines: tools/kv_engines.txt")
    return CacheEngineKey, LMCacheEngineConfig, LMCacheMetadata, LocalCPUBackend, RemoteBackend


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lmcache_round_trips_kv_2ltd_chunks_through_its_serde(tmp_path, dtype):
    """LMCache's own RemoteBackend, made from the documented YAML, stores and reads KV_2LTD chunks
    byte-exact through the plugin; exists, batched contains and list answer from the bucket."""
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(_with_root(_doc_file("lmcache.yaml"), tmp_path / "mcb").replace("chunk_size: 256",
                                                                                   "chunk_size: 16"))
    _lmcache_round_trip(cfg, dtype)


def test_lmcache_round_trips_through_the_server(tmp_path, monkeypatch):
    """The same through `mcf bucket serve`: the documented server YAML (its url), the token from
    MCF_BUCKET_TOKEN; the chunks land in the served bucket's pages area."""
    _lmcache()
    from _bucket_server import serve

    from mcf.bucket.pages import PageStore

    token = "lmcache-test-token-0123456789abcdef"
    PageStore(tmp_path / "mcb", "warmup").close()
    with serve(tmp_path / "mcb", token, "--no-access-log") as (base, _proc):
        cfg = tmp_path / "lmcache.yaml"
        cfg.write_text(_doc_file("lmcache-server.yaml").replace("http://127.0.0.1:8765", base)
                       .replace("chunk_size: 256", "chunk_size: 16"))
        monkeypatch.setenv("MCF_BUCKET_TOKEN", token)
        _lmcache_round_trip(cfg, "bfloat16")
    with PageStore(tmp_path / "mcb", "lmcache", create=False) as local:
        assert len(local.keys()) == 2


def _lmcache_round_trip(cfg, dtype):
    torch = pytest.importorskip("torch", reason="the engines' classes need torch")

    CacheEngineKey, LMCacheEngineConfig, LMCacheMetadata, LocalCPUBackend, RemoteBackend = _lmcache()
    tdtype = getattr(torch, dtype)
    config = LMCacheEngineConfig.from_file(str(cfg))
    meta = LMCacheMetadata(model_name="meta-llama/Llama-3.1-8B", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=tdtype, kv_shape=(2, 2, 16, 2, 8), chunk_size=16)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    objs = []
    try:
        cpu = LocalCPUBackend(config, meta, dst_device="cpu")
        backend = RemoteBackend(config, meta, loop, cpu, "cpu", plugin_name="mcf")
        keys = [CacheEngineKey("meta-llama/Llama-3.1-8B", 1, 0, h, tdtype) for h in (11, -22, 33)]
        for k in keys[:2]:
            obj = cpu.allocate(torch.Size([2, 2, 16, 16]), tdtype)
            obj.tensor.copy_(torch.randn(2, 2, 16, 16).to(tdtype))
            objs.append(obj)
            assert not backend.contains(k)
            backend.submit_put_task(k, obj).result(timeout=30)
        assert [backend.contains(k) for k in keys] == [True, True, False]
        assert backend.batched_contains(keys) == 2
        for k, obj in zip(keys, objs):
            got = backend.get_blocking(k)
            assert got.tensor.dtype == tdtype and got.tensor.shape == obj.tensor.shape
            assert got.tensor.view(torch.int16).tolist() == obj.tensor.view(torch.int16).tolist()
            got.ref_count_down()
        assert backend.get_blocking(keys[2]) is None
        listed = asyncio.run_coroutine_threadsafe(backend.connection.list(), loop).result(timeout=30)
        assert sorted(listed) == sorted(k.to_string() for k in keys[:2])
        backend.close()
    finally:
        for obj in objs:
            obj.ref_count_down()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def test_lmcache_plugin_options_are_checked():
    from mcf.bucket.engines.lmcache import plugin_name_of, plugin_options
    from mcf.errors import InvalidArgumentError

    extra = {"remote_storage_plugin.mcf.module_path": "mcf.bucket.engines.lmcache",
             "remote_storage_plugin.mcf.class_name": "BucketConnector", "remote_storage_plugin.mcf.rooot": "/x"}
    assert plugin_name_of(extra) == "mcf"
    with pytest.raises(InvalidArgumentError, match="rooot"):
        plugin_options(extra, "mcf")
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        plugin_name_of({})


# -- vLLM ---------------------------------------------------------------------------------------------

def _vllm():
    try:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
        from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError as exc:
        pytest.skip(f"vLLM's offloading tiers do not import here ({exc}): the pinned engines: "
                    "tools/kv_engines.txt")
    return LookupResult, ReqContext, make_offload_key, SecondaryTierManager, TransferJob, SecondaryTierFactory


def test_vllm_tier_through_the_cpu_memoryview(tmp_path):
    LookupResult, ReqContext, make_offload_key, SecondaryTierManager, TransferJob, SecondaryTierFactory = _vllm()
    config = json.loads(_with_root(_doc_file("vllm-kv-transfer.json"), tmp_path))
    (tier_config,) = config["kv_connector_extra_config"]["secondary_tiers"]
    cpu = np.zeros((8, 8192), np.uint8)
    tier = SecondaryTierFactory.create_secondary_tier(tier_config, memoryview(cpu), None)
    try:
        assert isinstance(tier, SecondaryTierManager) and tier.store.namespace == "vllm-model-8192"
        rc = ReqContext(req_id="r")
        keys = [make_offload_key(bytes([i]) * 32, g) for i, g in ((1, 0), (2, 0), (3, 1))]
        cpu[:3] = np.random.default_rng(0).integers(0, 255, (3, 8192), dtype=np.uint8)
        assert [tier.lookup(k, rc) for k in keys] == [LookupResult.MISS] * 3
        tier.submit_store(TransferJob(job_id=1, keys=keys[:2], chunk_ids=np.array([0, 1]), is_promotion=False,
                                      req_context=rc))
        tier.drain_jobs()
        (done,) = tier.get_finished_jobs()
        assert done.job_id == 1 and done.success and done.transfer_bytes == 2 * 8192
        assert [tier.lookup(k, rc) for k in keys] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
        tier.submit_load(TransferJob(job_id=2, keys=keys, chunk_ids=np.array([5, 6, 7]), is_promotion=True,
                                     req_context=rc))
        tier.drain_jobs()
        (done,) = tier.get_finished_jobs()
        assert not done.success and tuple(done.successful_keys) == tuple(keys[:2])
        assert (cpu[5] == cpu[0]).all() and (cpu[6] == cpu[1]).all() and not cpu[7].any()
        assert list(tier.get_finished_jobs()) == [] and not tier.has_pending_work()
    finally:
        tier.shutdown()


def test_plugins_import_without_their_engines():
    """Each plugin module imports everywhere; without its engine, making the plugin raises
    MissingDependencyError naming the engine."""
    import subprocess
    import sys

    code = ("import sys\nsys.path[:] = [p for p in sys.path if 'kvengines' not in p]\n"
            "for m in ('sglang', 'lmcache', 'vllm'): sys.modules[m] = None\n"
            "import mcf.bucket.engines.sglang as s, mcf.bucket.engines.lmcache as l, mcf.bucket.engines.vllm as v\n"
            "from mcf import MissingDependencyError\n"
            "for cls, pkg in ((s.BucketHiCacheStorage, 'sglang'), (l.BucketConnector, 'lmcache'), "
            "(v.BucketTier, 'vllm')):\n"
            "    try:\n        cls(None, None, None, root='x') if pkg == 'vllm' else cls(None, None, None) "
            "if pkg == 'lmcache' else cls(None)\n    except MissingDependencyError as e:\n"
            "        assert e.package == pkg, e\n    else:\n        raise SystemExit(cls)\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
