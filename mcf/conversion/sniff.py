"""What kind of file this is, from its first bytes: so that a command given the wrong file says what the
file is and which command reads it, instead of failing inside the format it expected.

``mcf convert model.mcf -o x.mcf`` used to answer "header_len at offset 0: header length too large (expected
<= ..., got 281479276282701)": the MCF magic read as a safetensors header length.  :func:`sniff` looks at
the magic bytes every format mcf knows starts with (each format's own constant, imported from its layout
module, so a magic is written once), and at the few other files users hand over by mistake (JSON, zip
archives such as PyTorch's ``.bin``, pickles, compressed and plain text files).  It reads at most 4 KiB
and never trusts an extension alone.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from mcf._core.fs import open_regular
from mcf.bucket._layout import MAGIC as BUCKET_MAGIC
from mcf.container.layout import MAGIC as MCF_MAGIC
from mcf.errors import os_error
from mcf.gguf.reader import MAGIC as GGUF_MAGIC
from mcf.megacontext._layout import MAGIC_BYTES as CTX_MAGIC, MAGIC_BYTES_REVERSED as CTX_MAGIC_REVERSED
from mcf.megatron._layout import MAGIC as MEGATRON_MAGIC

__all__ = ["FileKind", "sniff", "HEAD_BYTES"]

HEAD_BYTES = 4096  # enough to tell text from binary; every magic is in the first 16 bytes


@dataclass(frozen=True)
class FileKind:
    """``name`` is a short key (``"mcf"``, ``"gguf"``, ``"safetensors"``, ``"megatron-index"``,
    ``"megacontext-level"``, ``"bucket-kv"``, ``"json"``, ``"zip"``, ``"pickle"``, ``"npy"``, ``"gzip"``,
    ``"zstd"``, ``"text"``); ``what`` says it in words, for messages."""

    name: str
    what: str


_MAGICS = (  # (magic at offset 0, kind)
    (MCF_MAGIC, FileKind("mcf", "an MCF model container")),
    (GGUF_MAGIC, FileKind("gguf", "a GGUF model file")),
    (MEGATRON_MAGIC, FileKind("megatron-index", "the index (.idx) of a Megatron indexed dataset")),
    (CTX_MAGIC, FileKind("megacontext-level", "a level file (LOD*.ctx) of a MegaContext tree")),
    (CTX_MAGIC_REVERSED, FileKind("megacontext-level", "a level file (LOD*.ctx) of a MegaContext tree")),
    (BUCKET_MAGIC, FileKind("bucket-kv", "a KV-cache file (kv_data.mcb) of a Model Context Bucket")),
    (b"PK\x03\x04", FileKind("zip", "a zip archive (a PyTorch .bin/.pt checkpoint, or a numpy .npz)")),
    (b"\x93NUMPY", FileKind("npy", "a numpy .npy array")),
    (b"\x1f\x8b", FileKind("gzip", "a gzip-compressed file")),
    (b"\x28\xb5\x2f\xfd", FileKind("zstd", "a zstd-compressed file")),
)


def _kind_of(head: bytes, size: int) -> FileKind | None:
    for magic, kind in _MAGICS:
        if head.startswith(magic):
            return kind
    # safetensors: u64 header length, then the JSON header, which starts with '{'
    if len(head) >= 9 and head[8:9] == b"{" and 2 <= struct.unpack_from("<Q", head)[0] <= size - 8:
        return FileKind("safetensors", "a safetensors file")
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return FileKind("pickle", "a Python pickle (an old PyTorch .bin/.pt checkpoint)")
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # not just a character cut at the end of the sample
            return None
        text = head[:exc.start].decode("utf-8")
    if "\x00" in text or not text.strip():
        return None
    if text.lstrip("\ufeff \t\r\n")[:1] in ("{", "["):
        return FileKind("json", "a JSON file")
    return FileKind("text", "a text file")


def sniff(path) -> FileKind | None:
    """The kind of the file at ``path`` (a regular file), or None when its first bytes say nothing mcf
    recognizes (an empty file, unknown binary data).  An unreadable file, or one that is not a regular
    file (a FIFO, a device...), raises the usual :class:`mcf.MCFIOError` subclass naming it."""
    p = os.fspath(path)
    fd = open_regular(p)  # a FIFO or a device is refused, never opened for a blocking read
    try:
        head = os.pread(fd, HEAD_BYTES, 0)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise os_error(exc, p) from None
    finally:
        os.close(fd)
    return _kind_of(head, size)
