"""KV events as vLLM publishes them, for what a bucket stores: a ZMQ PUB socket that routers and indexers
(llm-d's KV-cache indexer, Dynamo's router, anything reading vLLM's ``--kv-events-config``) subscribe to,
so they know which prefixes the bucket holds (docs/bucket.md §7.2).

The wire format is vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``), byte for byte:

* each message is three frames: the topic ``kv@<host>:<port>@<model_id>``, an 8-byte big-endian sequence
  number (one counter for the publisher, from 0), and a msgpack batch ``[ts, [event, ...], dp_rank]``;
* events are maps with ``"type"`` first, as msgspec writes vLLM's tagged structs: ``BlockStored``
  (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
  ``lora_name``), ``BlockRemoved`` (``block_hashes``, ``medium``) and ``AllBlocksCleared``; fields left
  at their default are left out, as ``omit_defaults`` does;
* a ROUTER replay socket answers a request ``[identity, b"", start_seq (8 bytes big-endian)]`` with
  every kept batch from ``start_seq`` on, ``[identity, b"", topic, seq, payload]`` each, then the end
  marker ``[identity, b"", b"", -1 as 8 signed bytes, b""]``.

What is announced, and why so:

* **A context ingested with token ids is a run of vLLM blocks.**  Its full blocks of ``block_size``
  tokens (vLLM's ``--block-size``, 16 by default) hash as vLLM hashes them with ``sha256_cbor``
  (:func:`mcf.bucket.keys.vllm_block_hashes`, seed from ``PYTHONHASHSEED`` as in vLLM), so a router
  matching a prompt's block hashes finds them; a trailing partial block is not announced (vLLM caches
  only full blocks).  The hashes are sent in vLLM's default 64-bit form (``int_hashes``).
* **BlockStored carries only what is new.**  Blocks are counted per model across contexts: two contexts
  sharing a prefix share its blocks.  A context's ``BlockStored`` lists the blocks after the longest
  prefix already announced, with the last announced block as ``parent_block_hash`` (None from the first
  block), and the token ids of exactly those blocks, as vLLM announces newly cached blocks.
* **BlockRemoved when no context holds a block any more**: on a delete, on a context's expiry (at its
  ``expires_at``, not only when ``gc`` removes it: it stops being served then), and when ``gc`` removes
  it.  The blocks are listed deepest first.  The bucket never evicts for space (the warm and hot tiers
  only drop copies of what stays on disk), so there is no other removal.
* **AllBlocksCleared, then the whole bucket, when the publisher starts**, per model: a subscriber drops
  what an earlier run announced and learns what is stored now.  The same happens after
  :meth:`Bucket.rebuild` (which re-reads the bucket from disk: contexts removed or restored by hand) and
  if more than ``max_queue`` bucket operations wait for the publisher (it re-announces rather than block
  the bucket).
* The medium is ``"STORAGE"``; ``lora_id``/``lora_name`` are None (a context has no adapter).

Threads: the bucket's callbacks (any thread) only queue the context id; one thread reads the token ids
(:meth:`Bucket.token_ids`, checked against the content hash), hashes, and owns both sockets (ZMQ
sockets are not thread-safe).  Scope: the operations of this process's :class:`Bucket` (as the SSE
stream of §7.1); another process writing the same directory is seen at the next start.
"""

from __future__ import annotations

import collections
import heapq
import queue
import threading
import time
from typing import Any

from mcf._core.args import integer
from mcf._core.optional import require
from mcf.bucket._json import parse_iso
from mcf.bucket.keys import vllm_block_hashes, vllm_event_hash
from mcf._core.urls import is_loopback_host
from mcf.errors import ContextNotFoundError, InvalidArgumentError, MCFError

__all__ = ["KVEventPublisher", "MEDIUM_STORAGE", "END_SEQ", "block_stored", "block_removed", "all_blocks_cleared",
           "encode_batch"]

MEDIUM_STORAGE = "STORAGE"
#: the largest inbound message part a peer may send (subscriptions, replay requests: 8-byte sequence numbers)
MAX_INBOUND_BYTES = 4096
#: the replay socket's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
DEFAULT_MAX_QUEUE = 100_000
_POLL_MS = 50


