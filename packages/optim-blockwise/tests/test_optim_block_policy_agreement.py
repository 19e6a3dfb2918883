"""AdamW8bit and the block policy its parameters were sharded with: settings that disagree are
refused at construction naming both values, agreeing ones train as before (policy.py's note).

Numerics: the same arithmetic on every side (settings from the policy or given): bitwise.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Any

import pytest
import torch
from optim_support import (
    check_against_single,
    dist_run_steps,
    ragged_spec,
    run_steps,
    shard,
)
from torch.distributed.device_mesh import init_device_mesh

import optim_blockwise as ob
from optim_blockwise._private.layout import ParamLayout
from optim_blockwise._private.policy import check_adamw8bit_blocks
from ragged_dtensor.testing import expect_error_on_every_rank, run_threaded

pytestmark = pytest.mark.numerics


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(64, 64)), torch.nn.Parameter(torch.zeros(8, 64))]


@pytest.mark.parametrize(
    ("policy", "settings", "ours", "theirs"),
    [
        # the case: min_8bit_size differs (tensors of 256..4095 elements unconstrained)
        ({"block_size": 64}, {"min_8bit_size": 256}, "min_8bit_size=256", "min_8bit_size=4096"),
        ({"block_size": 64}, {"block_size": 128}, "block_size=128", "block_size=64"),
        (
            {"block_size": 64, "min_8bit_size": 512},
            {"block_size": 128, "min_8bit_size": 256},
            "block_size=128, min_8bit_size=256",
            "block_size=64, min_8bit_size=512",
        ),
    ],
)
def test_policy_settings_that_disagree_are_refused_naming_both(
    policy: dict[str, int], settings: dict[str, int], ours: str, theirs: str
) -> None:
    given = ob.AdamW8bit.block_policy(**policy)
    with pytest.raises(ValueError, match="disagrees with its block_policy") as info:
        ob.AdamW8bit(_params(), block_policy=given, **settings)
    message = str(info.value)
    assert f"AdamW8bit({ours})" in message, message
    assert repr(given) in message and f"({theirs})" in message, message
    assert "for parameter" in message and "multiples of" in message, message


@pytest.mark.parametrize(
    ("policy", "settings"),
    [
        ({"block_size": 64}, {"block_size": 32}),  # issue 33: a block size dividing the policy's
        ({"block_size": 64}, {"block_size": 1}),
        ({"min_8bit_size": 256}, {"min_8bit_size": 4096}),  # the policy asks more than needed
        ({"block_size": 128, "min_8bit_size": 256}, {"block_size": 64, "min_8bit_size": 512}),
    ],
)
def test_settings_compatible_with_the_policy_are_accepted(
    policy: dict[str, int], settings: dict[str, int]
) -> None:
    """Compatible: for every tensor kept in 8 bits, the policy's block is a multiple of
    gcd(numel, block_size), so no shard boundary it allows cuts a quantization block. The
    settings given are the optimizer's; given, recorded on the parameters, or both."""
    given = ob.AdamW8bit.block_policy(**policy)
    opt = ob.AdamW8bit(_params(), block_policy=given, **settings)
    want = {**{"block_size": given.block_size, "min_8bit_size": given.min_8bit_size}, **settings}
    assert {"block_size": opt.block_size, "min_8bit_size": opt.min_8bit_size} == want
    params = _params()
    for p in params:
        p.block_policy = given  # type: ignore[attr-defined]
    ob.AdamW8bit(params, **want)
    ob.AdamW8bit(params, block_policy=given, **settings)


def test_a_policy_recorded_on_the_parameters_is_checked_like_a_given_one() -> None:
    """``param.block_policy`` (what fsdp_engine.fully_shard records): an AdamW8bitBlockPolicy
    not compatible with the optimizer's settings is refused naming both values and the first
    parameter it is not compatible for, with or without a policy given to the optimizer;
    agreeing or compatible settings and other policy callables (an LCM of several optimizers'
    policies, a Muon policy) pass as before."""
    recorded = ob.AdamW8bit.block_policy(block_size=64)
    params = _params()
    for p in params:
        p.block_policy = recorded  # type: ignore[attr-defined]
    with pytest.raises(ValueError) as info:
        ob.AdamW8bit(params, block_size=64, min_8bit_size=256)
    message = str(info.value)
    assert message.startswith("AdamW8bit(min_8bit_size=256) disagrees with the block policy "), (
        message
    )
    assert f"{recorded!r} (min_8bit_size=4096)" in message and "'params'][1]" in message
    assert "(512 elements) blocks of 1 elements" in message and "multiples of 64" in message
    with pytest.raises(ValueError, match=r"AdamW8bit\(block_size=256\) disagrees"):
        ob.AdamW8bit(params)  # the defaults differ too
    ob.AdamW8bit(params, block_size=64)  # agreeing
    ob.AdamW8bit(params, block_size=32)  # compatible: 32 divides the policy's 64
    ob.AdamW8bit(params, block_policy=recorded)  # given and recorded agree
    for p in params:
        p.block_policy = ob.Muon.block_policy()  # type: ignore[attr-defined]
    ob.AdamW8bit(params, block_size=128)  # not an AdamW8bit policy: not compared


