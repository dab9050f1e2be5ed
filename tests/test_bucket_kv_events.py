"""KV events (mcf.bucket.kv_events): what a bucket publishes over ZMQ, decoded with msgpack alone and, where
vLLM can be imported, with vLLM's own msgspec event classes; the replay socket; the parent chain."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

pytest.importorskip("zmq", reason="KV events need pyzmq (the server extra)")
msgpack = pytest.importorskip("msgpack", reason="KV events need msgpack (the server extra)")
import zmq  # noqa: E402

from mcf.bucket import Bucket  # noqa: E402
from mcf.bucket.keys import vllm_block_hashes, vllm_event_hash  # noqa: E402
from mcf.bucket.kv_events import END_SEQ, KVEventPublisher  # noqa: E402
from mcf.errors import InvalidArgumentError  # noqa: E402

BS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layers(n: int):
    return [(np.ones((2, n, 8), np.float32), np.ones((2, n, 8), np.float32))]


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def replay(endpoint: str, start: int = 0) -> list[tuple[bytes, int, bytes]]:
    """Every kept batch from ``start`` on, through the replay socket, as (topic, seq, payload)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        s.connect(endpoint)
        s.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        for _ in range(100_000):
            frames = s.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4
            _, topic, seq, payload = frames
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
        raise AssertionError("no end marker")
    finally:
        s.close()
        ctx.term()


def events(batches) -> list[tuple[str, dict]]:
    """(model from the topic, event) for every event of the batches, checking the batch shape."""
    out = []
    for topic, _, payload in batches:
        ts, evs, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and rank == 0
        kv, addr, model = topic.decode().split("@", 2)
        assert kv == "kv"
        out += [(model, e) for e in evs]
    return out


@pytest.fixture
def pub(tmp_path):
    clock = Clock()
    b = Bucket(tmp_path / "b", clock=clock)
    made = []

    def make(**kw):
        port, rport = free_port(), free_port()
        p = KVEventPublisher(b, f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}",
                             block_size=BS, **kw)
        made.append(p)
        assert p.wait_ready()
        return p

    yield b, clock, make
    for p in made:
        p.close()
    b.close()


def test_stored_removed_and_the_parent_chain(pub):
    b, _, make = pub
    p = make()
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**31, 100)                                  # 6 full blocks and 4 tokens more
    c = np.concatenate([a[:40], rng.integers(0, 2**31, 40)])          # shares 2 full blocks with a
    ca = b.ingest("m1", layers(100), token_ids=a)["context_id"]
    cc = b.ingest("m1", layers(80), token_ids=c)["context_id"]
    b.ingest("m1", layers(50), content="from text: no token ids, no blocks")
    assert p.flush()
    ha = [vllm_event_hash(d) for d in vllm_block_hashes(a, block_size=BS)]
    hc = [vllm_event_hash(d) for d in vllm_block_hashes(c, block_size=BS)]
    assert ha[:2] == hc[:2] and ha[2] != hc[2]
    evs = events(replay(p.replay_endpoint))
    assert [e["type"] for _, e in evs] == ["BlockStored", "BlockStored"]
    (m1, s1), (m2, s2) = evs
    assert m1 == m2 == "m1"
    assert s1 == {"type": "BlockStored", "block_hashes": ha, "parent_block_hash": None,
                  "token_ids": a[:96].tolist(), "block_size": BS, "lora_id": None, "medium": "STORAGE",
                  "lora_name": None}
    # only the new blocks, chained to the last shared one, with exactly their tokens
    assert s2["block_hashes"] == hc[2:] and s2["parent_block_hash"] == ha[1]
    assert s2["token_ids"] == c[32:80].tolist()
    # removal: only what no other context holds, deepest first
    last = p.last_seq
    b.delete(ca)
    assert p.flush()
    (_, r1), = events(replay(p.replay_endpoint, last + 1))
    assert r1 == {"type": "BlockRemoved", "block_hashes": ha[2:][::-1], "medium": "STORAGE"}
    b.delete(cc)
    assert p.flush()
    (_, r2), = events(replay(p.replay_endpoint, last + 2))
    assert r2["block_hashes"] == hc[::-1]


