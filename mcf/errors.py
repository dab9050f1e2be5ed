"""The exceptions of mcf.

Every error the library raises on purpose derives from :class:`MCFError`, so a tool that wraps mcf can
catch one class.  Each concrete class also derives from the builtin a Python user would reach for first
(``ValueError`` for a malformed file, ``KeyError`` for a missing tensor, ``IndexError`` for a read past
the end, ``OSError`` for I/O), so code written against the builtins keeps working.

Format errors carry structured context (file, field, offset, expected, got) and render it into the
message, because "corrupt file" alone is useless to someone holding a 70 GB checkpoint.

A URL in a message is shown through :func:`mcf.remote.redact` (no password, token or signature), and the
classes see to it themselves: every string argument of an :class:`MCFError` (an OS error's file name
included, and so every rendered :class:`FormatError`) passes through
:func:`mcf._core.redaction.redact_text`, so no message can show a credential, whichever call site built it.
"""

from __future__ import annotations

from typing import Any

from mcf._core.redaction import redact_text

__all__ = [
    "MCFError",
    "StaleContextError",
    "EncryptionKeyError",
    "FormatError",
    "TruncatedError",
    "UnsupportedVersionError",
    "ChecksumError",
    "OutOfBoundsError",
    "TensorNotFoundError",
    "LoadMismatchError",
    "DTypeError",
    "ClosedError",
    "MCFIOError",
    "AllocationError",
    "InvalidArgumentError",
    "MissingFileError",
    "AccessError",
    "ContextNotFoundError",
    "MissingDependencyError",
    "ArgumentTypeError",
    "WorkerError",
    "UnknownNameError",
]