def test_agreeing_settings_are_taken_from_the_policy() -> None:
    policy = ob.AdamW8bit.block_policy(block_size=64, min_8bit_size=256)
    opt = ob.AdamW8bit(_params(), block_policy=policy)
    assert (opt.block_size, opt.min_8bit_size) == (64, 256)
    same = ob.AdamW8bit(_params(), block_policy=policy, block_size=64, min_8bit_size=256)
    assert (same.block_size, same.min_8bit_size) == (64, 256)
    assert (ob.AdamW8bit(_params()).block_size, ob.AdamW8bit(_params()).min_8bit_size) == (
        256,
        4096,
    )


def test_other_policies_must_keep_every_8bit_block_whole() -> None:
    """A custom policy (e.g. an LCM of several optimizers' policies) is checked per tensor:
    every tensor kept in 8 bits needs a multiple of gcd(numel, block_size)."""
    adam = ob.AdamW8bit.block_policy(block_size=64, min_8bit_size=256)

    def rows(name: str, p: torch.Tensor) -> int:
        return int(p.shape[-1]) if p.dim() > 1 else 1

    def lcm(name: str, p: torch.Tensor) -> int:
        return math.lcm(adam(name, p), rows(name, p))

    opt = ob.AdamW8bit(_params(), block_size=64, min_8bit_size=256, block_policy=lcm)
    assert opt.block_size == 64
    named = [{"params": _params(), "param_names": ["w", "b"]}]
    with pytest.raises(ValueError, match=r"parameter 'w' \(4096 elements\).* blocks of 32") as info:
        ob.AdamW8bit(named, block_size=64, block_policy=lambda n, p: 32)
    assert "AdamW8bit(block_size=64, min_8bit_size=4096)" in str(info.value)
    assert "multiple of 64" in str(info.value)
    with pytest.raises(TypeError, match="block_policy must be a block policy"):
        ob.AdamW8bit(_params(), block_policy=64)  # type: ignore[arg-type]


def test_layout_checks_name_the_boundary() -> None:
    """The pure check: a layout cutting the blocks an agreeing policy keeps whole is refused
    when a policy was given (the parameters were sharded with another one), reported when not;
    tensors with fp32 state, and boundaries on gcd(numel, block) multiples, pass."""
    param = torch.empty(64, 64)
    cut = ParamLayout((64, 64), ((0, 1088), (1088, 4096)), 0, None, "RaggedShard(...)")
    aligned = ParamLayout((64, 64), ((0, 1024), (1024, 4096)), 0, None, "RaggedShard(...)")
    policy = ob.AdamW8bit.block_policy(block_size=256)
    with pytest.raises(ValueError, match=r"rank boundary at element 1088.*another block policy"):
        check_adamw8bit_blocks("w", param, cut, 256, 4096, policy)
    text = check_adamw8bit_blocks("w", param, cut, 256, 4096, None)
    assert text is not None and "rank boundary at element 1088" in text
    assert "AdamW8bit.block_policy(block_size=256, min_8bit_size=4096)" in text
    assert check_adamw8bit_blocks("w", param, aligned, 256, 4096, policy) is None
    assert check_adamw8bit_blocks("w", param, cut, 256, 8192, policy) is None  # fp32 state
    assert check_adamw8bit_blocks("w", param, cut, 64, 4096, None) is None  # 1088 = 17 * 64


_LOCK = threading.Lock()  # warnings' filters are process-wide: one rank records at a time


def _construct(rank: int, world: int, unit: int, with_policy: bool) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    spec = ragged_spec((64, 96), world, unit, seed=3)
    params = [torch.nn.Parameter(shard(torch.zeros(64, 96), mesh, spec))]
    named = [{"params": params, "param_names": ["layer.weight"]}]
    kwargs: dict[str, Any] = {"block_size": 256}
    if with_policy:
        kwargs["block_policy"] = ob.AdamW8bit.block_policy(block_size=256)
    try:
        with _LOCK, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ob.AdamW8bit(named, **kwargs)
    except ValueError as exc:
        return [f"ValueError: {exc}"]
    return [str(w.message) for w in caught]


