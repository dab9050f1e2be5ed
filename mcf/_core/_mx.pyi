import numpy as np
import numpy.typing as npt

SCALED_CODES: frozenset[int]
ELEMENT_CODES: frozenset[int]

def decode_elements(
    src: npt.ArrayLike, code: int | str, *, count: int | None = ..., dtype: npt.DTypeLike = ...,
    out: np.ndarray | None = ..., impl: str | None = ...,
) -> np.ndarray: ...
def first_nan_scale(
    payload: npt.ArrayLike, code: int | str, shape: tuple[int, ...], *, rows: tuple[int, int] | None = ...,
) -> tuple[str, str] | None: ...
def dequantize(
    payload: npt.ArrayLike, code: int | str, shape: tuple[int, ...], *, dtype: npt.DTypeLike = ...,
    row_range: tuple[int, int] | slice | None = ..., out: np.ndarray | None = ..., impl: str | None = ...,
    threads: int = ...,
) -> np.ndarray: ...
