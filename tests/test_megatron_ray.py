"""Megatron preparation and reading on a real multi-node Ray cluster: a head and a worker node started
with ``ray start`` as separate processes (one CPU each), sealed in private network/PID namespaces that
the test creates (tests/_ray_cluster.py).  The CLI's ``--ray`` output is byte-identical to the
single-process command; a worker killed mid-job is retried and the output stays byte-identical; a job
that fails leaves no dataset and resumes from its finished chunks; the Datasource and Datasink round-trip
a set of datasets.  Every Ray process is stopped, and the teardown checks that none is left."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import signal
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

import mcf.megatron as mm
from mcf.cli import main

pytest.importorskip("ray.data", reason="Ray is an optional extra: pip install 'mcf-formats[ray]'")
pytest.importorskip("tokenizers", reason="tokenizers is in the test extra")
zstandard = pytest.importorskip("zstandard", reason="zstd inputs need zstandard (test extra)")
from _ray_cluster import ADDRESS, RayCluster, namespace_problem  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    why = namespace_problem()
    if why:
        pytest.skip(f"no private network namespace for the Ray cluster (never run on the host network): {why}")
    c = RayCluster(workers=1, cpus=1)
    try:
        c.start()
        yield c
    finally:
        left = c.stop()
    assert not left, f"processes left after ray stop and the namespace's end: {left}"


@pytest.fixture(scope="module")
def tok(minilm_dir):
    return os.path.join(minilm_dir, "tokenizer.json")


@pytest.fixture(scope="module")
def paragraphs():
    """Real text: the paragraphs of the Python standard library's sources."""
    out = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        try:
            with open(path, encoding="utf-8") as f:
                out += [p.strip() for p in f.read().split("\n\n") if p.strip()]
        except (UnicodeDecodeError, OSError):
            continue
    return out


def write_jsonl(path, docs, key="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({key: d}) + "\n")


def same_files(a, b) -> bool:
    return all(Path(str(a) + ext).read_bytes() == Path(str(b) + ext).read_bytes() for ext in (".idx", ".bin"))


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory, paragraphs, tok):
    """~6 MB of jsonl and its single-process tokenization (--append-eod)."""
    d = tmp_path_factory.mktemp("big")
    docs = (paragraphs * 4)[:60000]
    write_jsonl(d / "big.jsonl", docs)
    assert main(["megatron", "tokenize", str(d / "big.jsonl"), "--tokenizer", tok, "--output-prefix", str(d / "ref"),
                 "--append-eod", "-q"]) == 0
    return d / "big.jsonl", d / "ref"


def cli(cluster, *args, env=None, timeout=300, check=True):
    return cluster.python("-m", "mcf.cli", "megatron", "tokenize", *map(str, args), timeout=timeout, env=env,
                          check=check)