def block_stored(block_hashes: list, parent_block_hash: Any, token_ids: list[int], block_size: int, *,
                 medium: str | None = MEDIUM_STORAGE, lora_id: int | None = None,
                 lora_name: str | None = None) -> dict:
    """vLLM's ``BlockStored`` as msgspec encodes it (a map, ``"type"`` first, no field left at its default)."""
    return {"type": "BlockStored", "block_hashes": block_hashes, "parent_block_hash": parent_block_hash,
            "token_ids": token_ids, "block_size": block_size, "lora_id": lora_id, "medium": medium,
            "lora_name": lora_name}


def block_removed(block_hashes: list, *, medium: str | None = MEDIUM_STORAGE) -> dict:
    """vLLM's ``BlockRemoved`` as msgspec encodes it."""
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": medium}


def all_blocks_cleared() -> dict:
    """vLLM's ``AllBlocksCleared`` as msgspec encodes it."""
    return {"type": "AllBlocksCleared"}


#: each event struct's number of fields with its tag: msgspec writes a struct's map with a map16 header
#: when the struct has more than 15 fields, whatever number it leaves out (a fixmap otherwise)
_STRUCT_FIELDS = {"BlockStored": 16, "BlockRemoved": 6, "AllBlocksCleared": 1}


def _array_head(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def encode_batch(events: list[dict], *, ts: float, data_parallel_rank: int = 0) -> bytes:
    """vLLM's ``KVEventBatch`` (an array-like struct) in msgpack, ``[ts, events, data_parallel_rank]``, byte
    for byte as vLLM's ``msgspec.msgpack.Encoder`` writes it (tests/test_bucket_kv_events.py)."""
    msgpack = require("msgpack", feature="KV events", extra="server")
    pack = msgpack.Packer(use_bin_type=True).pack
    parts = [b"\x93", pack(float(ts)), _array_head(len(events))]
    for e in events:
        n = len(e)
        parts.append(b"\xde" + n.to_bytes(2, "big") if _STRUCT_FIELDS[e["type"]] > 15 else bytes((0x80 | n,)))
        for k, v in e.items():
            parts.append(pack(k))
            parts.append(pack(v))
    parts.append(pack(data_parallel_rank))
    return b"".join(parts)


def _host_port(endpoint: str) -> tuple[str, str]:
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        raise InvalidArgumentError(f"a KV events endpoint is tcp://HOST:PORT, got {str(endpoint)[:80]!r}")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"a KV events endpoint is tcp://HOST:PORT with a port in 1..65535, got "
                                   f"{endpoint[:80]!r}")
    return host, port