def test_sharded_layouts_cutting_blocks_are_refused_or_reported_at_construction() -> None:
    """Shards that cut quantization blocks: refused when the optimizer was given the policy
    (the layout contradicts it), a warning naming the parameter and the policy to use when
    not; nothing when the shards are on blocks."""
    for out in run_threaded(_construct, 2, 1, True):
        assert len(out) == 1 and out[0].startswith("ValueError: parameter 'layer.weight'"), out
        assert "another block policy" in out[0], out
    for out in run_threaded(_construct, 2, 1, False):
        assert len(out) == 1 and "'layer.weight' is sharded with a rank boundary" in out[0], out
        assert "AdamW8bit.block_policy(block_size=256, min_8bit_size=4096)" in out[0], out
    for with_policy in (True, False):
        assert run_threaded(_construct, 2, 256, with_policy) == [[], []]


def _policy_from_fsdp2(rank: int, world: int) -> str:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(50, 96), mesh, [Shard(0)]))
    try:
        ob.AdamW8bit([p], block_policy=ob.AdamW8bit.block_policy())
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_policy_fsdp2_cannot_follow_is_refused() -> None:
    """FSDP2's Shard(0) takes no block policy: rows of 96 elements cut 256-element blocks, so
    claiming the parameters were sharded with AdamW8bit's policy is refused."""
    for message in run_threaded(_policy_from_fsdp2, 2):
        assert "rank boundary at element 2400" in message, message


@pytest.mark.parametrize("world", [2, 3])
def test_settings_from_the_policy_train_bit_identically(world: int) -> None:
    """Agreeing settings, from the policy: block-aligned ragged shards, bit-identical to one
    device and to the same settings given explicitly."""
    shapes = [(64, 96), (40, 64), (96,), (1, 4096)]
    specs = [
        ragged_spec(s, world, 64 if math.prod(s) % 64 == 0 else 1, i) for i, s in enumerate(shapes)
    ]
    policy = ob.AdamW8bit.block_policy(block_size=64, min_8bit_size=256)
    kwargs: dict[str, Any] = {"lr": 1e-2, "block_policy": policy}
    results = run_threaded(dist_run_steps, world, "adamw8bit", shapes, specs, 3, kwargs)
    explicit = {"lr": 1e-2, "block_size": 64, "min_8bit_size": 256}
    single = run_steps(None, "adamw8bit", shapes, [("plain",)] * len(shapes), 3, explicit)
    check_against_single(results, single, shapes, specs, 64)


def _disagreeing(mesh: Any) -> None:
    # 512 elements: 8-bit for the optimizer (min 256), unconstrained by the policy (min 4096)
    spec = ragged_spec((8, 64), mesh.size(), 64, seed=0)
    params = [torch.nn.Parameter(shard(torch.zeros(8, 64), mesh, spec))]
    ob.AdamW8bit(params, min_8bit_size=256, block_policy=ob.AdamW8bit.block_policy(64))


def test_refusal_is_raised_on_every_rank() -> None:
    """At construction, before any collective: every rank raises the same error."""
    messages = expect_error_on_every_rank(
        _disagreeing, ValueError, ["AdamW8bit(min_8bit_size=256) disagrees with its block_policy"]
    )
    assert len(set(messages)) == 1, messages


@pytest.mark.parametrize("world", [2, 3])
def test_a_smaller_compatible_block_trains_bit_identically_on_the_policys_layout(
    world: int,
) -> None:
    """Issue 33: ``block_size=32`` under a 64-element policy (shards on multiples of 64, so on
    multiples of 32 too): accepted, and bit-identical to one device with ``block_size=32``."""
    shapes = [(64, 96), (40, 64), (96,), (1, 4096)]
    specs = [
        ragged_spec(s, world, 64 if math.prod(s) % 64 == 0 else 1, i) for i, s in enumerate(shapes)
    ]
    policy = ob.AdamW8bit.block_policy(block_size=64, min_8bit_size=256)
    kwargs: dict[str, Any] = {"lr": 1e-2, "block_policy": policy, "block_size": 32}
    results = run_threaded(dist_run_steps, world, "adamw8bit", shapes, specs, 3, kwargs)
    explicit = {"lr": 1e-2, "block_size": 32, "min_8bit_size": 256}
    single = run_steps(None, "adamw8bit", shapes, [("plain",)] * len(shapes), 3, explicit)
    check_against_single(results, single, shapes, specs, 32)