def test_cli_on_the_cluster_equals_single_process(cluster, tmp_path, tok, paragraphs):
    # every input kind in one run: jsonl with sentence lists and blank lines, gzip, zstd, plain text
    docs = paragraphs[:3000] + [["one", "", "two"], "", "Grüße ✓"] + paragraphs[3000:4000]
    write_jsonl(tmp_path / "a.jsonl", docs)
    write_jsonl(tmp_path / "b.jsonl.gz", paragraphs[4000:4500], opener=gzip.open)
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": p}) + "\n" for p in paragraphs[4500:5000]).encode()))
    (tmp_path / "d.txt").write_text("\n".join(p.replace("\n", " ") for p in paragraphs[5000:5600]) + "\n\n",
                                    encoding="utf-8")
    inputs = [tmp_path / n for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.txt")]
    assert main(["megatron", "tokenize", *map(str, inputs), "--tokenizer", tok, "--output-prefix",
                 str(tmp_path / "ref"), "--append-eod", "-q"]) == 0
    r = cli(cluster, *inputs, "--tokenizer", tok, "--output-prefix", tmp_path / "out", "--append-eod",
            "--ray", ADDRESS, "--chunk-size", "96KiB", "-q")
    assert same_files(tmp_path / "out", tmp_path / "ref")
    m = re.search(r"from (\d+) chunks", r.stdout)
    assert m and int(m.group(1)) > 8, r.stdout                      # many tasks over the two nodes
    assert not (tmp_path / "out.shards").exists()
    # the phase breakdown: every phase named, and together they are the run's time
    total = float(re.search(r"in ([0-9.]+)s \(", r.stdout).group(1))
    phases = dict(re.findall(r"(prepare|connect|plan|tokenize|commit) ([0-9.]+)s", r.stdout))
    assert list(phases) == ["prepare", "connect", "plan", "tokenize", "commit"], r.stdout
    assert abs(sum(map(float, phases.values())) - total) <= 0.05, r.stdout


def test_cli_auto_options_and_shard_list(cluster, tmp_path, tok, paragraphs):
    docs = paragraphs[6000:8000] + [[paragraphs[1], paragraphs[2]], ""]
    write_jsonl(tmp_path / "a.jsonl", docs, key="content")
    opts = ["--json-key", "content", "--dtype-rule", "datatrove", "--add-special-tokens", "--append-eod",
            "--eod-token", "[SEP]"]
    assert main(["megatron", "tokenize", str(tmp_path / "a.jsonl"), "--tokenizer", tok, "--output-prefix",
                 str(tmp_path / "ref"), *opts, "-q"]) == 0
    # --ray auto: the cluster this machine belongs to (here named by RAY_ADDRESS, as `ray start` nodes do)
    cli(cluster, tmp_path / "a.jsonl", "--tokenizer", tok, "--output-prefix", tmp_path / "out", *opts, "--ray", "auto",
        "--chunk-size", "64KiB", "--no-merge", "-q", env={"RAY_ADDRESS": ADDRESS})
    listing = str(tmp_path / "out.shards.json")
    with mm.open(listing) as s, mm.open(str(tmp_path / "ref")) as r:
        assert s.num_shards > 4 and len(s) == len(r) and s.num_documents == r.num_documents
        assert s.document_indices.tolist() == r.document_indices.tolist()
        assert all(s[i].tolist() == r[i].tolist() for i in range(len(r)))
        prefixes = [sh.prefix for sh in s.shards]
    mm.merge(str(tmp_path / "merged"), prefixes)
    assert same_files(tmp_path / "merged", tmp_path / "ref")


ROUND_TRIP = r"""
import json, sys
import numpy as np
import ray
from mcf.conversion import raydata

ray.init(address=sys.argv[1], logging_level="ERROR")
ray.data.DataContext.get_current().enable_progress_bars = False
prefixes, out = json.loads(sys.argv[2]), sys.argv[3]
ds = raydata.read_megatron(prefixes, block_sequences=500, override_num_blocks=6)
sink = raydata.MegatronDatasink(out + ".shards", dtype=np.uint16, order="sequence", document="document",
                                output_prefix=out)
ds.write_datasink(sink)
print(json.dumps({"result": sink.result, "runs": len(sink.runs)}))
"""


def test_datasource_and_datasink_round_trip_on_the_cluster(cluster, tmp_path):
    rng = np.random.default_rng(5)
    prefixes = []
    for k in range(4):
        p = str(tmp_path / f"in{k}")
        with mm.Writer(p, dtype=np.uint16, durable=False) as w:
            for _ in range(400):
                lens = rng.integers(1, 30, rng.integers(1, 4))
                w.add_document(rng.integers(0, 30000, int(lens.sum())), lens)
        prefixes.append(p)
    mm.merge(str(tmp_path / "ref"), prefixes)
    (tmp_path / "rt.py").write_text(ROUND_TRIP)
    r = cluster.python(str(tmp_path / "rt.py"), ADDRESS, json.dumps(prefixes), str(tmp_path / "out"), timeout=300)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["runs"] > 1 and got["result"]["output"] == str(tmp_path / "out")
    assert same_files(tmp_path / "out", tmp_path / "ref")


def _kill_running_tasks(cluster, proc, shard_dir, *, kills: int, timeout: float) -> list:
    """Kill (SIGKILL, by PID) a worker process while it runs a tokenize task, ``kills`` times, each after
    a new shard appeared; returns the PIDs killed."""
    killed: list = []
    seen = 0
    deadline = time.monotonic() + timeout
    while len(killed) < kills and proc.poll() is None and time.monotonic() < deadline:
        try:
            published = sum(n.endswith(".idx") for n in os.listdir(shard_dir))
        except FileNotFoundError:
            published = 0
        if published > seen:
            for pid in cluster.find("ray::ReadText"):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.append(pid)
                seen = published
                break
        time.sleep(0.005)
    return killed


def test_worker_killed_mid_job_is_retried_byte_identical(cluster, tmp_path, tok, big_corpus):
    src, ref = big_corpus
    out = tmp_path / "out"
    p = cluster.popen([sys.executable, "-m", "mcf.cli", "megatron", "tokenize", str(src), "--tokenizer", tok,
                       "--output-prefix", str(out), "--append-eod", "--ray", ADDRESS, "--chunk-size", "384KiB", "-q"])
    try:
        killed = _kill_running_tasks(cluster, p, str(out) + ".shards", kills=2, timeout=240)
        stdout, stderr = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=30)
    assert p.returncode == 0, stderr[-4000:]
    assert len(killed) == 2, f"no task was caught running ({stdout}{stderr[-2000:]})"
    assert all(pid not in cluster.processes() for pid in killed)
    assert "will be retried" in stdout + stderr                          # Ray's own report of the retries
    assert same_files(out, ref)                                         # no document lost, none twice
    assert not (tmp_path / "out.shards").exists()


