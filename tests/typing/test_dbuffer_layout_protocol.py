"""The planner's ``Plan`` satisfies dbuffer's ``BufferLayout``, and a DBuffer built on a real plan
works.

Checked twice, each able to fail: statically by mypy --strict in ``nox -s typecheck`` (the real
``Plan`` assigned to ``BufferLayout``; objects missing a member or with a wrongly typed one
assigned under ``# type: ignore[assignment]``, which ``warn_unused_ignores`` turns into an error
the day mypy accepts them), and at runtime (every member the protocol declares, read on a real
plan and checked against the protocol's annotations; the same check rejects an object missing a
member or with a wrongly typed one). ``isinstance`` on the runtime-checkable protocol only sees
that the names exist, so it is not the check.

dbuffer never imports shard_planner; only this cross-package test sees both.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any

import attrs
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import BufferLayout, ContiguousLayout, DBuffer, contiguous_layout
from dbuffer.testing import load_full_, sharded_views
from ragged_dtensor.testing import run_threaded
from shard_planner import Plan, TensorSpec, plan

SHAPES = [(16,), (24, 16), (0, 16), (37, 16), (5,), ()]
BLOCKS = [1, 16, 16, 16, 1, 1]


def _plan(world: int) -> Plan:
    specs = [
        TensorSpec(numel=torch.Size(s).numel(), block=b, name=f"t{i}")
        for i, (s, b) in enumerate(zip(SHAPES, BLOCKS, strict=True))
    ]
    return plan(specs, world_size=world, align=4)


def _protocol_members(protocol: type) -> dict[str, property | types.FunctionType]:
    """What the protocol class declares: its read-only properties and its methods."""
    members = {
        name: value
        for name, value in vars(protocol).items()
        if not name.startswith("_") and isinstance(value, property | types.FunctionType)
    }
    assert members, f"{protocol.__name__} declares no members"
    return members


def _has_type(value: object, expected: Any) -> bool:
    """``value`` is of the annotation ``expected``: ``int`` (not ``bool``), ``str``, or
    ``tuple[X, ...]`` of such (what the layout protocol uses)."""
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is str:
        return isinstance(value, str)
    if typing.get_origin(expected) is tuple:
        item, dots = typing.get_args(expected)
        if dots is not Ellipsis:
            raise NotImplementedError(f"annotation {expected}")
        return isinstance(value, tuple) and all(_has_type(v, item) for v in value)
    raise NotImplementedError(f"annotation {expected}")


def conformance_problems(layout: object, protocol: type, tensors: int) -> list[str]:
    """How ``layout`` fails ``protocol`` at runtime: a declared member missing, a property of
    the wrong type, a method whose positional parameters differ from the protocol's (names
    aside, as mypy compares them) or whose result, for every tensor index, is of the wrong type.
    Empty when it conforms."""
    problems = []
    for name, member in _protocol_members(protocol).items():
        if not hasattr(layout, name):
            problems.append(f"{name}: missing")
            continue
        value = getattr(layout, name)
        if isinstance(member, property):
            assert member.fget is not None
            expected = typing.get_type_hints(member.fget)["return"]
            if not _has_type(value, expected):
                problems.append(f"{name}: {value!r} is not {expected}")
            continue
        hints = typing.get_type_hints(member)
        wanted = list(inspect.signature(member).parameters.values())[1:]  # drop self
        if not callable(value):
            problems.append(f"{name}: not callable")
            continue
        got = list(inspect.signature(value).parameters.values())
        if [p.kind for p in got] != [p.kind for p in wanted] or any(
            typing.get_type_hints(value).get(g.name) != hints[w.name]
            for g, w in zip(got, wanted, strict=True)
        ):
            problems.append(f"{name}: signature {inspect.signature(value)} is not {wanted}")
            continue
        for i in range(tensors):
            result = value(i)
            if not _has_type(result, hints["return"]):
                problems.append(f"{name}({i}): {result!r} is not {hints['return']}")
                break
    return problems


def _members_of(layout: Plan) -> dict[str, object]:
    return {name: getattr(layout, name) for name in _protocol_members(BufferLayout)}


@attrs.frozen
class _NoFingerprint:
    """A plan's layout members but ``fingerprint``: not a ``BufferLayout``."""

    shard_size: int
    world_size: int
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    units: tuple[tuple[int, ...], ...]

    def local_units(self, i: int) -> tuple[int, ...]:
        return self.units[i]


