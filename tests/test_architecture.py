"""The package's shape, enforced: one API style and one error hierarchy.

These tests read the source with ``ast`` (and import the package only where a rule is about the
runtime objects), so a new module is covered the moment it exists.  Each rule's allow-list is short
and says why each entry is there; growing it needs a reason a reviewer would accept.

The rules read ``mcf/**/*.py`` with ``ast``; the Cython sources (``*.pyx``, ``*.pxd``), which ``ast``
cannot parse, get the bare-raise rule by a line scan (:func:`test_no_bare_builtin_raise_in_cython`).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pathlib
import re

import pytest

import mcf
from mcf import errors

PKG = pathlib.Path(mcf.__file__).parent

# Builtin exceptions that may be raised directly: internal invariants (a bug in mcf, not a user's
# input) and protocol signals.
BUILTIN_RAISE_OK = {"AssertionError", "NotImplementedError", "StopIteration", "StopAsyncIteration",
                    "KeyboardInterrupt", "SystemExit"}
# ... and in Cython, MemoryError after a failed malloc: what Cython itself raises when it cannot allocate
CYTHON_RAISE_OK = BUILTIN_RAISE_OK | {"MemoryError"}

# Parameters with a default that stay positional, because positional is the obvious call:
# (qualified name inside its module, parameter) -> why.
POSITIONAL_OK = {
    # "what to load" / "which dtype" is the one thing a reader call is about
    ("mcf.container.reader", "Container.load", "names"): "c.load(['a', 'b'])",
    ("mcf.loaders.state_dict", "load_file", "names"): "load_file(path, ['a', 'b']), as Container.load(names)",
    ("mcf.torch", "load_file", "device"):
        "safetensors.torch.load_file(filename, device): a drop-in takes it positionally",
    ("mcf.torch", "load_model", "strict"):
        "safetensors.torch.load_model(model, filename, strict, device): a drop-in takes it positionally",
    ("mcf.torch", "load_model", "device"):
        "safetensors.torch.load_model(model, filename, strict, device): a drop-in takes it positionally",
    ("mcf.container.reader", "Container.dequantize", "dtype"): "c.dequantize('w', np.float16)",
    ("mcf.gguf.reader", "GGUFFile.dequantize", "dtype"): "the same signature as Container.dequantize",
    ("mcf.bucket.kvfile", "KVFile.load", "layers"): "kv.load([0, 1])",
    ("mcf.bucket.kvfile", "KVFile.load_copy", "layers"): "kv.load_copy([0, 1])",
    ("mcf.bucket.pages", "crc32c", "value"): "crc32c(data, value), as zlib.crc32(data, value) continues a CRC",
    ("mcf.bucket.ids", "content_hash", "content"): "content_hash('text')",
    ("mcf.bucket.hf", "TransformersBackend.__init__", "tokenizer"): "Hugging Face's own (model, tokenizer) pair",
    ("mcf.bucket.hf", "TransformersBackend.ingest", "content"):
        "backend.ingest(bucket, 'text'), as content_hash('text')",
    ("mcf.bucket.hf", "TransformersBackend.generate", "query"): "backend.generate(bucket, cid, 'question?')",
    ("mcf.apps.bucket_server", "IngestBackend.ingest", "content"): "the protocol TransformersBackend.ingest implements",
    ("mcf.bucket.store", "Bucket.promote", "target_tier"): "b.promote(cid, 'hot')",
    ("mcf.bucket.store", "Bucket.demote", "target_tier"): "b.demote(cid, 'cold')",
    ("mcf.megacontext.tree", "Tree.tokens", "start"): "a range: tree.tokens(0, 100)",
    ("mcf.megacontext.tree", "Tree.tokens", "stop"): "a range: tree.tokens(0, 100)",
    ("mcf.megacontext.tree", "Tree.gists", "which"): "an index: tree.gists(1, slice(0, 8))",
    ("mcf.megacontext.tree", "Tree.assemble", "embeddings"): "tree.assemble(plan, table)",
    ("mcf.megacontext.assembly", "assemble", "embeddings"): "assemble(tree, plan, table)",
    ("mcf.megacontext.tree", "Tree.snapshot", "dest"): "tree.snapshot('/backups/t1')",
    ("mcf.megacontext.snapshots", "snapshot", "dest"): "snapshot(tree, '/backups/t1')",
    ("mcf.megacontext.tree", "open_tree", "mode"): "mirrors builtins.open(path, 'r+')",
    ("mcf.megatron", "open", "prefix"): "the dataset itself (None only with idx=/bin=)",
    ("mcf.megatron.reader", "open", "prefix"): "the dataset itself (None only with idx=/bin=)",
    ("mcf.megatron.reader", "verify", "prefix"): "the dataset itself (None only with idx=/bin=)",
    # signatures copied from Megatron-LM, so code ported from it keeps working
    ("mcf.megatron.writer", "Writer.add_item", "mode"): "Megatron-LM's IndexedDatasetBuilder.add_item",
    ("mcf.megatron.writer", "Writer.add_document", "modes"): "Megatron-LM's IndexedDatasetBuilder.add_document",
    ("mcf.megatron.sample_index", "build_sample_idx", "drop_last_partial_sequence"): "Megatron-LM's helper",
    ("mcf.megatron.sample_index", "build_sample_idx", "add_extra_token_to_sequence"): "Megatron-LM's helper",
    ("mcf.megatron.sample_index", "build_sample_idx", "dtype"): "Megatron-LM's helper",
    ("mcf.megatron.sample_index", "build_document_index", "separate_final_epoch"): "Megatron-LM's helper",
    # protocols defined elsewhere, called positionally by their owners
    ("mcf.conversion.raydata", "TextDatasource.get_read_tasks", "per_task_row_limit"): "Ray's Datasource",
    ("mcf.conversion.raydata", "TextDatasource.get_read_tasks", "data_context"): "Ray's Datasource",
    ("mcf.conversion.raydata", "MegatronDatasource.get_read_tasks", "per_task_row_limit"): "Ray's Datasource",
    ("mcf.conversion.raydata", "MegatronDatasource.get_read_tasks", "data_context"): "Ray's Datasource",
    ("mcf.conversion.raydata", "MegatronDatasink.on_write_start", "schema"): "Ray's Datasink",
    ("mcf.conversion.raydata", "connect", "address"): "mirrors ray.init(address)",
    ("mcf.remote.file", "RemoteFile.read", "size"): "the io.RawIOBase protocol",
    ("mcf.remote.file", "RemoteFile.seek", "whence"): "the io.RawIOBase protocol",
    ("mcf.cli", "main", "argv"): "console-script convention: main(argv=None)",
    # engine plugins: the engines call these methods positionally, with the signatures of their base classes
    ("mcf.bucket.engines.lmcache", "BucketConnector.batched_async_contains", "pin"): "LMCache's RemoteConnector",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.__init__", "kwargs"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.get", "target_location"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.get", "target_sizes"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.batch_get", "target_locations"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.batch_get", "target_sizes"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.set", "value"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.set", "target_location"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.set", "target_sizes"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.batch_set", "values"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.batch_set", "target_locations"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.batch_set", "target_sizes"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.batch_exists", "extra_info"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.batch_get_v1", "extra_info"): "SGLang's HiCacheStorage",
    ("mcf.bucket.engines.sglang", "BucketHiCacheStorage.batch_set_v1", "extra_info"): "SGLang's HiCacheStorage",
}

_BUILTIN_EXC = {n for n in dir(builtins)
                if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), BaseException)}


def _modules():
    """(module name, path, ast) of every .py file of the package."""
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path, ast.parse(path.read_text(encoding="utf-8"), str(path))))
    return out


MODULES = _modules()


def _is_public_module(name: str) -> bool:
    return not any(p.startswith("_") for p in name.split("."))


def _public_functions(tree):
    """(qualified name, FunctionDef) of the module-level functions and the methods of module-level
    classes that are public (``__init__`` counts: it is the class's signature)."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                        not m.name.startswith("_") or m.name == "__init__"):
                    yield f"{node.name}.{m.name}", m


def test_modules_found():
    names = {m for m, _, _ in MODULES}
    assert {"mcf", "mcf.errors", "mcf.container.reader", "mcf.megatron.reader", "mcf.bucket.store"} <= names


def test_no_bare_builtin_raise():
    """Everything raised on purpose derives from MCFError (whose subclasses also inherit the builtin a
    caller would catch), so ``except mcf.MCFError`` catches every refusal of the library."""
    bad = []
    for _mod, path, tree in MODULES:
        # a module's or class's __getattr__ must raise AttributeError itself: hasattr() and getattr() with a
        # default catch only that
        protocol = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
                    for n in ast.walk(f) if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)
                    and getattr(n.exc.func, "id", None) == "AttributeError"}
        for node in ast.walk(tree):
            if id(node) in protocol:
                continue
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in _BUILTIN_EXC and exc.id not in BUILTIN_RAISE_OK:
                    bad.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: raise {exc.id}")
    assert not bad, "raise an mcf.errors class instead:\n" + "\n".join(bad)


