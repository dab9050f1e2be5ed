"""Importance matrices: how much each input column of a weight matrix matters, measured on activations.

A linear layer ``y = x @ W.T`` turns an error ``dW`` in its weights into an output error ``x @ dW.T``;
on average over inputs its square is ``sum_j E[x_j^2] * dW_ij^2`` (keeping the diagonal).  So the
quantizer should weight the squared error of column ``j`` of ``W`` by ``E[x_j^2]``, the mean squared
input of that column: that vector is the tensor's *importance*.  :func:`mcf.container.quant.quantize` takes it as
``importance=``, ``mcf quantize --imatrix FILE`` reads it from a file.

The file format is llama.cpp's GGUF importance matrix (``llama-imatrix -o imatrix.gguf``), so files
from either tool work with both:

- a GGUF v3 file with ``general.type = "imatrix"``, ``imatrix.datasets`` (array of strings: what the
  activations came from), ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (u32: calibration chunks
  and tokens per chunk);
- per weight tensor ``NAME``: ``NAME.in_sum2``, F32 with GGUF dims ``[columns, 1]``, the sum over all
  calibration tokens of the squared input of each column, and ``NAME.counts``, F32 ``[1, 1]``, the
  number of tokens.  The importance is ``in_sum2 / counts``.  (llama.cpp also writes ``NAME.in_sum``,
  the plain sums; its values are not used.  As llama.cpp does, a file is refused when a ``NAME.counts``
  or ``NAME.in_sum`` has no ``NAME.in_sum2``, or the reverse, or when ``NAME.in_sum`` is not F32 or holds
  another number of values than ``NAME.in_sum2``.  3-D mixture-of-experts entries, ``[columns, experts]``,
  read as one row per expert; MCF quantizes rank-2 tensors, so they never apply.)

Tensor names: an entry applies to the tensor of the same name, and across the two naming conventions
(:func:`match_tensors`).  MCF files packed from a checkpoint have Hugging Face names
(``model.layers.0.self_attn.q_proj.weight``), files converted from GGUF and llama.cpp's importance
matrices have GGUF names (``blk.0.attn_q.weight``); :func:`gguf_name` translates the weight matrices of
llama-style and BERT-style models the way llama.cpp's ``convert_hf_to_gguf.py`` names them, so an
imatrix made by llama-imatrix applies to the checkpoint the GGUF model came from, and one made by
``mcf imatrix`` to a GGUF conversion.  The legacy llama.cpp ``.dat`` format
(``int32 n_entries``, then per entry ``int32 len, name, int32 ncall, int32 nval, float32[nval]``
holding ``mean * ncall``, then optionally ``int32 chunks, int32 len, dataset name``) is read too.

:func:`collect_bert` measures one for the BERT encoders :mod:`mcf.conversion.bert` runs (the demo's
all-MiniLM-L6-v2), and ``mcf imatrix`` is its command line.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable, Mapping

import numpy as np

from mcf._core.args import file_path, integer, path_or_mapping, real, reals
from mcf._core.fs import MAX_JSON_BYTES, open_regular, read_regular, write_all, write_atomic
from mcf.container.reader import open as open_container
from mcf.errors import ArgumentTypeError, FormatError, InvalidArgumentError, TruncatedError
from mcf.conversion.second_moment import (RunningSums, SecondMomentCollector, SecondMoments, dataset_names,
                                          is_second_moment_file, iterable, tensor_names)

__all__ = ["ImportanceCollector", "read_imatrix", "write_imatrix", "as_importance", "collect_bert", "gguf_name",
           "match_tensors"]

_GGUF_MAGIC = b"GGUF"
_ALIGN = 32                     # GGUF's default alignment (no general.alignment key is written)
_SUM2, _COUNTS, _SUM = ".in_sum2", ".counts", ".in_sum"
_MAX_LEGACY_ENTRIES = 1 << 20   # far more weight tensors than any model has
_MAX_NAME = 1 << 16
#: the most bytes a legacy ``.dat`` importance file may hold (it is read whole): one float per input
#: column of every weight, per expert for MoE weights, which for a 671B MoE (DeepSeek-V3: 58 MoE
#: layers x 256 experts x 16k columns) is about 1 GB; 4 GiB leaves four times that.
MAX_LEGACY_BYTES = 4 << 30
#: the most bytes one calibration text file of ``mcf imatrix --text`` may hold (it is read whole and
#: tokenized in memory).  llama.cpp's calibration sets are kilobytes to ~10 MB, and the numpy encoder
#: needs hours for 100 MB; 1 GiB is far beyond any run that ends, and keeps a device file out.
MAX_TEXT_BYTES = 1 << 30


class ImportanceCollector(RunningSums):
    """Running sums of squared inputs per weight tensor: ``add(name, x)`` with the ``[tokens, columns]``
    input of that tensor's layer; :meth:`means` gives the importance vectors, :meth:`write` the file.
    With ``second_moment=True`` the whole ``x^T x`` is summed as well, in ``self.second_moment`` (a
    :class:`mcf.conversion.second_moment.SecondMomentCollector`; its file is what ``mcf quantize --second-moment``
    reads), else that attribute is None."""

    def __init__(self, *, second_moment: bool = False):
        super().__init__()
        self.second_moment = SecondMomentCollector() if second_moment else None

    def add(self, name: str, x) -> None:
        x = self.layer_inputs(name, x)
        with np.errstate(over="ignore", invalid="ignore"):   # NaN or overflow: write() refuses the sums
            sq = np.einsum("ij,ij->j", x, x, dtype=np.float64)
        self.accumulate(name, sq, x.shape[0])
        if self.second_moment is not None:
            self.second_moment.add(name, x)

    def means(self) -> dict[str, np.ndarray]:
        """name -> mean squared input per column (float32)."""
        with np.errstate(over="ignore"):   # beyond float32's range is infinity (refused where it is used)
            return {n: (s / max(1, self.counts[n])).astype(np.float32) for n, s in sorted(self.sums.items())}

    def write(self, path, *, datasets=(), chunk_count: int = 0, chunk_size: int = 0) -> None:
        write_imatrix(path, self.sums, self.counts, datasets=datasets, chunk_count=chunk_count,
                      chunk_size=chunk_size)


# -- writing ---------------------------------------------------------------------------------------

def _gguf_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def write_imatrix(path, sums: Mapping, counts: Mapping, *, datasets=(), chunk_count: int = 0,
                  chunk_size: int = 0) -> None:
    """Write llama.cpp's GGUF importance-matrix file: ``sums[name]`` (per-column sums of squared inputs)
    and ``counts[name]`` (tokens).  Tensors are sorted by name, as llama-imatrix writes them.  The file
    is written to a temporary name and renamed into place.  Everything is checked before anything is
    written: what :func:`read_imatrix` would refuse (a sum beyond float32, a negative one) is refused
    here, so a file this writes can always be read."""
    path = file_path(path, "path")
    datasets = dataset_names(datasets)
    u32 = {}
    for what, v in (("chunk_count", chunk_count), ("chunk_size", chunk_size)):
        u32[what] = integer(v, what, minimum=0)
        if u32[what] > 0xFFFFFFFF:
            raise InvalidArgumentError(f"{what} = {u32[what]} does not fit the file's u32 field")
    tensors = []
    for n in tensor_names(sums):
        if n not in counts:
            raise InvalidArgumentError(f"no token count for {n!r}")
        s = _f32_entry(reals(sums[n], f"sums[{n!r}]"), f"sums[{n!r}]")
        if s.ndim != 1:
            raise InvalidArgumentError(f"sums[{n!r}] must be 1-D (one sum per column), got shape {s.shape}")
        c = _f32_entry(np.array(real(counts[n], f"counts[{n!r}]")), f"counts[{n!r}]")
        tensors.append((n + _SUM2, (s.shape[0], 1), s))
        tensors.append((n + _COUNTS, (1, 1), c.reshape(1)))
    kv = [("general.type", 8, _gguf_str("imatrix")),
          ("imatrix.datasets", 9, struct.pack("<IQ", 8, len(datasets)) + b"".join(_gguf_str(d) for d in datasets)),
          ("imatrix.chunk_count", 4, struct.pack("<I", u32["chunk_count"])),
          ("imatrix.chunk_size", 4, struct.pack("<I", u32["chunk_size"]))]
    head = [_GGUF_MAGIC, struct.pack("<IQQ", 3, len(tensors), len(kv))]
    for key, vtype, value in kv:
        head += [_gguf_str(key), struct.pack("<I", vtype), value]
    off = 0
    for name, dims, data in tensors:
        head += [_gguf_str(name), struct.pack("<I", len(dims)), struct.pack(f"<{len(dims)}Q", *dims),
                 struct.pack("<IQ", 0, off)]   # type 0 = F32, offset from the start of the data
        off += -(-data.nbytes // _ALIGN) * _ALIGN
    header = b"".join(head)
    header += b"\0" * (-len(header) % _ALIGN)

    def write(fd):
        write_all(fd, header)
        for _name, _dims, data in tensors:
            write_all(fd, np.ascontiguousarray(data))
            write_all(fd, b"\0" * (-data.nbytes % _ALIGN))

    write_atomic(path, write)


def _f32_entry(v: np.ndarray, what: str) -> np.ndarray:
    """float64 values as the little-endian float32 the file holds, refused unless finite and >= 0 there."""
    with np.errstate(over="ignore"):
        f = np.ascontiguousarray(v, dtype="<f4")
    bad = ~(np.isfinite(f) & (f >= 0))
    if bad.any():
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        raise InvalidArgumentError(f"{what}: {v.reshape(-1)[i]!r} at flat index {i}; the file holds finite float32 "
                                   "values >= 0")
    return f


# -- reading ---------------------------------------------------------------------------------------

def read_imatrix(path) -> dict[str, np.ndarray]:
    """Importance vectors from a GGUF importance-matrix file (ours or llama.cpp's), a legacy
    llama.cpp ``.dat`` file, or a second-moment file (:mod:`mcf.conversion.second_moment`: the diagonals of its
    matrices): name -> float32 mean squared input per column (``[experts, columns]`` for 3-D entries).
    Every length, count and value is checked: a bad file raises :class:`mcf.FormatError` naming the
    field."""
    from mcf.errors import os_error

    path = file_path(path, "path")
    fd = open_regular(path)  # a FIFO or a device is refused here, before any read can block
    try:
        magic = os.pread(fd, 4, 0)
    except OSError as exc:
        raise os_error(exc, path) from None
    finally:
        os.close(fd)
    if magic == _GGUF_MAGIC:
        return _read_gguf(path)
    if is_second_moment_file(path):
        with SecondMoments(path) as sm:
            out = {}
            for n in sm:
                d = sm.diagonal(n)
                if d.size and float(d.max()) > float(np.finfo(np.float32).max):
                    raise FormatError("a diagonal value overflows float32", path=path, field=n)
                out[n] = d.astype(np.float32)
            return out
    return _read_legacy(path)


def _checked(path, name, v) -> np.ndarray:
    """float32 values checked on their bits (no float operation, so a signalling NaN raises nothing
    either): finite and not negative (-0.0 is allowed).  Returned as float64."""
    bits = np.ascontiguousarray(v, dtype="<f4").view("<u4")
    bad = ((bits & 0x7F800000) == 0x7F800000) | ((bits >> 31).astype(bool) & ((bits & 0x7FFFFFFF) != 0))
    if bad.any():
        raise FormatError("importance values must be finite and >= 0", path=path, field=name,
                          got=f"bits 0x{int(bits.reshape(-1)[np.flatnonzero(bad.reshape(-1))[0]]):08x}")
    return bits.view("<f4").astype(np.float64)


def _read_gguf(path) -> dict[str, np.ndarray]:
    from mcf.gguf import reader as gguf

    out = {}
    with gguf.open(path, mmap=False) as g:
        kind = g.metadata.get("general.type")
        if kind is not None and kind != "imatrix":
            raise FormatError("not an importance matrix", path=path, field="general.type", expected="imatrix",
                              got=kind)
        bases = {}  # NAME -> its tensors; other names (anything newer) are ignored, as llama.cpp does
        for tname in g.tensors:
            for suffix in (_SUM2, _COUNTS, _SUM):
                if tname.endswith(suffix):
                    bases.setdefault(tname[: -len(suffix)], []).append(tname)
                    break
        for base, present in bases.items():
            # llama.cpp's rules (common_imatrix_load: "mismatched sums and counts"): NAME.in_sum2 and
            # NAME.counts come together; NAME.in_sum, when present, is F32 and as large as NAME.in_sum2
            tname, cname, iname = base + _SUM2, base + _COUNTS, base + _SUM
            for need in (tname, cname):
                if need not in g.tensors:
                    raise FormatError(f"an importance entry needs both {_SUM2} and {_COUNTS}", path=path,
                                      field=present[0], expected=need)
            if iname in g.tensors:
                ti, t2 = g.tensors[iname], g.tensors[tname]
                if ti.type.name != "F32":
                    raise FormatError("in_sum must be F32", path=path, field=iname, got=ti.type.name)
                if ti.n_elements != t2.n_elements:
                    raise FormatError(f"in_sum holds {ti.n_elements} values, in_sum2 {t2.n_elements}", path=path,
                                      field=iname, expected=t2.n_elements, got=ti.n_elements)
            for n in (tname, cname):
                ti = g.tensors[n]
                if ti.type.name != "F32" or len(ti.shape) not in (1, 2):
                    raise FormatError("importance tensors are 1-D or 2-D F32", path=path, field=n,
                                      got=f"{ti.type.name} {list(ti.dims)}")
            s32 = np.asarray(g.array(tname))
            if s32.size == 0:
                raise FormatError("empty importance entry", path=path, field=tname)
            sums = _checked(path, tname, s32).reshape(s32.shape[0] if s32.ndim == 2 else 1, s32.shape[-1])
            cnt = _checked(path, cname, g.array(cname)).reshape(-1)
            if cnt.shape[0] != sums.shape[0]:
                raise FormatError("one count per matrix", path=path, field=cname, expected=sums.shape[0],
                                  got=cnt.shape[0])
            mean = np.where(cnt[:, None] > 0, sums / np.where(cnt > 0, cnt, 1)[:, None], 0.0)
            if mean.size and float(mean.max()) > float(np.finfo(np.float32).max):
                raise FormatError("in_sum2 / counts overflows float32", path=path, field=tname)
            out[base] = (mean[0] if mean.shape[0] == 1 else mean).astype(np.float32)
    if not out:
        raise FormatError("no importance entries (NAME.in_sum2 / NAME.counts tensors)", path=path)
    return out


def _read_legacy(path) -> dict[str, np.ndarray]:
    data = read_regular(path, limit=MAX_LEGACY_BYTES, what="legacy importance matrix")
    pos = 0

    def i32(field):
        nonlocal pos
        if pos + 4 > len(data):
            raise TruncatedError("file ends inside a field", path=path, field=field, offset=pos)
        (v,) = struct.unpack_from("<i", data, pos)
        pos += 4
        return v

    n = i32("n_entries")
    if not 0 < n <= _MAX_LEGACY_ENTRIES:
        raise FormatError("not an importance matrix (GGUF or llama.cpp .dat)", path=path, field="n_entries",
                          offset=0, expected=f"1..{_MAX_LEGACY_ENTRIES}", got=n)
    out = {}
    for e in range(n):
        at = pos
        ln = i32(f"entry[{e}].name_len")
        if not 0 < ln <= _MAX_NAME or pos + ln > len(data):
            raise FormatError("bad name length", path=path, field=f"entry[{e}].name_len", offset=at, got=ln)
        try:
            name = data[pos:pos + ln].decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError("name is not UTF-8", path=path, field=f"entry[{e}].name", offset=pos) from None
        pos += ln
        ncall = i32(f"{name}.ncall")
        at = pos
        nval = i32(f"{name}.nval")
        if nval <= 0 or pos + 4 * nval > len(data):
            raise FormatError("bad value count", path=path, field=f"{name}.nval", offset=at, got=nval)
        v = _checked(path, name, np.frombuffer(data, "<f4", nval, pos))
        pos += 4 * nval
        if name in out:
            raise FormatError("duplicate entry", path=path, field=name, offset=at)
        out[name] = (v / ncall if ncall > 0 else v).astype(np.float32)
    if pos != len(data):  # optional trailer: int32 chunk count, int32 length, dataset name
        i32("chunk_count")
        at = pos
        ln = i32("dataset_len")
        if ln < 0 or pos + ln != len(data):
            raise FormatError("trailing bytes after the entries", path=path, field="dataset", offset=at)
    return out


def as_importance(obj) -> Mapping:
    """``None`` -> {}; a path -> :func:`read_imatrix`; a mapping (str name -> per-column vector) as it is."""
    return path_or_mapping(obj, "imatrix", "importance", read_imatrix)


# -- names -----------------------------------------------------------------------------------------

# The weight matrices an importance matrix holds (every linear layer; embeddings and output heads for
# completeness), under their Hugging Face names without ``.weight``/``.bias`` (group 1: the layer), and
# the GGUF name llama.cpp's convert_hf_to_gguf.py gives them through gguf-py's TensorNameMap; a test
# checks the two agree.  A small table rather than TensorNameMap itself: mcf needs only numpy, and
# TensorNameMap needs the architecture, which the names alone already tell for these models.  Norms
# are 1-D (never quantized, never in an imatrix) and differ between architectures, so they are left
# out, like every other architecture's names: an entry of those must use the file's own names.
# (llama.cpp permutes the rows of Q and K for rotary embeddings; an importance vector is per column.)
_L = r"(?:model\.)?layers\.(\d+)\."        # transformers' llama-style models, and Meta's original names
_B = r"(?:bert\.)?"                         # BertModel inside a task model; llama.cpp drops the prefix
_HF_TO_GGUF = tuple((re.compile(rx), gg) for rx, gg in (
    (_L + r"self_attn\.q_proj", "blk.{}.attn_q"), (_L + r"self_attn\.k_proj", "blk.{}.attn_k"),
    (_L + r"self_attn\.v_proj", "blk.{}.attn_v"), (_L + r"self_attn\.o_proj", "blk.{}.attn_output"),
    (_L + r"mlp\.gate_proj", "blk.{}.ffn_gate"), (_L + r"mlp\.up_proj", "blk.{}.ffn_up"),
    (_L + r"mlp\.down_proj", "blk.{}.ffn_down"),
    (_L + r"attention\.wq", "blk.{}.attn_q"), (_L + r"attention\.wk", "blk.{}.attn_k"),
    (_L + r"attention\.wv", "blk.{}.attn_v"), (_L + r"attention\.wo", "blk.{}.attn_output"),
    (_L + r"feed_forward\.w1", "blk.{}.ffn_gate"), (_L + r"feed_forward\.w3", "blk.{}.ffn_up"),
    (_L + r"feed_forward\.w2", "blk.{}.ffn_down"),
    (r"(?:model\.)?embed_tokens", "token_embd"), (r"tok_embeddings", "token_embd"), (r"lm_head", "output"),
    (_B + r"encoder\.layer\.(\d+)\.attention\.self\.query", "blk.{}.attn_q"),
    (_B + r"encoder\.layer\.(\d+)\.attention\.self\.key", "blk.{}.attn_k"),
    (_B + r"encoder\.layer\.(\d+)\.attention\.self\.value", "blk.{}.attn_v"),
    (_B + r"encoder\.layer\.(\d+)\.attention\.output\.dense", "blk.{}.attn_output"),
    (_B + r"encoder\.layer\.(\d+)\.intermediate\.dense", "blk.{}.ffn_up"),
    (_B + r"encoder\.layer\.(\d+)\.output\.dense", "blk.{}.ffn_down"),
    (_B + r"embeddings\.word_embeddings", "token_embd"), (_B + r"embeddings\.position_embeddings", "position_embd"),
    (_B + r"embeddings\.token_type_embeddings", "token_types"),
))


def gguf_name(name: str) -> str | None:
    """The GGUF name llama.cpp's converter gives the Hugging Face tensor ``name``
    (``model.layers.0.self_attn.q_proj.weight`` -> ``blk.0.attn_q.weight``,
    ``encoder.layer.0.intermediate.dense.weight`` -> ``blk.0.ffn_up.weight``), for the weight matrices
    of llama-style and BERT-style models; None for any other name (GGUF names included)."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    for rx, gg in _HF_TO_GGUF:
        m = rx.fullmatch(base)
        if m:
            return gg.format(*m.groups()) + "." + suffix
    return None


def match_tensors(imatrix: Mapping, names: Iterable[str]) -> dict[str, str]:
    """tensor name -> the name of the ``imatrix`` entry that applies to it, for each of ``names`` that has
    one: the entry of the same name, else the entry with the same GGUF name (:func:`gguf_name` of a
    Hugging Face name, a GGUF name as it is), so Hugging Face and GGUF names meet whichever side has
    which.  A GGUF name that two entries, or two of ``names``, share is not guessed at."""
    def key(n):
        return gguf_name(n) or n

    names = list(names)
    entries: dict[str, list] = {}
    for e in imatrix:
        entries.setdefault(key(e), []).append(e)
    claimed: dict[str, int] = {}
    for n in names:
        claimed[key(n)] = claimed.get(key(n), 0) + 1
    out = {}
    for n in names:
        if n in imatrix:
            out[n] = n
        elif len(entries.get(key(n), ())) == 1 and claimed[key(n)] == 1:
            out[n] = entries[key(n)][0]
    return out


# -- collecting ------------------------------------------------------------------------------------

def _model_parts(model):
    """(weights mapping, config dict, tokenizers.Tokenizer) of an MCF file or a checkpoint directory."""
    from mcf.conversion.tokenizer import load_tokenizer

    path = os.fspath(model)
    if os.path.isdir(path):
        from mcf.safetensors.reader import open_checkpoint

        cfg = _dir_config(path)
        tok = load_tokenizer(path)
        ckpt = open_checkpoint(path)
        weights = {n: ckpt.tensors[n].array() for n in ckpt.sorted_names()}
    else:
        with open_container(path) as c:
            cfg = c.resource_json("config.json")
            if cfg is None:
                raise InvalidArgumentError(f"{path}: the file holds no config.json resource; pack it with its "
                                           "resources (mcf pack)")
            tok = load_tokenizer(c)
            weights = {n: np.array(c.tensor(n)) for n in c}  # copies: the file is closed afterwards
    return weights, cfg, tok


def _dir_config(path) -> dict:
    """config.json of checkpoint directory ``path``: a regular file of at most MAX_JSON_BYTES holding a
    JSON object (FormatError naming it otherwise)."""
    import json

    cfg_path = os.path.join(path, "config.json")
    raw = read_regular(cfg_path, limit=MAX_JSON_BYTES, what="config.json")
    try:
        cfg = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"not valid JSON: {exc}", path=cfg_path) from None
    if not isinstance(cfg, dict):
        raise FormatError("not a JSON object", path=cfg_path)
    return cfg


