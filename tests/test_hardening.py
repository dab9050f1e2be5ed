"""Regression tests for what the sanitizer build (fuzz/sanitize.sh) and the fuzzers found, written so they fail
without them too."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from mcf.megatron import sample_index


def test_sample_index_inputs_are_aligned_for_the_c_loop():
    """UBSan: build_sample_idx read ``sizes`` straight from the .idx mapping, where the int32 array starts
    at byte 34 (misaligned int32_t loads in _sample_loop).  The arrays handed to C must be aligned."""
    raw = np.zeros(4 * 8 + 2, np.uint8)
    mis = raw[2:].view(np.int32)
    mis[:] = np.arange(1, 9)
    assert not mis.flags.aligned
    got = sample_index._int32_array(mis, "sizes")
    assert got.flags.aligned and got.flags.c_contiguous
    np.testing.assert_array_equal(got, np.arange(1, 9))
    want = sample_index.build_sample_idx(np.arange(1, 9, dtype=np.int32), np.arange(8, dtype=np.int32), 4, 1, 36)
    np.testing.assert_array_equal(sample_index.build_sample_idx(mis, np.arange(8, dtype=np.int32), 4, 1, 36), want)


def test_fpconv_misaligned_input():
    """UBSan: f32 data straight after a safetensors header (odd offset) reached the C conversion loops as a
    misaligned ``const float*``.  _fpconv now copies misaligned input; results must equal numpy's."""
    from mcf._core import _fpconv

    raw = np.zeros(4 * 37 + 1, np.uint8)
    mis = raw[1:].view(np.float32)
    mis[:] = np.linspace(-3, 3, 37, dtype=np.float32)
    assert not mis.flags.aligned
    np.testing.assert_array_equal(_fpconv.f32_to_f16(mis).view(np.float16), mis.astype(np.float16))
    h = raw[1:1 + 2 * 37].view(np.uint16)
    assert not h.flags.aligned
    np.testing.assert_array_equal(_fpconv.f16_to_f32(h), h.view(np.float16).astype(np.float32))


def test_kv_file_layer_count_is_capped():
    """Found by fuzz/run.py --target bucket (a hang over the 1 s limit): a 64-byte kv_data.mcb declaring
    65536 layers of 0 heads holds no bytes, so it passed every size check and load() then built 131072
    empty arrays per call.  The reader refuses more than MAX_LAYERS layers; the writer never writes them."""
    import pytest

    import mcf
    from mcf.bucket import kvfile

    (p,) = (Path(__file__).parent / "fuzz_regressions" / "bucket").glob("timeout-449f6ab3*")
    with pytest.raises(mcf.FormatError) as ei:
        kvfile.KVFile(memoryview(p.read_bytes()))
    assert ei.value.field == "num_layers"
    empty = np.zeros((1, 0, 4), np.float32)
    with pytest.raises(mcf.InvalidArgumentError):
        kvfile.write_kv(io.BytesIO(), [(empty, empty)] * (kvfile.MAX_LAYERS + 1))


def test_tokenizer_input_nested_too_deep_is_a_format_error(tmp_path, monkeypatch):
    """Found while adding the jsonl fuzz target: without orjson (not a dependency), json.loads of a line nested
    thousands of levels deep raised RecursionError out of iter_documents."""
    import pytest

    import mcf
    from mcf.conversion import tokenize

    monkeypatch.setattr(tokenize, "_orjson", None)
    (p,) = (Path(__file__).parent / "fuzz_regressions" / "jsonl").glob("deep-nesting*")
    f = tmp_path / "in.jsonl"
    f.write_bytes(p.read_bytes())
    docs = tokenize.iter_documents(str(f))
    assert next(docs) == "ok"
    with pytest.raises(mcf.FormatError) as ei:
        next(docs)
    assert ei.value.field == "line 2"
