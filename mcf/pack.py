"""Packing a Hugging Face checkpoint directory into one MCF file, the way the Go packer does.

With the default options the output is byte-identical to ``mantle pack`` (samcharles93/mantle): the
same resource sections in the same order (tokenizer_config.json re-encoded by Go's JSON encoder with
the chat template injected), the same ModelInfo, tensors sorted by name and 64-byte aligned.
Differences from the Go tool, all deliberate: non-float tensors are kept as they are under
``cast="f16"``/``"bf16"`` (Go refuses them), and NaNs stay NaN in a bf16 cast (Go's rounding can turn
some NaNs into infinities or -0).
"""

from __future__ import annotations

import json
import os
from typing import Callable

from mcf._gojson import go_marshal
from mcf._safetensors import open_checkpoint
from mcf.errors import FormatError, InvalidArgumentError
from mcf.layout import RESOURCE_FILES, SectionType
from mcf.modelinfo import ModelInfo
from mcf.writer import Writer

__all__ = ["pack", "tokenizer_config_with_template", "model_info_for_dir"]

CASTS = ("keep", "f16", "bf16")


def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def tokenizer_config_with_template(model_dir: str) -> bytes | None:
    """tokenizer_config.json as the Go packer stores it: parsed, ``chat_template`` filled from
    chat_template.jinja (whitespace-trimmed) when missing or blank, re-encoded with Go's encoder."""
    cfg_bytes = _read(os.path.join(model_dir, "tokenizer_config.json"))
    tpl_bytes = _read(os.path.join(model_dir, "chat_template.jinja"))
    if cfg_bytes is None and tpl_bytes is None:
        return None
    cfg = {}
    if cfg_bytes:
        try:
            cfg = json.loads(cfg_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"not valid JSON: {exc}", path=os.path.join(model_dir, "tokenizer_config.json")) from None
        if not isinstance(cfg, dict):
            raise FormatError("not a JSON object", path=os.path.join(model_dir, "tokenizer_config.json"))
    tpl = (tpl_bytes or b"").decode("utf-8", "replace").strip(" \t\n\r\v\f")
    if tpl_bytes is not None and tpl:
        existing = cfg.get("chat_template")
        if not isinstance(existing, str) or existing.strip() == "":
            cfg["chat_template"] = tpl
    if not cfg:
        return cfg_bytes
    return go_marshal(cfg)


def model_info_for_dir(model_dir: str, model_name: str | None = None) -> ModelInfo:
    """ModelInfo from config.json as the Go packer builds it (name = the directory's base name)."""
    name = model_name or os.path.basename(os.path.normpath(os.path.abspath(model_dir)))
    raw = _read(os.path.join(model_dir, "config.json"))
    if raw is not None:
        try:
            cfg = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            cfg = None
        if isinstance(cfg, dict):
            return ModelInfo.from_hf_config(cfg, name)
    return ModelInfo(model_name=name)


def pack(model_dir, output, *, cast: str = "keep", align: int = 64, dedup: bool = False,
         resources: bool = True, mmap: bool = True, model_name: str | None = None,
         progress: Callable[[int, int, str], None] | None = None) -> str:
    """Pack a checkpoint directory (``model.safetensors`` or sharded) into ``output``.

    ``cast``: "keep", "f16" or "bf16" (float tensors only, round to nearest even).  ``align``: tensor
    alignment (1 disables padding).  ``dedup``: store byte-identical tensors once.  ``resources``:
    include config/tokenizer/vocab/merges files.  ``model_name``: ModelInfo name (default: the
    directory's base name, as the Go packer does).  ``progress(done, total, name)`` is called per tensor.
    Peak memory stays near one conversion chunk: tensors are streamed from the mapped input.
    """
    cast = cast.strip().lower()
    if cast not in CASTS:
        raise InvalidArgumentError(f"cast must be one of {CASTS}, got {cast!r}")
    model_dir = os.fspath(model_dir)
    with open_checkpoint(model_dir, mmap=mmap) as ckpt, \
            Writer(output, align=align, dedup=dedup) as w:
        if resources:
            for typ, fname in RESOURCE_FILES.items():
                if typ == SectionType.TOKENIZER_CONFIG_JSON:
                    data = tokenizer_config_with_template(model_dir)
                else:
                    data = _read(os.path.join(model_dir, fname))
                if data is not None:
                    w.add_section(typ, data)
        w.add_model_info(model_info_for_dir(model_dir, model_name))
        names = ckpt.sorted_names()
        target = None if cast == "keep" else cast
        for i, name in enumerate(names):
            t = ckpt.tensors[name]
            w.add_tensor(name, t.array(), dtype=target)
            if progress is not None:
                progress(i + 1, len(names), name)
    return os.fspath(output)
