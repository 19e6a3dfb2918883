"""Bad-input catalogue (``fully_shard`` arguments and checkpoint mismatches): the stated error
type, a message naming the offending argument, parameter, key or path."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_fsdp2 import Mlp, engine
from engine_models import TinyLlama
from engine_models import build as build_tiny_llama
from engine_reliability_common import build, train
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from fsdp_engine import (
    CheckpointError,
    CheckpointIntegrityError,
    IncompleteCheckpointError,
    MixedPrecisionPolicy,
    checkpoint_info,
    fully_shard,
    load_checkpoint,
    save_checkpoint,
)
from ragged_dtensor.testing import expect_error_on_every_rank, run_threaded

# -- fully_shard arguments ------------------------------------------------------------------------


def _linear() -> nn.Module:
    return nn.Linear(4, 4)


def _listed_twice(mesh: Any) -> object:
    layer = _linear()
    return fully_shard([layer, layer], mesh=mesh)


def _twice(mesh: Any) -> object:
    layer = _linear()
    fully_shard(layer, mesh=mesh)
    return fully_shard(layer, mesh=mesh)


def _with_scalar() -> nn.Module:
    layer = _linear()
    layer.register_parameter("scale", nn.Parameter(torch.tensor(1.0)))
    return layer


def _sharded(mesh: Any) -> Any:
    model = nn.Sequential(_linear(), _linear())
    fully_shard(model, mesh=mesh)
    return model


def _step(mesh: Any, **kwargs: Any) -> object:
    layer = _linear()
    fully_shard(layer, mesh=mesh, **kwargs)
    layer(torch.randn(2, 4)).sum().backward()
    return layer


def _already_sharded_by_parent(mesh: Any) -> object:
    model = nn.Sequential(_linear(), _linear())
    fully_shard(model, mesh=mesh)
    return fully_shard(model[0], mesh=mesh)  # bottom-up order violated


def _tensor_parallel_param(mesh: Any) -> object:
    layer = _linear()
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
    return fully_shard(layer, mesh=mesh)


Case = tuple[Callable[[Any], object], type[Exception], tuple[str, ...]]
ARGUMENT_CASES: dict[str, Case] = {
    "reshard_after_forward int not dividing the axis size": (
        lambda mesh: fully_shard(_linear(), mesh=mesh, reshard_after_forward=3),
        ValueError,
        ("reshard_after_forward=3", "divisor of the shard-axis size 2"),
    ),
    "reshard_after_forward of another type (FSDP2's ValueError)": (
        lambda mesh: fully_shard(_linear(), mesh=mesh, reshard_after_forward="yes"),  # type: ignore[call-overload]
        ValueError,
        ("reshard_after_forward", "str"),
    ),
    "shard_placement_fn with an uneven Shard(1) (FSDP2's NotImplementedError)": (
        lambda mesh: fully_shard(
            nn.Linear(3, 4), mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1)
        ),
        NotImplementedError,
        ("uneven sharding on dim 1", "(4, 3)", "'weight'"),
    ),
    "shard_placement_fn with a dim the parameter lacks (FSDP2's AssertionError)": (
        lambda mesh: fully_shard(_linear(), mesh=mesh, shard_placement_fn=lambda p: Shard(1)),
        AssertionError,
        ("Shard dim 1 is invalid for 1D tensor", "(4,)"),
    ),
    "a scalar parameter (FSDP2's ValueError)": (
        lambda mesh: fully_shard(_with_scalar(), mesh=mesh),
        ValueError,
        ("scalar parameters", "Change scale to a 1D tensor"),
    ),
    "a non-contiguous parameter (FSDP2's NotImplementedError)": (
        lambda mesh: fully_shard(
            nn.Conv2d(2, 2, 3).to(memory_format=torch.channels_last), mesh=mesh
        ),
        NotImplementedError,
        ("non-contiguous parameters", "'weight'"),
    ),
    "the same module twice in a list (FSDP2's AssertionError)": (
        _listed_twice,
        AssertionError,
        ("same module twice",),
    ),
    "empty list": (lambda mesh: fully_shard([], mesh=mesh), ValueError, ("empty list",)),
    "not a module": (
        lambda mesh: fully_shard(42, mesh=mesh),  # type: ignore[call-overload]
        TypeError,
        ("nn.Module", "int"),
    ),
    "applied twice (FSDP2's AssertionError)": (
        _twice,
        AssertionError,
        ("has already been applied (by fsdp_engine.fully_shard)", "Linear"),
    ),
    "block policy of 0": (
        lambda mesh: fully_shard(_linear(), mesh=mesh, block_policy=lambda n, p: 0),
        ValueError,
        ("'weight'", "(4, 4)", "block of 0"),
    ),
    "block policy not dividing numel": (
        lambda mesh: fully_shard(_linear(), mesh=mesh, block_policy=lambda n, p: 3),
        ValueError,
        ("'weight'", "16 elements", "block of 3"),
    ),
    "3-D mesh": (
        lambda mesh: fully_shard(_linear(), mesh=init_device_mesh("cpu", (2, 1, 1))),
        ValueError,
        ("fully_shard expects a 1D or 2D DeviceMesh",),
    ),
    "2-D mesh without dim names (FSDP2's AssertionError)": (
        lambda mesh: fully_shard(_linear(), mesh=init_device_mesh("cpu", (1, 2))),
        AssertionError,
        ("mesh_dim_names",),
    ),
    "divide factor 0": (
        lambda mesh: _sharded(mesh).set_reduce_scatter_divide_factor(0),
        ValueError,
        ("divide factor", "got 0"),
    ),
    "prefetching a module that is not sharded": (
        lambda mesh: _sharded(mesh).set_modules_to_backward_prefetch([_linear()]),
        ValueError,
        ("set_modules_to_backward_prefetch", "Linear", "Expects FSDPModule"),
    ),
    "parent sharded before the child": (
        _already_sharded_by_parent,
        ValueError,
        ("'weight'", "already RaggedShard-sharded"),
    ),
    "tensor-parallel parameter on the data-parallel mesh itself": (
        _tensor_parallel_param,
        ValueError,
        ("'weight'", "data-parallel mesh"),
    ),
}


@pytest.mark.parametrize("name", list(ARGUMENT_CASES))
def test_bad_fully_shard_argument_names_the_offender(name: str) -> None:
    expect_error_on_every_rank(*ARGUMENT_CASES[name])


# Each was accepted silently or failed far from the cause with an unrelated message (found by
# this catalogue): fixed in 5b81a10 (first four) and 0361240 (integer mp_policy dtypes); the
# raising block policy FAILS today.
UNCLEAR: dict[str, tuple[Callable[[Any], object], type[Exception], tuple[str, ...], str]] = {
    "block policy returning a float": (
        lambda mesh: fully_shard(_linear(), mesh=mesh, block_policy=lambda n, p: 2.5),  # type: ignore[arg-type,return-value]
        TypeError,
        ("'weight'", "2.5"),
        "group.py build_plan does int(policy(...)): 2.5 silently becomes a block of 2 (and "
        "'4' becomes 4); use operator.index and raise TypeError naming the parameter",
    ),
    "mesh that is not a DeviceMesh": (
        lambda mesh: fully_shard(_linear(), mesh="cpu"),  # type: ignore[call-overload]
        TypeError,
        ("mesh", "DeviceMesh", "str"),
        "api.py fully_shard: AttributeError \"'str' object has no attribute 'ndim'\"; check "
        "isinstance(mesh, DeviceMesh) and raise TypeError naming mesh",
    ),
    "mp_policy of another type": (
        lambda mesh: fully_shard(_linear(), mesh=mesh, mp_policy="bf16"),  # type: ignore[call-overload]
        TypeError,
        ("mp_policy", "str"),
        "api.py: AttributeError \"'str' object has no attribute 'param_dtype'\"; check for the "
        "fields (param_dtype, reduce_dtype, output_dtype, cast_forward_inputs) so torch's "
        "FSDP2 MixedPrecisionPolicy keeps working, else TypeError naming mp_policy",
    ),
    "offload_policy of another type": (
        lambda mesh: fully_shard(_linear(), mesh=mesh, offload_policy="cpu"),  # type: ignore[call-overload]
        TypeError,
        ("offload_policy", "str"),
        "api.py: accepted silently (no offloading happens); require an OffloadPolicy "
        "(ours or torch's) and raise TypeError naming offload_policy",
    ),
    "mp_policy with an integer reduce dtype": (
        lambda mesh: _step(mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.int8)),
        ValueError,
        ("reduce_dtype", "torch.int8", "floating"),
        "policy.py/api.py: accepted silently, and gradients are reduced in int8 (truncated to "
        "integers: silently wrong training); require floating dtypes for param_dtype, "
        "reduce_dtype and output_dtype and raise naming the field",
    ),
    "mp_policy with an integer param dtype": (
        lambda mesh: _step(mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int32)),
        ValueError,
        ("param_dtype", "torch.int32"),
        "fails in forward with torch's 'Only Tensors of floating point and complex dtype can "
        "require gradients', which names neither mp_policy nor param_dtype",
    ),
    "block policy that raises": (
        lambda mesh: fully_shard(_linear(), mesh=mesh, block_policy=lambda n, p: 1 // 0),
        ZeroDivisionError,
        ("'weight'",),
        "group.py build_plan: the policy's exception propagates without saying which "
        "parameter it was called for; add a note (exc.add_note) naming the parameter, its "
        "shape and the policy",
    ),
}


@pytest.mark.parametrize("name", list(UNCLEAR))
def test_bad_fully_shard_argument_is_rejected_clearly(name: str) -> None:
    fn, kind, fragments, bug = UNCLEAR[name]
    expect_error_on_every_rank(fn, kind, fragments, hint=f"bug: {bug}")


# -- checkpoint mismatches ------------------------------------------------------------------------


def _save_reference(rank: int, world: int, root: str) -> None:
    model, opt = build(world)
    model_sd, optim_sd = get_state_dict(model, opt)
    save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / "ok")
    save_checkpoint({"model": model_sd}, Path(root) / "model_only")
    train(model, opt, rank, world, start=0, steps=1)  # another save of the same model
    model_sd, optim_sd = get_state_dict(model, opt)
    save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / "ok2")


def _largest_range(directory: Path, name: str) -> tuple[int, int]:
    items = checkpoint_info(directory)["files"][name]["items"]
    offset, length, _ = max(items, key=lambda item: item[1])
    return offset, length


def _flip_a_byte(directory: Path) -> None:
    """One bit of the largest tensor chunk of rank 1's shard file (inside the tensor data)."""
    offset, length = _largest_range(directory, "__1_0.distcp")
    with (directory / "__1_0.distcp").open("r+b") as fh:
        fh.seek(offset + length // 2)
        byte = fh.read(1)
        fh.seek(offset + length // 2)
        fh.write(bytes([byte[0] ^ 0x10]))


def _damage(root: Path) -> None:
    """Copies of the reference checkpoint, each damaged one way (see CKPT_CASES)."""
    for name in ("flipped", "foreign_shard", "foreign_metadata", "truncated", "bad_marker"):
        shutil.copytree(root / "ok", root / name)
    _flip_a_byte(root / "flipped")
    shutil.copy(root / "ok2" / "__1_0.distcp", root / "foreign_shard" / "__1_0.distcp")
    shutil.copy(root / "ok2" / ".metadata", root / "foreign_metadata" / ".metadata")
    shard = root / "truncated" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (root / "bad_marker" / "COMMITTED").write_text('{"format": 2, "save_id": ')


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    run_threaded(_save_reference, 2, str(root), timeout=120)
    (root / "torn").mkdir()
    _damage(root)
    return root


def _load_other_model(root: Path, world: int, **sizes: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model = TinyLlama(**sizes)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    model_sd, optim_sd = get_state_dict(model, opt)
    load_checkpoint({"model": model_sd, "optim": optim_sd}, root / "ok")


def _load_with_optimizer(root: Path, world: int) -> None:
    model, opt = build(world)
    model_sd, optim_sd = get_state_dict(model, opt)
    load_checkpoint({"model": model_sd, "optim": optim_sd}, root / "model_only")


def _save_per_rank_plain(root: Path, world: int) -> None:
    rank = torch.distributed.get_rank()
    save_checkpoint({"counter": torch.full((3,), float(rank))}, root / "plain")


def _save_over(root: Path, world: int) -> None:
    save_checkpoint({"x": torch.zeros(2)}, root / "ok")


def _load_into(root: Path, world: int, name: str, **kwargs: Any) -> None:
    model, opt = build(world)
    model_sd, optim_sd = get_state_dict(model, opt)
    load_checkpoint({"model": model_sd, "optim": optim_sd}, root / name, **kwargs)


def _load_in_bf16(root: Path, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model = TinyLlama().to(torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    load_checkpoint({"model": model.state_dict()}, root / "ok", strict=False)


CKPT_CASES: dict[str, tuple[Callable[[Path, int], object], type[Exception], tuple[str, ...]]] = {
    "another hidden size": (
        lambda root, world: _load_other_model(root, world, dim=48),
        CheckpointError,
        ("'model.embed.weight': shape (97, 48) in the state dict, (97, 32) in the checkpoint",),
    ),
    "one more layer": (
        lambda root, world: _load_other_model(root, world, layers=3),
        CheckpointError,
        ("missing from the checkpoint (", "'model.layers.2.", "/ok'"),
    ),
    # regression (issue 14): loaded silently, the checkpoint's extra keys ignored
    "one layer fewer (keys the model lacks)": (
        lambda root, world: _load_other_model(root, world, layers=1),
        CheckpointError,
        ("in the checkpoint, not in the state dict (", "'model.layers.1.", "strict=False"),
    ),
    # regression (issue 14): DCP cast the values silently
    "another dtype": (
        _load_in_bf16,
        CheckpointError,
        ("'model.embed.weight': dtype torch.bfloat16 in the state dict, torch.float32",),
    ),
    "optimizer state missing from the checkpoint": (
        _load_with_optimizer,
        CheckpointError,
        ("missing from the checkpoint (", "'optim.param_groups.0."),
    ),
    "a torn (uncommitted) directory": (
        lambda root, world: load_checkpoint({}, root / "torn"),
        IncompleteCheckpointError,
        ("/torn'", "no COMMITTED marker"),
    ),
    "a path that does not exist": (
        lambda root, world: load_checkpoint({}, root / "nowhere"),
        IncompleteCheckpointError,
        ("/nowhere'", "does not exist"),
    ),
    "saving over a committed checkpoint": (
        _save_over,
        FileExistsError,
        ("/ok'", "already exists"),
    ),
    "saving an unmaterialized (meta) model": (
        lambda root, world: save_checkpoint(
            {"model": {"head.weight": torch.empty(4, 4, device="meta")}}, root / "meta"
        ),
        CheckpointError,
        ("'model.head.weight'", "meta device", "to_empty"),
    ),
    "a state dict that is not a dict": (
        lambda root, world: save_checkpoint([torch.zeros(2)], root / "list"),  # type: ignore[arg-type]
        TypeError,
        ("state_dict must be a dict", "list"),
    ),
    "per-rank data in a plain tensor": (
        _save_per_rank_plain,
        CheckpointError,
        ("'counter'", "differ between ranks", "ranks [0]", "ranks [1]"),
    ),
    # regressions (issue 14): each of these loaded without an error (silently wrong data)
    "a flipped byte inside a shard's tensor data": (
        lambda root, world: _load_into(root, world, "flipped"),
        CheckpointIntegrityError,
        ("ranks [1]: CheckpointIntegrityError", "'__1_0.distcp'", "damaged or comes from"),
    ),
    "a shard file copied in from another save of the same model": (
        lambda root, world: _load_into(root, world, "foreign_shard"),
        CheckpointIntegrityError,
        ("ranks [1]: CheckpointIntegrityError", "'__1_0.distcp'", "another save"),
    ),
    "the .metadata of another save": (
        lambda root, world: _load_into(root, world, "foreign_metadata"),
        CheckpointIntegrityError,
        ("foreign_metadata/.metadata' does not match the digest", "another save"),
    ),
    "a truncated shard file": (
        lambda root, world: _load_into(root, world, "truncated"),
        CheckpointIntegrityError,
        ("ranks [0]: CheckpointIntegrityError", "'__0_0.distcp'", "truncated"),
    ),
    # regression (issue 14): a raw JSONDecodeError without the path
    "a COMMITTED marker that is not valid JSON": (
        lambda root, world: _load_into(root, world, "bad_marker"),
        CheckpointIntegrityError,
        ("bad_marker/COMMITTED' is not a valid COMMITTED marker", "JSONDecodeError"),
    ),
}


def _run_ckpt_case(rank: int, world: int, root: str, name: str) -> str:
    fn, kind, _ = CKPT_CASES[name]
    try:
        fn(Path(root), world)
    except kind as exc:
        return f"ok: {exc}"
    except Exception as exc:
        return f"wrong type {type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("name", list(CKPT_CASES))
def test_checkpoint_mismatch_names_the_offender(saved: Path, name: str) -> None:
    _, _, fragments = CKPT_CASES[name]
    for rank, message in enumerate(run_threaded(_run_ckpt_case, 2, str(saved), name, timeout=60)):
        assert message.startswith("ok: "), (rank, message)
        for fragment in fragments:
            assert fragment in message, (rank, message)


# -- bad arguments against FSDP2 (threaded): its exception types, our messages ----------------


def _argument_errors(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, str] = {}

    def capture(name: str, fn: Any) -> None:
        try:
            fn()
        except (ValueError, TypeError, NotImplementedError, AssertionError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"

    model = build_tiny_llama()
    fully_shard(model.layers[0], mesh=mesh)
    capture("twice", lambda: fully_shard(model.layers[0], mesh=mesh))
    capture(
        "block", lambda: fully_shard(model.layers[1], mesh=mesh, block_policy=lambda name, p: 7)
    )
    capture("not a module", lambda: fully_shard(42, mesh=mesh))  # type: ignore[call-overload]
    capture(
        "3-D mesh",
        lambda: fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (world, 1, 1))),
    )
    return out


def test_bad_input_raises_clearly() -> None:
    out = run_threaded(_argument_errors, 2, timeout=60)[0]
    assert out["twice"].startswith("AssertionError"), out  # FSDP2's type
    assert "already been applied" in out["twice"], out
    assert "block policy gave parameter 'attn_norm.weight'" in out["block"], out
    assert "block of 7 elements" in out["block"], out
    assert out["not a module"].startswith("TypeError"), out
    assert out["3-D mesh"].startswith("ValueError: fully_shard expects a 1D or 2D DeviceMesh"), out


def _exception_types(rank: int, world: int, impl: str) -> dict[str, str]:
    api = engine(impl)
    out: dict[str, str] = {}

    def capture(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            out[name] = type(exc).__name__
        else:
            out[name] = "no error"

    capture("3-D mesh", lambda: api.fully_shard(Mlp(), mesh=init_device_mesh("cpu", (world, 1, 1))))
    capture(
        "2-D mesh without names",
        lambda: api.fully_shard(Mlp(), mesh=init_device_mesh("cpu", (2, 2))),
    )

    def scalar() -> None:
        m = Mlp()
        m.register_parameter("scale", nn.Parameter(torch.tensor(1.0)))
        api.fully_shard(m)

    capture("scalar parameter", scalar)
    capture(
        "non-contiguous parameter",
        lambda: api.fully_shard(nn.Conv2d(4, 4, 3).to(memory_format=torch.channels_last)),
    )

    def meta_forward() -> None:
        with torch.device("meta"):
            m = Mlp()
        api.fully_shard(m)
        m(torch.randn(2, 8))

    capture("forward on meta parameters", meta_forward)
    capture(
        "uneven Shard(1)",
        lambda: api.fully_shard(nn.Linear(3, 8), shard_placement_fn=lambda p: Shard(p.dim() - 1)),
    )
    capture(
        "Shard(1) of a 1-D parameter",
        lambda: api.fully_shard(nn.Linear(8, 8), shard_placement_fn=lambda p: Shard(1)),
    )
    capture(
        "set_reshard_after_forward(int)",
        lambda: _sharded_mlp(api).set_reshard_after_forward(2),  # type: ignore[arg-type]
    )
    capture(
        "prefetch of a plain module",
        lambda: _sharded_mlp(api).set_modules_to_forward_prefetch([nn.Linear(2, 2)]),
    )
    return out


def _sharded_mlp(api: Any) -> Any:
    m = Mlp()
    api.fully_shard(m)
    return m


@pytest.mark.numerics
def test_error_contract_matches_fsdp2() -> None:
    """The same inputs raise the same exception types as FSDP2 (4 ranks)."""
    ours = run_threaded(_exception_types, 4, "ours")[0]
    theirs = run_threaded(_exception_types, 4, "fsdp2")[0]
    assert ours == theirs, (ours, theirs)
    assert theirs == {
        "3-D mesh": "ValueError",
        "2-D mesh without names": "AssertionError",
        "scalar parameter": "ValueError",
        "non-contiguous parameter": "NotImplementedError",
        "forward on meta parameters": "RuntimeError",
        "uneven Shard(1)": "NotImplementedError",
        "Shard(1) of a 1-D parameter": "AssertionError",
        "set_reshard_after_forward(int)": "ValueError",
        "prefetch of a plain module": "ValueError",
    }, theirs