@attrs.frozen
class _StrShardSize:
    """A plan's layout members with ``shard_size`` a string: not a ``BufferLayout``."""

    shard_size: str
    world_size: int
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    fingerprint: str
    units: tuple[tuple[int, ...], ...]

    def local_units(self, i: int) -> tuple[int, ...]:
        return self.units[i]


def test_plan_is_a_buffer_layout() -> None:
    planned = _plan(2)
    tensors = len(SHAPES)
    # statically: mypy --strict must accept the real Plan as a BufferLayout
    layout: BufferLayout = planned
    # at runtime: every declared member, read on the real plan, of the declared type
    assert conformance_problems(layout, BufferLayout, tensors) == []
    # dbuffer's own layout passes the same check (the check does not reject a good layout)
    naive: BufferLayout = contiguous_layout([4, 6], 2)
    also: BufferLayout = ContiguousLayout(5, 2, (0, 4), (4, 6), (1, 1))
    assert conformance_problems(naive, BufferLayout, 2) == []
    assert conformance_problems(also, BufferLayout, 2) == []

    # a non-conforming object is rejected, statically (mypy must flag both assignments, or the
    # ignores are unused: an error under warn_unused_ignores) and at runtime
    units = tuple(planned.local_units(i) for i in range(tensors))
    s, w, o, n = planned.shard_size, planned.world_size, planned.offsets, planned.numels
    missing = _NoFingerprint(s, w, o, n, units)
    wrong = _StrShardSize(str(s), w, o, n, planned.fingerprint, units)
    not_a_layout: BufferLayout = missing  # type: ignore[assignment]
    also_not: BufferLayout = wrong  # type: ignore[assignment]
    assert conformance_problems(not_a_layout, BufferLayout, tensors) == ["fingerprint: missing"]
    assert not isinstance(not_a_layout, BufferLayout)
    (problem,) = conformance_problems(also_not, BufferLayout, tensors)
    assert problem.startswith("shard_size: ")
    assert isinstance(also_not, BufferLayout)  # why isinstance alone could never fail here


@pytest.mark.parametrize("member", sorted(_protocol_members(BufferLayout)))
@pytest.mark.parametrize("breach", ["missing", "wrong type"])
def test_the_runtime_check_rejects_a_plan_with_one_member_broken(member: str, breach: str) -> None:
    """Every member of the protocol counts: the real plan's members with one of them removed or
    given a wrong type is named by the runtime check."""
    planned = _plan(4)
    tensors = len(SHAPES)
    intact = types.SimpleNamespace(**_members_of(planned))
    assert conformance_problems(intact, BufferLayout, tensors) == []  # the copy itself conforms
    values = _members_of(planned)
    value = values[member]

    def as_list(i: int) -> list[int]:  # local_units typed right but returning a list
        return list(planned.local_units(i))

    if breach == "missing":
        del values[member]
    elif callable(value):
        values[member] = as_list
    elif isinstance(value, tuple):
        values[member] = list(value)
    elif isinstance(value, str):
        values[member] = value.encode()
    else:
        assert isinstance(value, int)
        values[member] = float(value)
    problems = conformance_problems(types.SimpleNamespace(**values), BufferLayout, tensors)
    assert len(problems) == 1 and problems[0].startswith(member), problems


def _gather_with_plan(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    layout = _plan(world)
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen) for s in SHAPES]
    buf = load_full_(DBuffer(layout, SHAPES, mesh), full)
    for i, dt in enumerate(sharded_views(buf)):
        if layout.numels[i]:
            assert dt.placements[0] == buf.slots[i].placement
            assert buf.slots[i].placement.local_units == layout.local_units(i)
    buf.unshard()
    for view, tensor, offset in zip(buf.full_views(), full, layout.offsets, strict=True):
        assert torch.equal(view, tensor)
        if tensor.numel():
            assert view.storage_offset() == offset


def test_dbuffer_runs_on_a_planner_plan() -> None:
    for world in (2, 4):
        run_threaded(_gather_with_plan, world)
