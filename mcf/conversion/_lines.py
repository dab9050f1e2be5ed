"""What the tokenizer's two readers of lines share: the one in the calling process
(:mod:`mcf.conversion.tokenize`) and the workers' (:mod:`mcf.conversion._tokpool`) must count lines and
refuse a line that is too long in the same words, so that an error names the same line either way."""

from __future__ import annotations

import numpy as np

from mcf.errors import FormatError


def too_long(path: str, max_line_bytes: int, n: int) -> FormatError:
    """The error for line ``n`` of ``path``, longer than ``max_line_bytes``."""
    return FormatError(f"line longer than the {max_line_bytes} bytes allowed (max_line_bytes; "
                       "--max-line-bytes on the command line)", path=path, field=f"line {n}",
                       expected=f"at most {max_line_bytes} bytes")


def newline_mask(data: bytes) -> np.ndarray:
    """Where ``data`` holds ``\\n`` (numpy finds them a few times faster than ``bytes.count`` counts them)."""
    return np.frombuffer(data, np.uint8) == 10


def newlines(data: bytes) -> int:
    """How many ``\\n`` ``data`` holds."""
    return int(np.count_nonzero(newline_mask(data)))
