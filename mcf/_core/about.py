"""What this mcf is and what it runs on: its version, where it is installed, the kernel variant, numpy,
Python, the platform and the optional packages.  ``mcf --version`` prints the first line and
``mcf version`` all of it, because a bug report needs every item: a wrong result can come from a
forced kernel variant, an old numpy, or an ``mcf`` imported from another checkout than the one installed.

:data:`VERSION` is the one place the version is written: ``mcf.__version__`` is this, and pyproject.toml
reads it at build time (``[tool.setuptools.dynamic]``).  Nothing here imports an optional package:
their versions come from the installed distributions' metadata.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

__all__ = ["VERSION", "about", "format_about", "version_line"]

VERSION = "0.1.0"


def _package_dir() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_line() -> str:
    """``mcf 0.1.0 (mcf-formats) at /path/to/mcf``."""
    from mcf._core.optional import DISTRIBUTION

    return f"mcf {VERSION} ({DISTRIBUTION}) at {_package_dir()}"


def about() -> dict:
    """Everything :func:`format_about` prints, as plain data (``mcf version --json``)."""
    import numpy as np

    from mcf._core._kernels import kernel_info
    from mcf._core.optional import DISTRIBUTION, EXTRAS

    optional = {}
    for table in EXTRAS.values():
        for _module, requirement in table:
            name = requirement.split("[")[0]
            if name not in optional:
                optional[name] = _distribution_version(name)
    k = kernel_info()
    return {
        "mcf": {"version": VERSION, "location": _package_dir(), "distribution": DISTRIBUTION,
                "installed_distribution_version": _distribution_version(DISTRIBUTION)},
        "kernels": {"active": k["active"], "best": k["best"], "supported": k["supported"], "forced": k["forced"],
                    "env": k["env"]},
        "numpy": {"version": np.__version__, "location": os.path.dirname(np.__file__)},
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": {"system": platform.platform(), "machine": platform.machine()},
        "optional": optional,
    }


def format_about(info: dict) -> str:
    """The report of :func:`about` as ``mcf version`` prints it, one item a line."""
    m, k, py = info["mcf"], info["kernels"], info["python"]
    lines = [f"mcf {m['version']} ({m['distribution']}) at {m['location']}"]
    installed = m["installed_distribution_version"]
    if installed is None:
        lines[0] += f" (no installed {m['distribution']} distribution: imported from a source tree)"
    elif installed != m["version"]:
        lines[0] += f" (the installed {m['distribution']} distribution is {installed}: another copy)"
    forced = f"; {k['env']}={k['forced']!r}" if k["forced"] else f"; force one with {k['env']}"
    active = k["active"]
    active = (f"no variant runs ({active[len('error: '):]})" if active.startswith("error: ") else
              f"{active} active")
    lines.append(f"kernels: {active}; this CPU supports {', '.join(k['supported'])}{forced}")
    lines.append(f"numpy {info['numpy']['version']} at {info['numpy']['location']}")
    lines.append(f"Python {py['version']} ({py['implementation']}) at {py['executable']}")
    lines.append(f"platform: {info['platform']['system']} ({info['platform']['machine']})")
    have = [f"{n} {v}" for n, v in info["optional"].items() if v is not None]
    lacking = [n for n, v in info["optional"].items() if v is None]
    lines.append(f"optional packages: {', '.join(have) or 'none'}"
                 + (f"; not installed: {', '.join(lacking)}" if lacking else ""))
    return "\n".join(lines)