FAILING = r"""
import json, sys
from mcf.conversion import raydata
try:
    raydata.tokenize(sys.argv[1], sys.argv[2], sys.argv[3], append_eod=True, address=sys.argv[4],
                     chunk_size=384 << 10, ray_remote_args={"max_retries": 0}, progress=False)
except Exception as exc:
    print("FAILED", type(exc).__name__, str(exc)[:300])
    sys.exit(3)
print("FINISHED")
"""


def test_failed_job_leaves_no_dataset_and_resumes(cluster, tmp_path, tok, big_corpus):
    src, ref = big_corpus
    out = tmp_path / "out"
    shard_dir = str(out) + ".shards"
    (tmp_path / "fail.py").write_text(FAILING)
    p = cluster.popen([sys.executable, str(tmp_path / "fail.py"), str(src), str(out), tok, ADDRESS])
    try:
        killed = _kill_running_tasks(cluster, p, shard_dir, kills=1, timeout=240)
        stdout, stderr = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=30)
    assert killed, f"no task was caught running ({stdout}{stderr[-2000:]})"
    assert p.returncode == 3 and "FAILED" in stdout, (stdout, stderr[-3000:])   # no retries: the job fails
    assert not (tmp_path / "out.idx").exists() and not (tmp_path / "out.bin").exists()
    names = os.listdir(shard_dir)
    assert "plan.json" in names
    finished = {n for n in names if n.endswith("-end.idx")}
    assert finished, names                                             # chunks done before the kill are kept
    r = cli(cluster, src, "--tokenizer", tok, "--output-prefix", out, "--append-eod", "--ray", ADDRESS, "-q")
    m = re.search(r"(\d+) reused from an earlier run", r.stdout)
    assert m and int(m.group(1)) >= len(finished), r.stdout
    assert same_files(out, ref)
    assert not os.path.exists(shard_dir)


def test_a_malformed_line_fails_the_job_with_its_location(cluster, tmp_path, tok, paragraphs):
    lines = [json.dumps({"text": p}) for p in paragraphs[:3000]]
    lines[2500] = '{"text": "unterminated'
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    r = cli(cluster, tmp_path / "bad.jsonl", "--tokenizer", tok, "--output-prefix", tmp_path / "out", "--ray", ADDRESS,
            "--chunk-size", "64KiB", "-q", check=False)
    assert r.returncode == 1, r.stderr[-3000:]
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("mcf megatron tokenize: error: ") and "bad.jsonl: line" in err and "invalid JSON" in err, err
    assert not (tmp_path / "out.idx").exists() and not (tmp_path / "out.bin").exists()
    assert "plan.json" in os.listdir(tmp_path / "out.shards")           # kept for a rerun once the line is fixed