def test_no_bare_builtin_raise_in_cython():
    """The same rule for the compiled modules' sources: ``raise ValueError(...)`` in a .pyx escapes
    ``except mcf.MCFError`` just as it would from Python."""
    import re

    raise_re = re.compile(r"^\s*raise\s+([A-Za-z_][A-Za-z0-9_]*)\b")
    bad, scanned = [], 0
    for path in sorted([*PKG.rglob("*.pyx"), *PKG.rglob("*.pxd")]):
        scanned += 1
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = raise_re.match(line)
            if m and m.group(1) in _BUILTIN_EXC and m.group(1) not in CYTHON_RAISE_OK:
                bad.append(f"{path.relative_to(PKG.parent)}:{n}: raise {m.group(1)}")
    assert scanned >= 5, "no Cython sources found: the scan would pass vacuously"
    assert not bad, "raise an mcf.errors class instead:\n" + "\n".join(bad)


def _exception_classes():
    """Every exception class defined in the package (imported, so subclassing is resolved)."""
    found = {}
    for mod, _, tree in MODULES:
        if not any(isinstance(n, ast.ClassDef) for n in tree.body):
            continue
        try:
            m = importlib.import_module(mod)
        except ImportError as exc:  # an optional dependency (ray, torch) is missing
            if isinstance(exc, errors.MissingDependencyError) or exc.name not in (None, mod):
                continue
            raise
        for name, obj in vars(m).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == mod:
                found[f"{mod}.{name}"] = obj
    return found


