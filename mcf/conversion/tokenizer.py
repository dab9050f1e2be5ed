"""Where a tokenizer comes from: wherever a model keeps its ``tokenizer.json``.

Every command and function that takes a tokenizer (``mcf megatron tokenize --tokenizer``, ``mcf ctx ingest
--model-dir``, ``mcf imatrix``, :func:`mcf.conversion.tokenize.tokenize`, :func:`mcf.conversion.raydata.tokenize`)
resolves it with :func:`load_tokenizer`, so each accepts the same sources:

- a ``tokenizers.Tokenizer``, used as it is configured;
- a ``tokenizer.json`` file;
- a checkpoint directory holding one;
- an MCF file (or an open :class:`mcf.Container`) packed with its resources: it carries the checkpoint's
  ``tokenizer.json`` as a resource section, so the file a user already has is enough (``--tokenizer
  model.mcf`` used to fail with "stream did not contain valid UTF-8").

A file is recognized by its first bytes (:mod:`mcf.conversion.sniff`), not its name; one of another kind (GGUF,
safetensors, a dataset...) is refused with what it is.  A ``tokenizer.json`` is read as a regular file of at
most :data:`mcf._core.fs.MAX_TOKENIZER_BYTES` (256 MiB; real ones reach 30+ MB): a FIFO, a device or a
larger file is refused naming it.  A tokenizer read from a file has its truncation
and padding turned off: checkpoints ship inference settings (sentence-transformers: truncate and pad to 128
tokens), while the data a tokenizer prepares here keeps every token and no padding.
"""

from __future__ import annotations

import os

from mcf._core.fs import MAX_TOKENIZER_BYTES, read_regular
from mcf._core.optional import require
from mcf.container.reader import Container, open as open_container
from mcf.errors import InvalidArgumentError
from mcf.conversion.sniff import sniff

__all__ = ["load_tokenizer", "SOURCES"]

#: what :func:`load_tokenizer` takes, for messages
SOURCES = "a tokenizer.json, a checkpoint directory holding one, or an MCF file packed with its resources"


def _from_container(c: Container, where: str):
    text = c.resource_text("tokenizer.json")
    if text is None:
        raise InvalidArgumentError(f"{where}: the MCF file holds no tokenizer.json resource (packed with "
                                   "--no-resources?); pass the checkpoint's tokenizer.json or its directory")
    return text


def load_tokenizer(source):
    """A ``tokenizers.Tokenizer`` from ``source`` (see the module docstring for what it may be), with
    truncation and padding turned off, or ``source`` itself when it already is a Tokenizer.  Raises
    :class:`mcf.InvalidArgumentError` naming the path when it holds no tokenizer, and
    :class:`mcf.MissingDependencyError` without the ``tokenizers`` package."""
    Tokenizer = require("tokenizers", feature="tokenizing text", extra="tokenize").Tokenizer
    if isinstance(source, Tokenizer):
        return source
    if isinstance(source, Container):
        where = source.path
        tok = _parse(Tokenizer, _from_container(source, where), where, "its tokenizer.json resource")
    else:
        p = os.fspath(source)
        if os.path.isdir(p):
            p = os.path.join(p, "tokenizer.json")
        if not os.path.exists(p):
            raise InvalidArgumentError(f"no tokenizer file at {p} (expected {SOURCES})")
        kind = sniff(p)  # refuses a FIFO or a device (an MCFIOError saying what it is)
        if kind is not None and kind.name == "mcf":
            with open_container(p) as c:
                text = _from_container(c, p)
            tok = _parse(Tokenizer, text, p, "its tokenizer.json resource")
        elif kind is not None and kind.name not in ("json", "text"):
            raise InvalidArgumentError(f"{p}: {kind.what}, not a tokenizer (expected {SOURCES})")
        else:  # read here, not by Tokenizer.from_file: a regular file within the cap (mcf._core.fs)
            raw = read_regular(p, limit=MAX_TOKENIZER_BYTES, what="tokenizer file")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidArgumentError(f"{p}: not a tokenizers file: not UTF-8 ({exc.reason} at byte "
                                           f"{exc.start})") from None
            del raw
            try:
                tok = Tokenizer.from_str(text)
            except Exception as exc:  # the library raises plain Exception subclasses
                raise InvalidArgumentError(f"{p}: not a tokenizers file: {exc}") from None
    tok.no_truncation()
    tok.no_padding()
    return tok


def _parse(Tokenizer, text: str, where: str, what: str):
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:  # the library raises plain Exception subclasses
        raise InvalidArgumentError(f"{where}: {what} is not a tokenizers file: {exc}") from None
