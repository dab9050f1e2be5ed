"""The pieces of a tensor a loader can be asked for: :class:`Rows` (a range along the first dimension)
and :class:`Shard` (rank ``k`` of ``n`` equal parts along one dimension, what tensor parallelism
needs).

Both come down to one cut, ``(dim, start, stop)``: keep indices ``start:stop`` of dimension ``dim`` and
everything of the others.  That is what the read plan turns into byte ranges (one range when the cut
is contiguous in the row-major file, one per index of the dimensions before ``dim`` otherwise), so a
rank reads its own bytes and no others.

Uneven splits are refused, as Megatron-LM refuses them: ranks of one tensor-parallel group must agree
on every parameter's shape, and a rule that gives the last rank fewer rows hides a wrong ``world``
until the model's shapes disagree somewhere else.  A split of your own (padded vocabularies, unequal
experts) is a :class:`Rows` per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcf._core.args import integer
from mcf.errors import InvalidArgumentError, OutOfBoundsError

__all__ = ["Rows", "Shard", "shard_range", "cut_of"]


@dataclass(frozen=True)
class Rows:
    """Rows ``start:stop`` of a tensor (its first dimension), ``0 <= start <= stop <= shape[0]``."""

    start: int
    stop: int

    def __post_init__(self):
        start, stop = integer(self.start, "Rows start"), integer(self.stop, "Rows stop")
        if not 0 <= start <= stop:
            raise InvalidArgumentError(f"Rows({start}, {stop}): expected 0 <= start <= stop")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "stop", stop)


@dataclass(frozen=True)
class Shard:
    """Part ``rank`` of ``world`` equal parts along dimension ``dim`` (negative counts from the end, as
    in torch); the dimension must divide evenly."""

    rank: int
    world: int
    dim: int = 0

    def __post_init__(self):
        rank, world = integer(self.rank, "Shard rank"), integer(self.world, "Shard world")
        dim = integer(self.dim, "Shard dim")
        if world < 1 or not 0 <= rank < world:
            raise InvalidArgumentError(f"Shard(rank={rank}, world={world}): expected world >= 1 and "
                                       "0 <= rank < world")
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "world", world)
        object.__setattr__(self, "dim", dim)


def shard_range(n: int, tp_rank: int, tp_size: int, *, what: str = "dimension") -> tuple[int, int]:
    """``[start, stop)`` of rank ``tp_rank`` of ``tp_size`` equal shares of ``n``; ``n`` must divide evenly
    (Megatron's rule: an uneven split would give ranks different parameter shapes)."""
    if n % tp_size:
        raise InvalidArgumentError(f"{what} of size {n} does not split evenly into {tp_size} tensor-parallel ranks")
    k = n // tp_size
    return tp_rank * k, (tp_rank + 1) * k


def cut_of(spec, shape: tuple, what: str):
    """``(dim, start, stop)`` of ``spec`` (a :class:`Rows`, a :class:`Shard` or None: the whole tensor,
    returned as None) on a tensor of ``shape``; ``what`` names the tensor and file in errors."""
    if spec is None:
        return None
    nd = len(shape)
    if isinstance(spec, Rows):
        if nd == 0:
            raise InvalidArgumentError(f"{what} is a scalar (shape ()): it has no rows for {spec}")
        if spec.stop > shape[0]:
            raise OutOfBoundsError(f"{what}: {spec} is outside its {shape[0]} rows (shape {tuple(shape)})")
        return 0, spec.start, spec.stop
    if isinstance(spec, Shard):
        dim = spec.dim + nd if spec.dim < 0 else spec.dim
        if not 0 <= dim < nd:
            raise InvalidArgumentError(f"{what} of shape {tuple(shape)} has no dimension {spec.dim} to split "
                                       f"for {spec}")
        start, stop = shard_range(shape[dim], spec.rank, spec.world, what=f"{what} dimension {dim}")
        return dim, start, stop
    raise AssertionError(f"cut_of: {spec!r} reached it unchecked")