def test_every_exception_derives_from_mcferror():
    bad = [q for q, cls in _exception_classes().items() if not issubclass(cls, errors.MCFError)]
    assert not bad, f"exception classes outside the MCFError hierarchy: {bad}"


def test_every_exception_is_exported():
    """The classes of mcf.errors are all in ``mcf.__all__``; an exception class defined in another
    public module is exported by its package (``mcf.bucket.WarmBudgetError``)."""
    for name in errors.__all__:
        assert name in mcf.__all__ and getattr(mcf, name) is getattr(errors, name), name
    for q, cls in _exception_classes().items():
        mod, name = q.rsplit(".", 1)
        if name.startswith("_") or not _is_public_module(mod) or mod == "mcf.errors":
            continue
        pkg = importlib.import_module(mod.rsplit(".", 1)[0]) if mod.count(".") > 1 else mcf
        assert getattr(pkg, name, None) is cls and name in getattr(pkg, "__all__", ()), \
            f"{q} is not exported from {pkg.__name__}"
    public = {n for n in dir(errors) if inspect.isclass(getattr(errors, n))
              and issubclass(getattr(errors, n), BaseException) and not n.startswith("_")}
    assert public <= set(errors.__all__)


def test_options_are_keyword_only():
    """After the obvious positional arguments, options are keyword-only, so ``g.dequantize("w",
    np.float16)`` cannot silently bind a dtype to ``out``.  A parameter with a default is
    an option unless POSITIONAL_OK says why positional is the obvious call."""
    bad, used = [], set()
    for mod, path, tree in MODULES:
        if not _is_public_module(mod):
            continue
        for qual, fn in _public_functions(tree):
            pos = fn.args.posonlyargs + fn.args.args
            for arg in pos[len(pos) - len(fn.args.defaults):]:
                key = (mod, qual, arg.arg)
                if key in POSITIONAL_OK:
                    used.add(key)
                else:
                    bad.append(f"{path.relative_to(PKG.parent)}:{fn.lineno}: {qual}({arg.arg}=...)")
    assert not bad, "make these keyword-only (or allow-list them with a reason):\n" + "\n".join(bad)
    assert not set(POSITIONAL_OK) - used, f"stale allow-list entries: {set(POSITIONAL_OK) - used}"


def test_no_private_keywords_in_public_signatures():
    """``restore(_locked=)`` and ``delete(_event=)`` leaked internals into the API: internal variants
    are private functions instead."""
    bad = []
    for mod, path, tree in MODULES:
        if not _is_public_module(mod):
            continue
        for qual, fn in _public_functions(tree):
            a = fn.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs:
                if arg.arg.startswith("_"):
                    bad.append(f"{path.relative_to(PKG.parent)}:{fn.lineno}: {qual}({arg.arg})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("args", [("w", "float16"), ("w",)])
def test_gguf_and_mcf_dequantize_share_an_order(args):
    """The bug that started the rule: both readers take (name, dtype) positionally, the rest by name."""
    from mcf.gguf import GGUFFile

    for fn in (mcf.Container.dequantize, GGUFFile.dequantize):
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.name != "self"]
        assert [p.name for p in params[:2]] == ["name", "dtype"]
        assert all(p.kind is p.KEYWORD_ONLY for p in params[2:]), fn
        sig.bind(None, *args)
        with pytest.raises(TypeError):
            sig.bind(None, "w", "float16", (0, 1))


