"""Input value types of the planner and their validation.

[Note: what a block is]
A tensor's *block* is its atomic unit in elements: the planner never lets a shard boundary fall
strictly inside a block. Blocks tile the tensor's row-major storage from its first element, so the
block must divide ``numel``. ``block == 1`` means "no constraint". For an ``(R, C)`` matrix whose
optimizer or quantizer works on ``r``-row groups the block is ``r * C`` elements; a RaggedShard
with ``dims=(0,)`` and the block as its unit then describes each rank's part exactly.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import attrs

__all__ = ["TensorSpec", "check_inputs"]


def _integer(value: object, field: str) -> int:
    """Any integer (Python or numpy) as ``int``; bool and float rejected with a TypeError."""
    if isinstance(value, bool):
        raise TypeError(f"TensorSpec.{field} must be an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"TensorSpec.{field} must be an int, got {type(value).__name__}") from None


def _numel(value: object) -> int:
    return _integer(value, "numel")


def _block(value: object) -> int:
    return _integer(value, "block")


def as_count(value: object, argument: str, minimum: int = 1) -> int:
    """``value`` as an ``int >= minimum`` (numpy integers welcome), else ``ValueError``."""
    if not isinstance(value, bool):
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            number = None
        if number is not None and number >= minimum:
            return number
    raise ValueError(f"{argument} must be an int >= {minimum}, got {value!r}")


@attrs.frozen
class TensorSpec:
    """One tensor of a group: ``numel`` elements cut only at multiples of ``block`` elements.

    A zero-size tensor (``numel == 0``) is allowed; it occupies no space in the buffer.
    Bad values raise ``ValueError`` at construction; :func:`check_inputs` re-checks a whole group
    so an error can also name the tensor's position in it.
    """

    numel: int = attrs.field(converter=_numel)
    block: int = attrs.field(default=1, converter=_block)
    name: str = ""

    def __attrs_post_init__(self) -> None:
        where = f"TensorSpec {self.name!r}" if self.name else "TensorSpec"
        if self.numel < 0:
            raise ValueError(f"{where}: numel must be >= 0, got {self.numel}")
        if self.block < 1:
            raise ValueError(f"{where}: block must be >= 1 element, got {self.block}")
        if self.numel % self.block != 0:
            raise ValueError(
                f"{where}: block {self.block} must divide numel {self.numel} "
                f"(blocks tile the tensor from its first element)"
            )


def _label(index: int, spec: TensorSpec) -> str:
    return f"tensor {index} ({spec.name!r})" if spec.name else f"tensor {index}"


def check_inputs(specs: Sequence[TensorSpec], world_size: object, align: object) -> tuple[int, int]:
    """Raise ``ValueError`` naming the offending argument or tensor if the input is malformed.

    Returns ``(world_size, align)`` as Python ints (numpy integers are accepted).
    """
    world = as_count(world_size, "world_size")
    quantum = as_count(align, "align")
    if len(specs) == 0:
        raise ValueError("specs is empty: a group needs at least one TensorSpec")
    for index, spec in enumerate(specs):
        if not isinstance(spec, TensorSpec):
            raise ValueError(f"specs[{index}] must be a TensorSpec, got {type(spec).__name__}")
        if spec.numel < 0:
            raise ValueError(f"{_label(index, spec)}: numel must be >= 0, got {spec.numel}")
        if spec.block < 1:
            raise ValueError(f"{_label(index, spec)}: block must be >= 1 element, got {spec.block}")
        if spec.numel % spec.block != 0:
            raise ValueError(
                f"{_label(index, spec)}: block {spec.block} must divide numel "
                f"{spec.numel} (blocks tile the tensor from its first element)"
            )
    return world, quantum
