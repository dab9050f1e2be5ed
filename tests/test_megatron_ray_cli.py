"""``mcf megatron tokenize`` with wrong Ray arguments, and without Ray installed: clear errors, no output,
no cluster started (these tests never need one)."""

from __future__ import annotations

import json
import sys

import pytest

from mcf.cli import main


@pytest.fixture()
def inputs(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text(json.dumps({"text": "hello world"}) + "\n")
    return p


def run(capsys, *argv) -> tuple:
    code = main(["megatron", "tokenize", *map(str, argv)])
    c = capsys.readouterr()
    return code, c.out, c.err


@pytest.mark.parametrize("flag", [["--chunk-size", "1MiB"], ["--shard-dir", "x"], ["--no-merge"], ["--no-resume"]])
def test_ray_only_flags_need_ray(tmp_path, inputs, capsys, flag):
    code, _, err = run(capsys, inputs, "--tokenizer", tmp_path / "t.json", "--output-prefix", tmp_path / "o", *flag)
    assert code == 1 and f"{flag[0]} applies to a run on a Ray cluster" in err
    assert not (tmp_path / "o.idx").exists()


def test_workers_is_refused_with_ray(tmp_path, inputs, capsys):
    code, _, err = run(capsys, inputs, "--tokenizer", tmp_path / "t.json", "--output-prefix", tmp_path / "o",
                       "--ray", "auto", "--workers", "2")
    assert code == 1 and "--workers" in err


def test_without_ray_installed(tmp_path, inputs, capsys, monkeypatch):
    import mcf.conversion

    monkeypatch.setitem(sys.modules, "ray", None)            # `import ray` raises ImportError
    monkeypatch.delitem(sys.modules, "mcf.conversion.raydata", raising=False)
    monkeypatch.delitem(vars(mcf.conversion), "raydata", raising=False)   # imported by an earlier test
    code, _, err = run(capsys, inputs, "--tokenizer", tmp_path / "t.json", "--output-prefix", tmp_path / "o",
                       "--ray", "auto")
    assert code == 1 and "pip install 'mcf-formats[ray]'" in err
    assert not (tmp_path / "o.idx").exists() and not (tmp_path / "o.shards").exists()


def test_bad_chunk_size(tmp_path, inputs, capsys):
    pytest.importorskip("ray.data", reason="Ray is an optional extra: pip install 'mcf-formats[ray]'")
    code, _, err = run(capsys, inputs, "--tokenizer", tmp_path / "t.json", "--output-prefix", tmp_path / "o",
                       "--ray", "auto", "--chunk-size", "lots")
    assert code == 1 and "cannot read 'lots' as a size" in err