class KVEventPublisher:
    """Publishes a :class:`~mcf.bucket.Bucket`'s stored blocks as vLLM's KV events (see the module's docstring).

    ``endpoint``: ``tcp://HOST:PORT`` bound for subscribers to connect to; only a loopback address unless
    ``expose`` (the events carry prompts' token ids, and ZMQ asks nobody for a token), or, with
    ``connect=True``, the address of a subscriber that binds (llm-d's indexer) to connect to.
    ``replay_endpoint``: an optional ``tcp://HOST:PORT`` for the ROUTER replay socket (bound, same rule).
    ``address``: the ``host:port`` in the topics (default: the endpoint's; the server gives its own).
    ``block_size``/``seed``: as vLLM's ``--block-size`` and ``PYTHONHASHSEED``; ``int_hashes``: vLLM's
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (True: 64-bit ints; False: 32-byte digests).
    ``buffer_steps`` batches are kept for replay; ``hwm`` is the PUB socket's high-water mark.
    """

    def __init__(self, bucket: Any, endpoint: str, *, replay_endpoint: str | None = None, address: str | None = None,
                 block_size: int = 16, seed: str | None = None, int_hashes: bool = True, connect: bool = False,
                 expose: bool = False, buffer_steps: int = DEFAULT_BUFFER_STEPS, hwm: int = DEFAULT_HWM,
                 max_queue: int = DEFAULT_MAX_QUEUE, data_parallel_rank: int = 0) -> None:
        self._zmq = require("zmq", feature="KV events", extra="server", package="pyzmq")
        require("msgpack", feature="KV events", extra="server")
        self.block_size = integer(block_size, "block_size", minimum=1)
        buffer_steps = integer(buffer_steps, "buffer_steps", minimum=1)
        hwm = integer(hwm, "hwm", minimum=1)
        max_queue = integer(max_queue, "max_queue", minimum=1)
        self.data_parallel_rank = integer(data_parallel_rank, "data_parallel_rank", minimum=0)
        for name, v in (("int_hashes", int_hashes), ("connect", connect), ("expose", expose)):
            if not isinstance(v, bool):
                raise InvalidArgumentError(f"{name} must be True or False, got {v!r}")
        vllm_block_hashes([], block_size=self.block_size, seed=seed)  # checks the seed
        host, port = _host_port(endpoint)
        for ep, binds in ((endpoint, not connect), (replay_endpoint, True)):
            if ep is None:
                continue
            h, _ = _host_port(ep)
            if binds and not expose and not is_loopback_host(h):
                raise InvalidArgumentError(
                    f"refusing to publish KV events on {ep!r}: they carry the token ids of every prompt stored, "
                    "and a ZMQ socket asks nobody for a token.  Bind a loopback address (tcp://127.0.0.1:PORT), "
                    "or expose it on purpose (expose=True, --kv-events-expose) behind a network policy")
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.address = address if address is not None else f"{host}:{port}"
        self.bucket, self.seed, self.int_hashes = bucket, seed, int_hashes
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._overflow = threading.Event()
        self._buffer: collections.deque = collections.deque(maxlen=buffer_steps)
        self._seq = 0
        # the publisher thread's own state: blocks held per context and per (model, digest)
        self._held: dict[str, tuple[str, list[bytes]]] = {}
        self._refs: dict[tuple[str, bytes], int] = {}
        self._expiry: list[tuple[float, str]] = []
        self._ctx = self._zmq.Context()
        self._pub = self._replay = None
        try:
            self._pub = self._ctx.socket(self._zmq.PUB)
            self._pub.setsockopt(self._zmq.SNDHWM, hwm)
            self._pub.setsockopt(self._zmq.LINGER, 0)
            # inbound messages are subscriptions and replay requests, a few bytes each: a peer sending more is
            # disconnected by ZMQ before it is buffered (a 1 GB "request" would otherwise be held whole)
            self._pub.setsockopt(self._zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
            (self._pub.connect if connect else self._pub.bind)(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(self._zmq.ROUTER)
                self._replay.setsockopt(self._zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.setsockopt(self._zmq.LINGER, 0)
                self._replay.setsockopt(self._zmq.MAXMSGSIZE, MAX_INBOUND_BYTES)
                self._replay.bind(replay_endpoint)
        except self._zmq.ZMQError as exc:
            self._close_sockets()
            raise InvalidArgumentError(f"cannot open the KV events socket {endpoint!r}"
                                       f"{'' if replay_endpoint is None else f' / {replay_endpoint!r}'}: {exc}") \
                from None
        self._running, self._resyncing = True, False
        self._ready = threading.Event()
        self._unsubscribe = bucket.subscribe(self._on_event)
        self._thread = threading.Thread(target=self._run, name="mcf-kv-events", daemon=True)
        self._thread.start()

    # -- any thread --------------------------------------------------------------------------------
    def _on_event(self, event: dict) -> None:
        if event.get("event") == "registry.rebuilt":  # the bucket re-read from disk: announce what is there now
            self._overflow.set()
        elif event.get("event") in ("context.ingested", "context.deleted", "context.expired"):
            try:
                self._queue.put_nowait((event["event"], event.get("context_id")))
            except queue.Full:
                self._overflow.set()  # the thread announces the bucket again instead of blocking this one

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch sent (-1 before the first)."""
        return self._seq - 1

    def wait_ready(self, *, timeout: float = 30.0) -> bool:
        """True once the start-up announcement (AllBlocksCleared and the bucket's blocks) is sent."""
        return self._ready.wait(timeout)

    def flush(self, *, timeout: float = 30.0) -> bool:
        """True once every bucket operation queued so far is published (the queue is empty and handled)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self._ready.is_set() and self._queue.unfinished_tasks == 0 and not self._overflow.is_set()
                    and not self._resyncing):
                return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        """Stop listening to the bucket, send what is queued, and close the sockets."""
        if not self._running:
            return
        self._unsubscribe()
        self._running = False
        self._thread.join(timeout=10)
        self._close_sockets()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    # -- the publisher thread ----------------------------------------------------------------------
    def _run(self) -> None:
        poller = self._zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, self._zmq.POLLIN)
        try:
            self._announce_all()
        finally:
            self._ready.set()
        while True:
            if self._replay is not None and dict(poller.poll(0)):
                self._serve_replay()
            if self._overflow.is_set():
                self._resyncing = True  # before the flag is cleared: flush() waits for the announcement
                self._overflow.clear()
                self._drain()
                self._announce_all()
                self._resyncing = False
            handled = False
            try:
                kind, cid = self._queue.get(timeout=_POLL_MS / 1000)
                handled = True
            except queue.Empty:
                pass
            if handled:
                try:
                    if kind == "context.ingested":
                        if cid not in self._held:  # a context replaced under its id holds the same tokens
                            self._add(cid)
                    else:
                        self._remove(cid)
                finally:
                    self._queue.task_done()
            self._expire()
            if not self._running and self._queue.empty():
                break

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
            self._queue.task_done()

    def _topic(self, model_id: str) -> bytes:
        return f"kv@{self.address}@{model_id}".encode()

    def _send(self, model_id: str, events: list[dict]) -> None:
        payload = encode_batch(events, ts=time.time(), data_parallel_rank=self.data_parallel_rank)
        seq, topic = self._seq, self._topic(model_id)
        self._seq += 1
        try:
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        except self._zmq.ZMQError:
            pass  # a subscriber-less or full socket drops, as PUB does; the replay buffer still has it
        self._buffer.append((seq, topic, payload))

    def _wire(self, digest: bytes) -> Any:
        return vllm_event_hash(digest) if self.int_hashes else digest

    def _announce_all(self) -> None:
        """AllBlocksCleared per model, then every context's blocks (start-up, or after an overflow)."""
        self._held.clear()
        self._refs.clear()
        self._expiry.clear()
        try:
            reg = self.bucket.registry()
        except MCFError:
            return
        for m in reg["models"]:
            self._send(m["model_id"], [all_blocks_cleared()])
        for m in reg["models"]:
            for c in m["contexts"]:
                self._add(c["context_id"])

    def _add(self, cid: str) -> None:
        try:
            meta = self.bucket.lookup(cid)
            toks = self.bucket.token_ids(cid)
        except (MCFError, OSError):  # gone, expired, unreadable, or sealed with a key this bucket lacks
            return
        if toks is None:  # ingested from text: no token ids, no blocks
            return
        model_id = meta["model_id"]
        digests = vllm_block_hashes(toks, block_size=self.block_size, seed=self.seed)
        self._held[cid] = (model_id, digests)
        new_from = len(digests)
        for i, d in enumerate(digests):
            n = self._refs.get((model_id, d), 0)
            if n == 0 and new_from == len(digests):
                new_from = i
            self._refs[(model_id, d)] = n + 1
        exp = meta["timestamps"].get("expires_at")
        if exp is not None and not meta.get("pinned", False):
            heapq.heappush(self._expiry, (parse_iso(exp, self.bucket.registry_path, "expires_at"), cid))
        if new_from < len(digests):
            bs = self.block_size
            parent = self._wire(digests[new_from - 1]) if new_from else None
            self._send(model_id, [block_stored([self._wire(d) for d in digests[new_from:]], parent,
                                               [int(t) for t in toks[new_from * bs:len(digests) * bs]], bs)])

    def _remove(self, cid: str) -> None:
        held = self._held.pop(cid, None)
        if held is None:
            return
        model_id, digests = held
        gone = []
        for d in reversed(digests):
            n = self._refs[(model_id, d)] - 1
            if n:
                self._refs[(model_id, d)] = n
            else:
                del self._refs[(model_id, d)]
                gone.append(self._wire(d))
        if gone:
            self._send(model_id, [block_removed(gone)])

    def _expire(self) -> None:
        """Contexts past their expires_at stop being served: their blocks go (pinned ones stay)."""
        if not self._expiry or self._expiry[0][0] > self.bucket.clock():
            return
        now = self.bucket.clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, cid = heapq.heappop(self._expiry)
            if cid not in self._held:
                continue
            try:
                self.bucket.lookup(cid)  # not expired after all (pinned meanwhile): keep it
            except ContextNotFoundError:
                self._remove(cid)
            except MCFError:
                continue

    def _serve_replay(self) -> None:
        zmq = self._zmq
        for _ in range(64):  # bounded per turn: publishing goes on between requests
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            try:
                for seq, topic, payload in list(self._buffer):
                    if seq >= start_seq:
                        self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload),
                                                    zmq.NOBLOCK)
                self._replay.send_multipart((client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
            except zmq.ZMQError:
                continue  # a client that does not read: its replay is cut short