def test_every_parent_was_announced_before(pub):
    """A subscriber rebuilding the chains never sees a parent it does not know."""
    b, _, make = pub
    p = make()
    rng = np.random.default_rng(1)
    base = rng.integers(0, 50_000, 64)
    for k in range(6):
        toks = np.concatenate([base[:16 * (k % 4)], rng.integers(0, 50_000, 20 + 7 * k)])
        b.ingest("m", layers(toks.size), token_ids=toks)
    assert p.flush()
    known: set = set()
    for _, e in events(replay(p.replay_endpoint)):
        assert e["type"] == "BlockStored"
        assert e["parent_block_hash"] is None or e["parent_block_hash"] in known
        assert len(e["token_ids"]) == BS * len(e["block_hashes"])
        assert not known & set(e["block_hashes"])  # announced once
        known |= set(e["block_hashes"])


def test_expiry_removes_blocks_when_the_ttl_passes(pub):
    b, clock, make = pub
    p = make()
    toks = np.arange(40)
    cid = b.ingest("m", layers(40), token_ids=toks, ttl=60)["context_id"]
    b.ingest("m", layers(32), token_ids=np.arange(32) + 1000, ttl=60, pinned=True)
    assert p.flush()
    first = p.last_seq
    clock.t += 61                                   # expired: no longer served, before any gc
    for _ in range(400):
        if p.last_seq > first:
            break
        p.flush(timeout=0.05)
    (_, r), = events(replay(p.replay_endpoint, first + 1))
    assert r["type"] == "BlockRemoved"
    assert r["block_hashes"] == [vllm_event_hash(d) for d in vllm_block_hashes(toks, block_size=BS)][::-1]
    assert b.gc() == [cid]                            # context.expired: nothing more to remove
    assert p.flush()
    assert p.last_seq == first + 1


def test_start_up_clears_then_announces_the_bucket(pub):
    b, _, make = pub
    b.ingest("m-a", layers(32), token_ids=np.arange(32))
    b.ingest("m-b", layers(20), token_ids=np.arange(20))
    b.ingest("m-b", layers(20), content="text")
    p = make()
    assert p.flush()
    got = [(m, e["type"]) for m, e in events(replay(p.replay_endpoint))]
    assert got[:2] == [("m-a", "AllBlocksCleared"), ("m-b", "AllBlocksCleared")]
    assert sorted(got[2:]) == [("m-a", "BlockStored"), ("m-b", "BlockStored")]


def test_bytes_hashes_and_a_seed(pub):
    b, _, make = pub
    p = make(int_hashes=False, seed="7")
    b.ingest("m", layers(16), token_ids=np.arange(16))
    assert p.flush()
    (_, e), = events(replay(p.replay_endpoint))
    assert e["block_hashes"] == vllm_block_hashes(np.arange(16), block_size=BS, seed="7")


def test_live_subscriber_and_replay_fill_the_gap(pub):
    """A subscriber gets batches as they are published, numbered from 0; what it missed before it joined
    comes from the replay socket."""
    b, _, make = pub
    p = make()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(p.endpoint)
    try:
        got = []
        for k in range(100):  # until the subscription has reached the publisher (bounded)
            b.ingest("m", layers(16), token_ids=np.arange(16) + 16 * k)
            try:
                got.append(sub.recv_multipart())
                break
            except zmq.Again:
                continue
        assert got, "the subscriber never received a batch"
        topic, seq, payload = got[0]
        seq = int.from_bytes(seq, "big")
        assert topic == f"kv@{p.address}@m".encode()
        missed = replay(p.replay_endpoint)
        assert [s for _, s, _ in missed][:seq + 1] == list(range(seq + 1))
        assert missed[seq][2] == payload
    finally:
        sub.close()
        ctx.term()


