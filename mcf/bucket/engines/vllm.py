"""A vLLM offloading secondary tier that keeps its chunks in a bucket's pages.

vLLM's offloading connector with the tiering spec, one secondary tier of this class::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 10737418240,
        "secondary_tiers": [{"type": "BucketTier", "module_path": "mcf.bucket.engines.vllm",
                             "root": "/data/mcb"}]}}'

vLLM's ``SecondaryTierFactory`` imports the class (``type`` is the class name, ``module_path`` the
module) and makes it with ``(offloading_spec=, primary_kv_view=, tier_type=, backpressure_detector=)``
and the tier's other keys.  The tier runs in the scheduler process and sees the CPU (primary) tier
only through ``primary_kv_view``, a memoryview whose first stride is one chunk's bytes: a store copies
chunk ``chunk_ids[i]`` of that view into a page, a load reads a page into it.  Keys are vLLM's
``OffloadKey`` (its 32-byte block hash and the KV cache group's index, 4 bytes big-endian), stored as
their 72 hex digits.  Stores and loads run on the tier's own threads; ``get_finished_jobs`` reports
them, a load that misses part way keeps the chunks before the first miss (``successful_keys``).

Tier keys besides vLLM's: ``root`` (the bucket's directory; required), ``namespace`` (default:
``vllm-<model>-<chunk bytes>``, so chunks of another model or chunk size never mix), ``ttl``,
``durable``, ``verify``, ``warm_budget_bytes`` (default 0), ``threads`` (default 4).
"""

from __future__ import annotations

import hashlib
import queue
import re
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mcf.bucket.engines import engine_class, require_engine
from mcf.bucket.pages import PageStore

__all__ = ["BucketTier", "default_namespace", "key_name"]

_FEATURE = "the vLLM secondary tier (mcf.bucket.engines.vllm)"
SecondaryTierManager = engine_class("vllm.v1.kv_offload.tiering.base", "SecondaryTierManager",
                                    feature=_FEATURE, package="vllm")
Medium = engine_class("vllm.v1.kv_offload.base", "Medium", feature=_FEATURE, package="vllm")


def key_name(key: bytes) -> str:
    """An ``OffloadKey`` (block hash + 4-byte group index) as the page's key: its bytes in hex."""
    return bytes(key).hex()


def default_namespace(offloading_spec: Any, chunk_bytes: int) -> str:
    """``vllm-<model>-<chunk bytes>``: chunks of one model and one chunk shape share a namespace."""
    model = "model"
    with_model = getattr(getattr(offloading_spec, "vllm_config", None), "model_config", None)
    if with_model is not None and getattr(with_model, "model", None):
        model = re.sub(r"[^A-Za-z0-9._-]", "-", str(with_model.model)).strip("-.") or "model"
    ns = f"vllm-{model}-{chunk_bytes}"
    if len(ns) > 128:
        ns = ns[:111] + "-" + hashlib.sha256(ns.encode()).hexdigest()[:16]
    return ns


class BucketTier(SecondaryTierManager):
    """vLLM's ``SecondaryTierManager`` over a bucket's pages (see the module docstring)."""

    medium = getattr(Medium, "STORAGE", None)  # hits are reported as from disk

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str, *, root: str,
                 namespace: str | None = None, ttl: float | None = None, durable: bool = False,
                 verify: bool = True, warm_budget_bytes: int = 0, threads: int = 4,
                 backpressure_detector: Any = None, **_vllm: Any) -> None:
        require_engine(self)
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        self._chunk = primary_kv_view.strides[0]
        self._view = primary_kv_view.cast("B") if primary_kv_view.format != "B" or primary_kv_view.ndim != 1 \
            else primary_kv_view
        self.store = PageStore(root, namespace or default_namespace(offloading_spec, self._chunk), ttl=ttl,
                               durable=durable, verify=verify, warm_budget_bytes=warm_budget_bytes, threads=1)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mcf-vllm-tier")
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()

    def _slot(self, chunk_id: Any) -> memoryview:
        start = int(chunk_id) * self._chunk
        return self._view[start:start + self._chunk]

    # -- lookups -------------------------------------------------------------------------------------
    def lookup(self, key: bytes, req_context: Any) -> Any:
        from vllm.v1.kv_offload.base import LookupResult

        return LookupResult.HIT if self.store.exists(key_name(key)) else LookupResult.MISS

    def on_new_request(self, req_context: Any) -> Any:
        from vllm.v1.kv_offload.base import RequestOffloadingContext

        return RequestOffloadingContext()

    # -- jobs ----------------------------------------------------------------------------------------
    def _submit(self, job: Any, work: Any) -> None:
        with self._idle:
            self._pending += 1

        def run() -> None:
            from vllm.v1.kv_offload.tiering.base import JobResult

            t0 = time.monotonic()
            try:
                ok, done = work()
            except Exception:  # an I/O failure the store did not turn into a miss: the job failed
                ok, done = False, None
            result = JobResult(job_id=job.job_id, success=ok, transfer_time=time.monotonic() - t0,
                               transfer_bytes=len(list(job.keys)) * self._chunk if ok else None,
                               successful_keys=done)
            self._finished.put(result)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

        self._pool.submit(run)

    def submit_store(self, job_metadata: Any) -> None:
        keys = [key_name(k) for k in job_metadata.keys]
        slots = [self._slot(c) for c in job_metadata.chunk_ids]

        def work() -> tuple[bool, Any]:
            return all(self.store.put_many(keys, slots)), None

        self._submit(job_metadata, work)

    def submit_load(self, job_metadata: Any) -> None:
        raw = list(job_metadata.keys)
        keys = [key_name(k) for k in raw]
        slots = [self._slot(c) for c in job_metadata.chunk_ids]

        def work() -> tuple[bool, Any]:
            for i, (k, s) in enumerate(zip(keys, slots)):
                if not self.store.get_into(k, s):
                    return False, (tuple(raw[:i]) if i else None)
            return True, None

        self._submit(job_metadata, work)

    def get_finished_jobs(self) -> Iterable[Any]:
        out = []
        while True:
            try:
                out.append(self._finished.get_nowait())
            except queue.Empty:
                return out

    def has_pending_work(self) -> bool:
        return self._pending > 0

    def drain_jobs(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()
