from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

IMPLS: tuple[str, str, str, str]

def resolve_impl(impl: str | None = ...) -> int: ...
def kernel_info() -> dict[str, Any]: ...
def dequantize(
    payload: npt.ArrayLike, code: int, rows: int, cols: int, *, domain: int = ..., dtype: npt.DTypeLike = ...,
    row_range: tuple[int, int] | slice | None = ..., out: np.ndarray | None = ..., impl: str | None = ...,
    threads: int = ...,
) -> np.ndarray: ...
def unpack_codes(
    payload: npt.ArrayLike, code: int, rows: int, cols: int, *, domain: int = ...,
    row_range: tuple[int, int] | slice | None = ..., impl: str | None = ...,
) -> npt.NDArray[np.int8]: ...
def absmax(src: npt.ArrayLike, impl: str | None = None) -> float: ...
def absmax_finite(src: npt.ArrayLike) -> tuple[float, float, float]: ...
def quantize_rows(
    src: npt.ArrayLike, code: int | str, out_payload: npt.NDArray[np.uint8], row0: int, *, min_clip: float,
    max_clip: float, compat: bool = ..., cols: int | None = ..., rows: int | None = ..., scale: float = ...,
    zero: float = ..., domain: int = ..., impl: str | None = ..., search: bool = ...,
    weights: npt.NDArray[np.float32] | None = ...,
) -> None: ...
def feedback_batch(
    wt: npt.NDArray[np.float64], st: npt.NDArray[np.float32], inv: npt.NDArray[np.float32],
    u: npt.NDArray[np.float64], codes: npt.NDArray[np.int8], err: npt.NDArray[np.float64], c0: int, c1: int,
    bits: int,
) -> None: ...
def pack_codes(
    codes: npt.NDArray[np.int8], code: int | str, out_payload: npt.NDArray[np.uint8], row0: int, *, rows: int,
    cols: int,
) -> None: ...

@disjoint_base
class QTensor:
    layout: Any
    def __init__(self, payload: npt.ArrayLike, code: int, rows: int, cols: int, domain: int = ...,
                 impl: str | None = ...) -> None: ...
    def rows_into(self, r0: int, r1: int, out: npt.NDArray[np.float32]) -> None: ...
    def decode_tiles(self, r0: int, r1: int, tile_rows: int, tile: npt.NDArray[np.float32]) -> int: ...
def out_kind(dt: npt.DTypeLike) -> int: ...
