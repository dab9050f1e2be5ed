"""``with`` for mcf's readers and writers, written once.

A reader (or any object holding files) closes when its ``with`` block ends, however it ends
(:class:`ClosedOnExit`).  A writer publishes what it wrote when the block ends normally and discards
it when an exception leaves the block (:class:`PublishedOnExit`): a half-written file never takes the
destination's place.  Both are mixins without state (``__slots__ = ()``), so compiled base classes
(the Megatron readers' ``SequenceTable`` and ``ShardTable``) can take them too.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["ClosedOnExit", "PublishedOnExit"]

_Self = TypeVar("_Self")


class ClosedOnExit:
    """``with obj:`` returns ``obj`` and calls its ``close()`` when the block ends."""

    __slots__ = ()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PublishedOnExit(ClosedOnExit):
    """``with writer:`` returns the writer; a block that ends normally calls ``_publish_on_exit()`` (the
    writer's ``close`` or ``finalize``), one left by an exception ``abort()``."""

    __slots__ = ()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._publish_on_exit()
        else:
            self.abort()
