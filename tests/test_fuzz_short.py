"""The short fuzz run of every parser, in-process and without libFuzzer so it runs everywhere.

For each target of ``fuzz/targets.py``: replay the seed corpus (the golden fixtures), every input that
ever made the target fail (``tests/fuzz_regressions/<target>/``), then a fixed number of inputs derived
from the seeds by ``fuzz/mutate.py`` with a fixed random seed.  Every input must either be read in full
or raise an :class:`mcf.MCFError`; anything else propagates and fails the test.  A failing mutated input
is saved under the pytest tmp dir and named in the failure, ready to be copied into
``tests/fuzz_regressions/<target>/``.  The long, coverage-guided runs are ``fuzz/run.py`` (atheris).
"""

from __future__ import annotations

import hashlib
import random
import sys
import traceback
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuzz.mutate import mutate  # noqa: E402
from fuzz.targets import SPLIT, TARGETS, join_parts, regressions, seeds, split_parts  # noqa: E402

# mutated inputs per target: together about 10 s on one core (the MegaContext target writes four files
# per input, Megatron opens each input four ways)
MUTATIONS = {"bucket": 800, "bucket_dir": 300, "bucket_npz": 800, "gguf": 800, "imatrix": 1500, "jsonl": 1500,
             "mcf": 1500, "megatron": 600, "megacontext": 500, "safetensors": 3000}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_seeds_are_read_in_full(target):
    """The seeds are valid files: they must open without any error, or the fuzzing starts nowhere."""
    corpus = seeds(target)
    assert len(corpus) >= 3
    for data in corpus:
        TARGETS[target](data)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_regressions(target):
    for p in regressions(target):
        TARGETS[target](p.read_bytes())


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_mutations(target, tmp_path):
    fn = TARGETS[target]
    corpus = seeds(target)
    rng = random.Random(f"mcf-fuzz-{target}")
    for i in range(MUTATIONS[target]):
        data = mutate(rng.choice(corpus), rng, corpus)
        try:
            fn(data)
        except Exception:
            saved = tmp_path / f"crash-{hashlib.sha1(data).hexdigest()[:12]}"
            saved.write_bytes(data)
            pytest.fail(f"{target}: mutated input {i} escaped as a non-MCFError (saved to {saved}):\n"
                        f"{traceback.format_exc()}")


def test_parts_round_trip():
    """Multi-file inputs are cut at SPLIT into exactly the parts they were made of."""
    assert split_parts(join_parts(b"a", b"", b"c"), 3) == [b"a", b"", b"c"]
    assert split_parts(b"only", 2) == [b"only", b""]
    assert split_parts(join_parts(b"a", b"b", b"c"), 2) == [b"a", b"b" + SPLIT + b"c"]


def test_a_non_mcf_error_is_caught(monkeypatch):
    """The contract has teeth: a reader that leaks a builtin exception makes the target raise."""
    import mcf.megatron.reader as reader

    def broken(*a, **k):
        raise IndexError("leaked")

    monkeypatch.setattr(reader.IndexedDataset, "document", broken)
    with pytest.raises(IndexError):
        TARGETS["megatron"](seeds("megatron")[0])


def test_empty_tensor_with_a_huge_dim_is_a_format_error():
    """Found by fuzz/run.py: shape (0, 2**62 + 4) of u64 has 0 elements, so its data_size (0) matched, but
    numpy refuses to build even an empty array that large (ValueError escaped from tensor())."""
    import mcf

    (p,) = [p for p in regressions("mcf") if p.name.startswith("crash-86e3a1d2")]
    with pytest.raises(mcf.FormatError) as ei:
        mcf.open(memoryview(p.read_bytes()))
    assert ei.value.field.endswith("dim_off") and "too large" in str(ei.value)