class MCFError(Exception):
    """Base class of every exception raised by mcf (its string arguments with any URL redacted)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*(_shown(a) for a in args), **kwargs)


def _shown(value):
    """``value`` as a message may show it: a string with every URL in it redacted, anything else as is."""
    return redact_text(value) if isinstance(value, str) else value


class FormatError(MCFError, ValueError):
    """The bytes of a file do not follow its format.

    ``path``, ``field``, ``offset``, ``expected`` and ``got`` are kept as attributes (``None`` when not
    known) and rendered as ``<path>: <field> at offset <offset>: <reason> (expected <expected>, got
    <got>)``.
    """

    def __init__(
        self,
        reason: str,
        *,
        path: Any = None,
        field: str | None = None,
        offset: int | None = None,
        expected: Any = None,
        got: Any = None,
    ) -> None:
        self.reason = reason
        self.path = None if path is None else _shown(str(path))
        self.field = field
        self.offset = offset
        self.expected = expected
        self.got = got
        super().__init__(self._render())   # (MCFError redacts the whole message: reason, expected, got)

    def _render(self) -> str:
        where = []
        if self.path is not None:
            where.append(self.path)
        loc = self.field or ""
        if self.offset is not None:
            loc = f"{loc} at offset {self.offset}" if loc else f"offset {self.offset}"
        if loc:
            where.append(loc)
        msg = ": ".join(where + [self.reason]) if where else self.reason
        extra = []
        if self.expected is not None:
            extra.append(f"expected {self.expected}")
        if self.got is not None:
            extra.append(f"got {self.got}")
        if extra:
            msg += " (" + ", ".join(extra) + ")"
        return msg

    def __reduce__(self):  # keep the structured fields across pickling (multiprocessing workers)
        return (
            _rebuild_format_error,
            (type(self), self.reason, self.path, self.field, self.offset, self.expected, self.got),
        )


def _rebuild_format_error(cls, reason, path, field, offset, expected, got):
    return cls(reason, path=path, field=field, offset=offset, expected=expected, got=got)


class TruncatedError(FormatError):
    """A structure extends past the end of the file (or of its section)."""


class UnsupportedVersionError(FormatError):
    """The file declares a major version (or a section version) this library cannot read."""


class ChecksumError(FormatError):
    """Stored and computed checksums disagree."""


class OutOfBoundsError(MCFError, IndexError):
    """A caller asked for bytes, rows or items outside what exists."""


class TensorNotFoundError(MCFError, KeyError):
    """No tensor with that name exists in the container."""

    def __str__(self) -> str:  # KeyError would repr() the message, quoting it
        return str(self.args[0]) if self.args else ""


class LoadMismatchError(MCFError, RuntimeError):
    """A checkpoint and the tensors it is loaded into disagree: tensors missing or unexpected, or shapes that
    differ.  A RuntimeError, as ``torch.nn.Module.load_state_dict`` and ``safetensors.torch.load_model`` raise
    for the same disagreements; the message names every tensor concerned."""


class DTypeError(MCFError, TypeError):
    """The operation does not apply to the dtype (e.g. a raw view of a quantized tensor)."""


class ClosedError(MCFError, ValueError):
    """The file was closed; views handed out earlier stay valid, new reads are refused."""


class MCFIOError(MCFError, OSError):
    """An operating-system level I/O failure, with the file named."""


class AllocationError(MCFError, MemoryError):
    """Memory for what a file holds (a tensor, the results of a load) cannot be had: more bytes than this
    machine's RAM and swap, refused before allocating, or refused by the allocator.  The message names the
    file, the tensor and the bytes (docs/reliability.md, "Memory a file can ask for")."""


class InvalidArgumentError(MCFError, ValueError):
    """A caller passed a value the writer or reader cannot accept (bad name, shape, dtype, option)."""


class ArgumentTypeError(MCFError, TypeError):
    """A caller passed an argument of a type the function cannot take (a float as a dataset index, an
    object JSON cannot encode)."""


class WorkerError(MCFError, RuntimeError):
    """A worker process of a parallel run died (killed, out of memory) or could not start; the message
    names the input and where in it the run stopped."""


class UnknownNameError(MCFError, KeyError):
    """A caller asked for a name that is not one of the known ones (a resource kind, a layout region)."""

    def __str__(self) -> str:  # KeyError would repr() the message, quoting it
        return str(self.args[0]) if self.args else ""


class MissingFileError(MCFIOError, FileNotFoundError):
    """The file does not exist."""


class AccessError(MCFIOError, PermissionError):
    """The operating system refused access to the file."""


def os_error(exc: OSError, path: Any) -> MCFIOError:
    """Wrap an ``OSError`` so it is also an :class:`MCFError` and names the file."""
    import errno as _errno

    cls = MCFIOError
    if exc.errno == _errno.ENOENT:
        cls = MissingFileError
    elif exc.errno in (_errno.EACCES, _errno.EPERM):
        cls = AccessError
    err = cls(exc.errno, exc.strerror or str(exc), str(path) if path is not None else None)
    return err


def in_tensor(exc: MCFError, path: Any, name: str) -> MCFError:
    """``exc`` again, of the same class, with the source file and the tensor in front of its message.

    Converters and quantizers handle one tensor at a time; an error deep in a kernel ("a block scale
    overflows float16") is useless without "which file, which tensor" when a checkpoint holds hundreds.
    Format errors keep their structured fields (the tensor goes into ``field`` when it has none); OS
    errors already name their file and are returned as they are."""
    where = f"tensor {name!r}"
    if isinstance(exc, MCFIOError):
        return exc
    if isinstance(exc, FormatError):
        field = where if exc.field is None else (exc.field if repr(name) in exc.field else f"{where} {exc.field}")
        return type(exc)(exc.reason, path=exc.path if exc.path is not None else path, field=field,
                         offset=exc.offset, expected=exc.expected, got=exc.got)
    msg = str(exc)
    prefix = f"{path}: {where}" if path is not None else where
    if not msg.startswith(prefix):
        msg = f"{prefix}: {msg}"
    try:
        return type(exc)(msg)
    except TypeError:  # a subclass with a different constructor: keep it, the cause names the tensor
        return exc


class ContextNotFoundError(MCFError, KeyError):
    """No (unexpired) context with that id exists in the bucket, or no model with that id is known."""

    def __str__(self) -> str:  # KeyError would repr() the message, quoting it
        return str(self.args[0]) if self.args else ""


class StaleContextError(InvalidArgumentError):
    """The context was computed by other weights than its model's current ones (the model was registered
    again with another ``model_hash``): its KV cache would give wrong answers.  ``Bucket.load(force=True)``
    loads it anyway."""


class EncryptionKeyError(InvalidArgumentError):
    """A context's KV data is encrypted under a key this bucket object does not hold (or it holds none):
    it cannot be loaded here, and ingesting the same content here must neither return it as if it were
    usable nor overwrite it (the holders of that key would lose it).  The REST server answers 409."""


class MissingDependencyError(MCFError, ImportError):
    """An optional package that a feature needs is not installed (or does not import).

    Raised where the feature is used, not when mcf is imported.  ``package`` is what to ``pip install``,
    ``extra`` the mcf extra that installs it (``None`` when none does) and ``feature`` what needed it;
    the message says all three, with the command to run.  ``missing`` lists every package of the extra
    that is not installed, ``package`` first: the user installs them in one go instead of meeting them
    one failure at a time.  Also an ``ImportError`` (its ``name`` is the package), so
    ``except ImportError`` keeps working.
    """

    def __init__(self, message: str, *, package: str | None = None, extra: str | None = None,
                 feature: str | None = None, missing=()) -> None:
        super().__init__(message, name=package)
        self.package = package
        self.extra = extra
        self.feature = feature
        self.missing = tuple(missing) or ((package,) if package else ())

    def __reduce__(self):  # ImportError pickles its keyword arguments away
        return (_rebuild_missing_dependency, (type(self), str(self.args[0]) if self.args else "", self.package,
                                              self.extra, self.feature, self.missing))


def _rebuild_missing_dependency(cls, message, package, extra, feature, missing=()):
    return cls(message, package=package, extra=extra, feature=feature, missing=missing)
