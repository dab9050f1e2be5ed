"""The pages area's compiled part: CRC-32C and whole batches of page reads, writes and existence checks."""

from collections.abc import Sequence

from typing import TypeAlias

_Buffer: TypeAlias = bytes | bytearray | memoryview

OK: int
ABSENT: int
EXPIRED: int
OTHER_SIZE: int
SHORT: int
ERROR: int
NEVER: int

def crc32c(data: _Buffer, value: int = 0, impl: str | None = None) -> int: ...
def crc32c_variant(impl: str | None = None) -> str: ...
def read_pages(dir_fd: int, names: list[bytes], heads: list[bytearray], payloads: list[Sequence[_Buffer]], *,
               threads: int = 1, impl: str | None = None, checksum: bool = True,
               expire_ns: int = ...) -> list[tuple[int, int, int, tuple[int, int, int, int, int]]]: ...
def write_pages(dir_fd: int, tmp_names: list[bytes], names: list[bytes], heads: list[bytearray],
                head_sum_lens: list[int], payloads: list[Sequence[_Buffer]], *, payload_crc_at: int, head_crc_at: int,
                threads: int = 1, impl: str | None = None, set_mtime_ns: int = -1,
                durable: bool = False) -> list[tuple[int, int]]: ...
def live_pages(dir_fd: int, names: list[bytes], *, min_size: int = 0, expire_ns: int = ...,
               stop_at_gap: bool = True) -> int | bytes: ...
