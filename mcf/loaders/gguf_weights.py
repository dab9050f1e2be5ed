"""A GGUF file as the loaders see a checkpoint (:class:`mcf.loaders.weights.Weights`' interface): its tensors
in file order, their shapes, and the read plan of pieces of them (:mod:`mcf.gguf.pieces`), quantized
tensors decoded by mcf's kernels into the result.

Names are GGUF's own (``blk.0.attn_q.weight``) and shapes row-major (GGUF's dims reversed).  ``row_orders``
(name -> the stored row of each row) reorders a tensor's rows while it is read: what transformers does to
llama.cpp's Q/K rows (:mod:`mcf.loaders.hf`).
"""

from __future__ import annotations

from mcf._core.lifetime import ClosedOnExit
from mcf.errors import DTypeError
from mcf.gguf.pieces import tensor_piece
from mcf.gguf.reader import GGUFFile, open as open_gguf_file
from mcf.remote import is_url, redact

__all__ = ["GGUFWeights", "open_gguf"]


class GGUFWeights(ClosedOnExit):
    """An open GGUF file, as the loaders see a checkpoint."""

    def __init__(self, g: GGUFFile, owned: bool, where: str):
        self.obj = g
        self.owned = owned
        self.where = where
        self.order = list(g.tensors)
        self.row_orders: dict = {}

    def shape(self, name: str) -> tuple:
        return tuple(self.obj.info(name).shape)

    def use_weights(self, dequantize: str | None) -> list:
        """The names a load returns (GGUF's quantized tensors decode whatever ``dequantize`` says)."""
        return self.order

    def pieces(self, chosen: list, specs: dict, dtype, *, threads: int = 1, dequantize: str | None = None) -> list:
        """The read plan of ``chosen`` (``specs``: name -> Rows | Shard | None; ``dtype``: None or a float
        element name every float and quantized tensor becomes)."""
        if dtype == "raw":
            raise DTypeError(f"{self.where}: dtype='raw' is for MCF files' quantized payloads")
        return [tensor_piece(self.obj, n, specs.get(n), dtype, rows=self.row_orders.get(n), threads=threads)
                for n in chosen]

    def close(self) -> None:
        if self.owned:
            self.obj.close()


def open_gguf(filename, *, mmap=None) -> GGUFWeights:
    """A GGUF file (a path, a URL, a buffer), opened for loading."""
    g = open_gguf_file(filename, mmap=mmap)
    where = redact(str(filename)) if is_url(filename) else str(g.path)
    return GGUFWeights(g, True, where)