# -- the import graph ----------------------------------------------------------------------------------

# Circles still in the tree, each with the step that removes it.  The test fails when a new one appears
# and when one of these is gone (so the list only shrinks).
KNOWN_CYCLES: dict[frozenset, str] = {}

# ``from X import _name`` across modules still in the tree (module, imported module, name).
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()


def _is_main_guard(node) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in t.comparators))


def _imports(tree):
    """Every import statement of a module, at any depth (function-level imports are edges too), except
    under ``if __name__ == "__main__":``, which runs only when the module is the program."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if _is_main_guard(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


_CY_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+c?import\s+(.+)|c?import\s+([\w.,\s]+?))\s*(?:#.*)?$")


def _cython_imports(text: str):
    """The import statements of a Cython source (``.pyx``/``.pxd``), which ``ast`` cannot parse, as
    ``ast`` nodes: ``import``, ``cimport``, ``from X import`` and ``from X cimport`` at any depth (a
    function-level import is an edge too).  A parenthesised name list may span lines."""
    nodes, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        m = _CY_IMPORT.match(line)
        i += 1
        if not m:
            continue
        if m.group(1):
            names = m.group(2)
            if names.lstrip().startswith("(") and ")" not in names:
                while i < len(lines) and ")" not in names:
                    names += " " + lines[i]
                    i += 1
            names = names.split("#")[0].strip().strip("()")
            aliases = [ast.alias(n.split(" as ")[0].strip()) for n in names.split(",") if n.strip()]
            nodes.append(ast.ImportFrom(module=m.group(1), names=aliases, level=0))
        else:
            nodes.append(ast.Import(names=[ast.alias(n.split(" as ")[0].strip())
                                           for n in m.group(3).split(",") if n.strip()]))
    return nodes


def _cython_modules():
    """(module name, path, import nodes) of every compiled module: its .pyx and .pxd together."""
    out: dict[str, list] = {}
    paths = {}
    for path in sorted([*PKG.rglob("*.pyx"), *PKG.rglob("*.pxd")]):
        if "_include" in path.parts:   # mcf.get_include()'s copies of the .pxd files
            continue
        mod = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        out.setdefault(mod, []).extend(_cython_imports(path.read_text(encoding="utf-8")))
        paths.setdefault(mod, path)
    return [(mod, paths[mod], nodes) for mod, nodes in out.items()]


CYTHON = _cython_modules()


def _graph():
    compiled = {m for m, _, _ in CYTHON}
    names = {m for m, _, _ in MODULES} | compiled
    edges: dict[str, set[str]] = {m: set() for m in names}
    private = []
    sources = [(mod, path, list(_imports(tree))) for mod, path, tree in MODULES] + CYTHON
    for mod, path, nodes in sources:
        is_pkg = path.name == "__init__.py"
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[:len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = []
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.append((full, None) if full in names or full in compiled else (base, a.name))
            for target, name in targets:
                if target in names and target != mod:
                    edges[mod].add(target)
                if name and name.startswith("_") and not name.startswith("__") and target != mod \
                        and (target == "mcf" or target.startswith("mcf.")):
                    private.append((mod, target, name))
    return edges, private


def _cycles(edges):
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
    return out


def test_no_import_cycles():
    edges, _ = _graph()
    found = set(_cycles(edges))
    new = [sorted(c) for c in found - set(KNOWN_CYCLES)]
    assert not new, f"import circles (function-level imports count): {new}"
    gone = [sorted(c) for c in set(KNOWN_CYCLES) - found]
    assert not gone, f"remove these from KNOWN_CYCLES, they are gone: {gone}"


def test_cycle_detection_sees_function_level_imports():
    tree = ast.parse("def f():\n    from mcf.b import x\nif __name__ == '__main__':\n    import mcf.c\n")
    assert [ast.unparse(n) for n in _imports(tree)] == ["from mcf.b import x"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [frozenset({"a", "b"})]


def test_no_private_names_imported_across_modules():
    """``from mcf.container.writer import _create_temp`` made a writer's internals another module's API; a helper
    two modules need is public in a (possibly private) module.  Private modules may be imported."""
    _, private = _graph()
    new = sorted(set(private) - KNOWN_PRIVATE_IMPORTS)
    assert not new, "\n".join(f"{m}: from {t} import {n}" for m, t, n in new)
    gone = KNOWN_PRIVATE_IMPORTS - set(private)
    assert not gone, f"remove from KNOWN_PRIVATE_IMPORTS: {sorted(gone)}"


# -- the layers (docs/architecture.md draws this table) ------------------------------------------------

CORE, FORMAT, CONVERTER, APP = 0, 1, 2, 3
LAYER_NAMES = {CORE: "core", FORMAT: "format", CONVERTER: "converter", APP: "app"}

# module (or package prefix) -> (layer, group); the longest matching entry wins.  The package's directories
# are the layers; the faces at the top (mcf/*.py) each sit in the layer of what they do.  Formats are groups:
# a format never imports another format.
LAYERS = {
    # core: imports only core, the standard library and numpy
    "mcf._core": (CORE, "core"), "mcf.remote": (CORE, "core"), "mcf.loading": (CORE, "core"),
    "mcf.errors": (CORE, "core"), "mcf.io": (CORE, "core"),
    # formats: one package each
    "mcf.container": (FORMAT, "mcf"), "mcf.safetensors": (FORMAT, "safetensors"), "mcf.gguf": (FORMAT, "gguf"),
    "mcf.megatron": (FORMAT, "megatron"), "mcf.megacontext": (FORMAT, "megacontext"), "mcf.bucket": (FORMAT, "bucket"),
    # converters and loaders: formats + core
    "mcf.conversion": (CONVERTER, "converter"), "mcf.loaders": (CONVERTER, "converter"),
    "mcf.torch": (CONVERTER, "converter"),
    # apps: anything
    "mcf.apps": (APP, "app"), "mcf": (APP, "app"),
}


def layer_of(module: str):
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    raise AssertionError(f"{module} has no layer: add it to LAYERS (and docs/architecture.md)")


def test_layers():
    """Core imports nothing above it; a format imports core (and itself) only; converters import
    formats and core; apps import anything."""
    edges, _ = _graph()
    bad = []
    for a in sorted(edges):
        la, ga = layer_of(a)
        for b in sorted(edges[a]):
            lb, gb = layer_of(b)
            if lb > la or (la == lb == FORMAT and ga != gb):
                bad.append(f"{a} ({LAYER_NAMES[la]} {ga}) imports {b} ({LAYER_NAMES[lb]} {gb})")
    assert not bad, "\n".join(bad)


def test_layer_table_is_documented():
    doc = (PKG.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    for module in LAYERS:
        assert f"`{module}`" in doc, f"docs/architecture.md does not place {module}"


# the faces: the only modules at the top of the package (everything else lives in its layer's directory)
FACES = {"__init__", "__main__", "cli", "errors", "io", "torch"}


def test_tree_names_the_layers():
    """The directories are the layers: every package directory is one entry of LAYERS, every entry is a
    directory or a face, and the top of the package holds only the faces.  docs/architecture.md's tree
    names each directory."""
    dirs = {f"mcf.{p.name}" for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    tops = {p.stem for p in PKG.glob("*.py")}
    assert tops == FACES, f"modules at the top that are not faces: {sorted(tops - FACES)}"
    faces = {"mcf"} | {f"mcf.{f}" for f in FACES - {"__init__", "__main__", "cli"}}
    assert set(LAYERS) == dirs | faces, (sorted(set(LAYERS) - dirs - faces), sorted(dirs - set(LAYERS)))
    doc = (PKG.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    tree = doc.split("## The tree", 1)[1].split("## ", 1)[0]
    for d in sorted(dirs):
        assert f"  {d.split('.', 1)[1]}/" in tree, f"docs/architecture.md's tree does not show {d}"


def test_cython_imports_are_read():
    """The Cython sources' imports are edges: the kernels' layout import is seen (the check cannot pass by
    reading nothing), and every form of the statement parses."""
    edges, _ = _graph()
    assert "mcf._core.block_layout" in edges["mcf._core._kernels"]
    assert "mcf._core._fpconv" in edges["mcf.gguf._gguf"]          # a cimport
    assert "mcf._core._io" in edges["mcf.megatron._megatron"]
    nodes = _cython_imports("from a.b cimport (x,\n    y as _y)\n    import c.d, e\nfrom f import g  # note\n"
                            "cdef int z = 0\n")
    assert [ast.unparse(n) for n in nodes] == ["from a.b import x, y", "import c.d, e", "from f import g"]
