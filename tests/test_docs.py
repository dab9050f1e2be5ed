"""The Python examples in docs/guide.md run, in order, in a scratch directory."""

import os
import re

import pytest

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")


def python_blocks(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("page", ["guide.md"])
def test_guide_examples_run(page, tmp_path, monkeypatch, capsys):
    blocks = python_blocks(os.path.join(DOCS, page))
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    ns = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{page}[block {i}]", "exec"), ns)  # noqa: S102 - our own documentation
    out = capsys.readouterr().out
    assert "broken.mcf: file_size at offset 24" in out
    assert "missing:" in out


def test_quickstart_runs(tmp_path, monkeypatch, capsys, minilm_dir):
    """docs/quickstart.md is a newcomer's first five minutes: every Python block runs, in order, and
    prints what the page says it prints."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    pytest.importorskip("tokenizers")
    blocks = python_blocks(os.path.join(DOCS, "quickstart.md"))
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    ns = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"quickstart.md[block {i}]", "exec"), ns)  # noqa: S102 - our own documentation
    out = capsys.readouterr().out.splitlines()
    assert "k4 (384, 384)" in out
    assert out.count("True") == 2                      # bit-exact export, bucket found after a restart
    assert out[-1].startswith("TruncatedError - <memory>: file_size at offset 24")


def test_api_reference_matches_the_docstrings():
    """docs/api.md is generated from the docstrings (docs/gen_api.py): a changed docstring or a new public
    name must come with a regenerated page."""
    import subprocess
    import sys

    gen = os.path.join(DOCS, "gen_api.py")
    p = subprocess.run([sys.executable, gen, "--check"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