def _model_config(path) -> dict:
    if os.path.isdir(path):
        return _dir_config(path)
    with open_container(path) as c:
        cfg = c.resource_json("config.json")
    if cfg is None:
        raise InvalidArgumentError(f"{path}: the file holds no config.json resource; pack it with its resources "
                                   "(mcf pack)")
    return cfg


def collect_bert(model, texts, *, chunk_tokens: int = 128, second_moment: bool = False,
                 progress=None) -> tuple[ImportanceCollector, int]:
    """Run the numpy BERT encoder (:mod:`mcf.conversion.bert`) of ``model`` (an MCF file with its config.json and
    tokenizer.json, or a checkpoint directory) over ``texts`` cut into chunks of ``chunk_tokens`` tokens
    ([CLS] and [SEP] included) and record the inputs of every linear layer.  Returns the collector and
    the number of chunks.  ``second_moment=True`` records the whole second moment of the inputs as well
    (the collector's ``second_moment``), for error-feedback quantization."""
    from mcf.conversion.bert import bert_forward

    model = file_path(model, "model")
    chunk_tokens = integer(chunk_tokens, "chunk_tokens")
    if isinstance(texts, (str, bytes)):  # would be read as one text per character
        raise ArgumentTypeError("texts must be a sequence of texts, got a single " + type(texts).__name__)
    texts = iterable(texts, "texts")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ArgumentTypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
    cfg = _model_config(model)
    if not isinstance(cfg, dict) or cfg.get("model_type") != "bert":
        got = cfg.get("model_type") if isinstance(cfg, dict) else cfg
        raise InvalidArgumentError(f"{model}: model_type {got!r}; the numpy forward pass runs BERT "
                                   "encoders only (for other models, llama.cpp's llama-imatrix writes the same "
                                   "file format)")
    weights, cfg, tok = _model_parts(model)
    if not 3 <= chunk_tokens <= int(cfg["max_position_embeddings"]):
        raise InvalidArgumentError(f"chunk_tokens must be 3..{cfg['max_position_embeddings']}")
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    chunks = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        step = chunk_tokens - 2
        chunks += [[cls] + ids[i:i + step] + [sep] for i in range(0, len(ids), step)]
    if not chunks:
        raise InvalidArgumentError("the calibration text is empty")
    col = ImportanceCollector(second_moment=second_moment)
    for i, ids in enumerate(chunks):
        bert_forward(weights, cfg, ids, observe=col.add)
        if progress is not None:
            progress(i + 1, len(chunks), f"chunk {i + 1}")
    return col, len(chunks)