def test_exposure_and_bad_endpoints(tmp_path):
    with Bucket(tmp_path / "b") as b:
        for ep in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.1.2.3:5557"):
            with pytest.raises(InvalidArgumentError, match="token ids"):
                KVEventPublisher(b, ep)
        for ep in ("udp://127.0.0.1:1", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:x", 5557):
            with pytest.raises(InvalidArgumentError, match="endpoint"):
                KVEventPublisher(b, ep)
        with pytest.raises(InvalidArgumentError, match="block_size"):
            KVEventPublisher(b, f"tcp://127.0.0.1:{free_port()}", block_size=0)


def test_vllm_decodes_every_batch(pub):
    """vLLM's own msgspec classes decode what the bucket publishes (skipped where vLLM cannot be imported:
    tools/kv_golden.py's environment has it)."""
    kv = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM is not installed (optional: "
                             "python tools/kv_golden.py --venv DIR --keep makes an environment with it)")
    msgspec = pytest.importorskip("msgspec", reason="vLLM's event classes are msgspec structs (in the tokenize "
                                  "extra)")
    b, _, make = pub
    b.ingest("m", layers(20), token_ids=np.arange(20))
    p = make()
    a = np.arange(100, 164)
    cid = b.ingest("m", layers(64), token_ids=a)["context_id"]
    b.ingest("m", layers(70), token_ids=np.concatenate([a[:48], [1, 2, 3, 4, 5, 6] * 3 + [9, 9, 9, 9]]))
    b.delete(cid)
    assert p.flush()
    dec = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
    batches = [dec.decode(payload) for _, _, payload in replay(p.replay_endpoint)]
    evs = [e for bt in batches for e in bt.events]
    assert all(bt.data_parallel_rank == 0 for bt in batches)
    assert [type(e).__name__ for e in evs] == ["AllBlocksCleared", "BlockStored", "BlockStored", "BlockStored",
                                               "BlockRemoved"]
    stored = evs[2]
    assert isinstance(stored, kv.BlockStored) and stored.medium == kv.MEDIUM_STORAGE
    assert stored.block_hashes == [vllm_event_hash(d) for d in vllm_block_hashes(a, block_size=BS)]
    assert evs[3].parent_block_hash == stored.block_hashes[2]
    assert evs[3].token_ids == [1, 2, 3, 4, 5, 6] * 2 + [1, 2, 3, 4]
    assert evs[4].block_hashes == [stored.block_hashes[3]]
    # and the encoding is vLLM's own, byte for byte
    enc = msgspec.msgpack.Encoder()
    for (_, _, payload), bt in zip(replay(p.replay_endpoint), batches):
        assert enc.encode(bt) == payload


def test_encoding_is_vllms_bytes():
    """The bytes vLLM 0.33's msgspec encoder writes for these events (captured from it), without vLLM: a
    BlockStored map has a map16 header (msgspec's choice for structs of more than 15 fields)."""
    from mcf.bucket.kv_events import all_blocks_cleared, block_removed, block_stored, encode_batch

    vllm_stored = bytes.fromhex(
        "de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739101b1706172656e745f626c6f636b5f6861"
        "7368c0a9746f6b656e5f6964739101aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da753544f524147"
        "45a96c6f72615f6e616d65c0")
    vllm_removed = bytes.fromhex("83a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739101a66d6564"
                                 "69756da753544f52414745")
    vllm_cleared = bytes.fromhex("81a474797065b0416c6c426c6f636b73436c6561726564")
    got = encode_batch([block_stored([1], None, [1], 16), block_removed([1]), all_blocks_cleared()], ts=1.5)
    assert got == b"\x93\xcb\x3f\xf8" + b"\0" * 6 + b"\x93" + vllm_stored + vllm_removed + vllm_cleared + b"\x00"
    assert encode_batch([], ts=1.5) == bytes.fromhex("93cb3ff80000000000009000")


def test_mcf_bucket_serve_kv_events(tmp_path):
    """``mcf bucket serve --kv-events``: the contexts stored before it started, then one uploaded through
    the REST API and one deleted through it, as KV events under the server's address."""
    import io
    import json
    import urllib.request

    from _bucket_server import serve

    with Bucket(tmp_path / "b") as b:
        old = b.ingest("m", layers(20), token_ids=np.arange(20))["context_id"]
    ep, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with serve(tmp_path / "b", None, "--kv-events", ep, "--kv-events-replay", rep,
               "--kv-events-block-size", "4") as (base, _):
        bio = io.BytesIO()
        np.savez(bio, k=np.ones((1, 2, 9, 4), np.float32), v=np.ones((1, 2, 9, 4), np.float32))
        req = urllib.request.Request(base + "/mcrp/v1/contexts?model_id=m&token_ids=0,1,2,3,7,7,7,7,7", method="POST",
                                     data=bio.getvalue(), headers={"Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["status"] == "success"
        req = urllib.request.Request(f"{base}/mcrp/v1/contexts/{old}", method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()
        for _ in range(200):  # the events follow the answers (bounded wait)
            got = events(replay(rep))
            if len(got) == 4:
                break
            time.sleep(0.05)
        port = base.rsplit(":", 1)[1]
        assert {t.decode() for t, _, _ in replay(rep)} == {f"kv@127.0.0.1:{port}@m"}
    h20 = [vllm_event_hash(d) for d in vllm_block_hashes(np.arange(20), block_size=4)]
    h9 = [vllm_event_hash(d) for d in vllm_block_hashes([0, 1, 2, 3, 7, 7, 7, 7, 7], block_size=4)]
    assert [e for _, e in got] == [
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": h20, "parent_block_hash": None, "token_ids": list(range(20)),
         "block_size": 4, "lora_id": None, "medium": "STORAGE", "lora_name": None},
        {"type": "BlockStored", "block_hashes": h9[1:], "parent_block_hash": h20[0], "token_ids": [7] * 4,
         "block_size": 4, "lora_id": None, "medium": "STORAGE", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": h20[1:][::-1], "medium": "STORAGE"}]


def test_serve_refuses_an_exposed_events_address(tmp_path):
    from mcf.apps.bucket_server import serve

    with pytest.raises(InvalidArgumentError, match="token ids"):
        serve(tmp_path / "b", kv_events="tcp://0.0.0.0:5557")
    with pytest.raises(InvalidArgumentError, match="replay socket needs"):
        serve(tmp_path / "b", kv_events_replay=f"tcp://127.0.0.1:{free_port()}")


def test_a_full_queue_makes_it_announce_everything_again(pub):
    """More operations waiting than max_queue: the bucket is not blocked; the publisher clears and announces
    the whole bucket again, so a subscriber ends with the right blocks."""
    import threading

    b, _, make = pub
    real, gate = b.token_ids, threading.Event()

    def held(cid, **kw):  # the publisher is stuck until the test lets it go
        assert gate.wait(30)
        return real(cid, **kw)

    b.token_ids = held
    p = make(max_queue=2)
    want = set()
    for k in range(8):
        toks = np.arange(16) + 100 * k
        b.ingest("m", layers(16), token_ids=toks)
        want |= {vllm_event_hash(d) for d in vllm_block_hashes(toks, block_size=BS)}
    gate.set()
    assert p.flush()
    evs = [e for _, e in events(replay(p.replay_endpoint))]
    clears = [i for i, e in enumerate(evs) if e["type"] == "AllBlocksCleared"]
    assert clears  # the bucket was empty at start-up: these come from falling behind
    last_clear = clears[-1]
    after = evs[last_clear + 1:]
    assert {e["type"] for e in after} == {"BlockStored"}
    assert {h for e in after for h in e["block_hashes"]} == want


def test_a_rebuild_clears_and_announces_what_is_on_disk(pub):
    """A context removed by hand leaves the bucket at the next rebuild: its blocks are no longer announced."""
    import shutil

    b, _, make = pub
    p = make()
    gone = b.ingest("m", layers(16), token_ids=np.arange(16))["context_id"]
    b.ingest("m", layers(16), token_ids=np.arange(16) + 50)
    assert p.flush()
    first = p.last_seq
    shutil.rmtree(b.root / "contexts" / gone)
    b.rebuild()
    assert p.flush()
    evs = [e for _, e in events(replay(p.replay_endpoint, first + 1))]
    assert [e["type"] for e in evs] == ["AllBlocksCleared", "BlockStored"]
    assert evs[1]["token_ids"] == list(range(50, 66))


def test_hostile_replay_clients_do_not_stop_the_publisher(pub):
    """Malformed replay requests (wrong frame counts, an oversized sequence number) are ignored, and a peer
    sending a large message is disconnected by ZMQ before it is buffered (MAXMSGSIZE on both sockets); a
    well-formed replay still answers, and publishing goes on."""
    from mcf.bucket.kv_events import MAX_INBOUND_BYTES

    b, _, make = pub
    p = make()
    assert p._replay.getsockopt(zmq.MAXMSGSIZE) == MAX_INBOUND_BYTES == p._pub.getsockopt(zmq.MAXMSGSIZE)
    b.ingest("m", layers(32), token_ids=np.arange(32))
    assert p.flush()
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    try:
        bad.connect(p.replay_endpoint)
        bad.send_multipart((b"",))                                   # too few frames
        bad.send_multipart((b"", b"\x00" * 100, b"extra"))           # too many
        bad.send_multipart((b"", b"\xff" * 100))                     # a sequence number past any kept
        bad.send_multipart((b"", b"x" * (4 * MAX_INBOUND_BYTES)))    # larger than any request: disconnected
        got = replay(p.replay_endpoint)
    finally:
        bad.close()
        ctx.term()
    assert [e["type"] for _, e in events(got)] == ["BlockStored"]        # an empty bucket at start: no clear
    b.ingest("m", layers(48), token_ids=np.arange(48))
    assert p.flush()
    assert [e["type"] for _, e in events(replay(p.replay_endpoint))][-1] == "BlockStored"
