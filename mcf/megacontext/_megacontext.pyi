from typing import Any

import numpy as np
import numpy.typing as npt

from mcf._core._io import Source

STREAM_BYTES: int

def float_code(dt: npt.DTypeLike) -> int: ...
def numpy_dtype(code: int) -> np.dtype[Any]: ...
def assemble(
    sources: tuple[Source, Source | None, Source | None],
    counts: tuple[int, int, int],
    block_size: int,
    dim: int,
    gist_codes: tuple[int, int],
    plan_levels: npt.ArrayLike,
    plan_index: npt.ArrayLike,
    table: npt.ArrayLike | None = ...,
    out: npt.NDArray[Any] | None = ...,
    out_dtype: npt.DTypeLike | None = ...,
    threads: int = ...,
    impl: str | None = ...,
) -> tuple[
    npt.NDArray[np.uint8],
    npt.NDArray[np.int64],
    npt.NDArray[np.uint32],
    npt.NDArray[Any] | None,
    npt.NDArray[Any] | None,
]: ...
def gather_rows(src: Source, count: int, row_bytes: int, indices: npt.ArrayLike,
                out: npt.NDArray[Any]) -> npt.NDArray[Any]: ...
def convert(src: npt.ArrayLike, out: npt.NDArray[Any]) -> npt.NDArray[Any]: ...
def pool_rows(rows: npt.ArrayLike, group: int, out_dtype: npt.DTypeLike) -> npt.NDArray[Any]: ...
def pool_tokens(ids: npt.ArrayLike, group: int, table: npt.ArrayLike, out_dtype: npt.DTypeLike) -> npt.NDArray[Any]: ...
def q8_row_bytes(dim: int) -> int: ...
def quantize_q8(rows: npt.ArrayLike, impl: str | None = ...) -> npt.NDArray[np.uint8]: ...
def decode_q8(rows: npt.ArrayLike, dim: int, out: npt.NDArray[Any], impl: str | None = ...) -> npt.NDArray[Any]: ...
def gather_q8(src: Source, count: int, dim: int, indices: npt.ArrayLike, out: npt.NDArray[Any],
              impl: str | None = ...) -> npt.NDArray[Any]: ...
