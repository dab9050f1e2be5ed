from typing import Any, Callable

def scan_entries(
    sec: Any, entries_off: int, count: int, dims_off: int, dims_count: int, strings_off: int, strings_size: int,
    check_range: bool, d_lo: int, d_hi: int, aligned64: bool, max_rank: int, dtinfos: list, itemsizes: list,
    extensions: dict, info_cls: type, quant_size: Callable[..., int], ferr: Callable[..., BaseException],
) -> tuple[list, list[bytes], bool]: ...
