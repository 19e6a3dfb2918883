"""ragged-dtensor's DTensor integration refuses targets that are not torch's own functions or
another torch, and its removal refuses when a wrapper was replaced since; why the checkpoint
protocol stays on the class. (That importing the packages changes nothing in torch, and that the
integration's removal restores torch's very objects, is checked in fresh interpreters by the root
``tests/test_import_side_effects.py``, which has every package installed.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.distributed import _state_dict_utils as state_dict_utils
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.distributed.tensor import _api as dtensor_api
from torch.distributed.tensor import _dispatch as dtensor_dispatch
from torch.distributed.tensor import _redistribute as dtensor_redistribute
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from ragged_dtensor import (
    DTensorIntegrationError,
    RaggedShard,
    distribute_tensor,
    dtensor_integration,
    dtensor_integration_installed,
    hooks_installed,
    install_dtensor_integration,
    uninstall_dtensor_integration,
)
from ragged_dtensor.testing import run_threaded

# The script a fresh interpreter runs. It prints one JSON object.
# -- in this process: refusals (each restores what it changed) -------------------------------------


@pytest.fixture
def integration_removed() -> Iterator[None]:
    """The integration removed for the test, put back afterwards if it was installed."""
    was = dtensor_integration_installed()
    uninstall_dtensor_integration()
    try:
        yield
    finally:
        if was:
            install_dtensor_integration()


def _wrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def _targets() -> dict[str, tuple[Any, str, Any]]:
    """target name -> (owner, attribute, a replacement that is not torch's function)."""
    original = dtensor_redistribute.redistribute_local_tensor
    return {
        "torch.distributed.tensor._dispatch.redistribute_local_tensor": (
            dtensor_dispatch,
            "redistribute_local_tensor",
            _wrapped(original),  # functools.wraps keeps torch's name and module
        ),
        "torch.distributed.tensor._redistribute.redistribute_local_tensor": (
            dtensor_redistribute,
            "redistribute_local_tensor",
            _wrapped(original),
        ),
        "torch.distributed.tensor.DTensor.__create_write_items__": (
            DTensor,
            "__create_write_items__",
            _wrapped(DTensor.__create_write_items__),
        ),
        "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached": (
            DTensor._op_dispatcher.sharding_propagator,
            "propagate_op_sharding_non_cached",
            _wrapped(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached),
        ),
        "torch.distributed._state_dict_utils._distribute_tensors": (
            state_dict_utils,
            "_distribute_tensors",
            _wrapped(state_dict_utils._distribute_tensors),
        ),
        "DTensor._op_dispatcher._dispatch_get_local_results_slow_path": (
            DTensor._op_dispatcher,
            "_dispatch_get_local_results_slow_path",
            _wrapped(DTensor._op_dispatcher._dispatch_get_local_results_slow_path),
        ),
    }


def _state() -> dict[str, Any]:
    return {
        "redistribute": [
            m.redistribute_local_tensor
            for m in (dtensor_redistribute, dtensor_dispatch, dtensor_api)
        ],
        "checkpoint": [
            vars(DTensor)[n] for n in ("__create_write_items__", "__get_tensor_shard__")
        ],
        "propagator": dict(vars(DTensor._op_dispatcher.sharding_propagator)),
        "dispatcher": dict(vars(DTensor._op_dispatcher)),
        "state_dict": [state_dict_utils._distribute_tensors],
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
    return a is b


@pytest.mark.usefixtures("integration_removed")
@pytest.mark.parametrize("target", sorted(_targets()))
def test_install_refuses_a_target_that_is_not_torchs_function(
    target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, name, replacement = _targets()[target]
    monkeypatch.setattr(owner, name, replacement, raising=False)
    before = _state()
    with pytest.raises(DTensorIntegrationError, match=rf"{target.replace('.', '[.]')} is not"):
        install_dtensor_integration()
    with pytest.raises(DTensorIntegrationError, match="Refusing to install"):
        RaggedShard((0,), (1, 1))  # the lazy install refuses the same way
    assert _same(_state(), before)  # nothing was changed
    assert not dtensor_integration_installed()
    monkeypatch.undo()
    with dtensor_integration():  # torch's own functions again: it installs
        assert all(hooks_installed().values())


@pytest.mark.usefixtures("integration_removed")
def test_install_refuses_another_torch_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.14.0+cpu")
    with pytest.raises(
        DTensorIntegrationError, match=r"supports torch 2\.13\.x; found torch 2\.14"
    ):
        install_dtensor_integration()
    assert not any(hooks_installed().values())


@pytest.mark.usefixtures("integration_removed")
def test_removal_refuses_when_a_wrapper_was_replaced_since(monkeypatch: pytest.MonkeyPatch) -> None:
    install_dtensor_integration()
    ours = dtensor_dispatch.redistribute_local_tensor
    monkeypatch.setattr(dtensor_dispatch, "redistribute_local_tensor", _wrapped(ours))
    with pytest.raises(
        DTensorIntegrationError,
        match=r"torch[.]distributed[.]tensor[.]_dispatch[.]redistribute_local_tensor no longer",
    ):
        uninstall_dtensor_integration()
    assert dtensor_integration_installed()
    monkeypatch.undo()
    uninstall_dtensor_integration()
    assert (
        dtensor_dispatch.redistribute_local_tensor is dtensor_redistribute.redistribute_local_tensor
    )


# -- why the checkpoint protocol stays on the class; what torch's own functions do -----------------


class _LocalWithProtocol(torch.Tensor):
    """A local-tensor type that defines DCP's protocol, as torch's LocalShardsWrapper does."""

    def __create_chunk_list__(self) -> list[Any]:
        return []


def _op_results(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world,))
    local = torch.ones(2, 3).as_subclass(_LocalWithProtocol)
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    assert type(dt._local_tensor) is _LocalWithProtocol
    results = {
        "zeros_like": torch.zeros_like(dt),
        "detach": dt.detach(),
        "mul": dt * 2,
    }
    return {name: type(out._local_tensor).__name__ for name, out in results.items()}


def test_op_results_hold_plain_local_tensors_so_the_checkpoint_protocol_stays_on_the_class() -> (
    None
):
    """DTensor hands the checkpoint protocol to its local tensor only when the local tensor's type
    defines it; op dispatch wraps every op's result around a plain tensor (torch 2.13), so an
    optimizer's ``zeros_like(param)`` state would lose the protocol. If torch ever keeps the
    local type, move the protocol onto the local tensor and drop the class wrappers."""
    for result in run_threaded(_op_results, 2):
        assert result == dict.fromkeys(result, "Tensor"), result


def _distribute_with_torch(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8.0).view(4, 2)
    ours = distribute_tensor(full, mesh, [RaggedShard((0,), (1, 3))])
    theirs = torch_distribute_tensor(full, mesh, [RaggedShard((0,), (1, 3))])
    return {
        "same": torch.equal(ours.to_local(), theirs.to_local()),
        "placements": theirs.placements == ours.placements,
    }


def _refused_without(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,))
    placement = RaggedShard((0,), (1,))
    uninstall_dtensor_integration()  # torch's own code again: it refuses the placement
    try:
        torch_distribute_tensor(torch.zeros(4, 2), mesh, [placement])
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        install_dtensor_integration()


def test_torchs_distribute_tensor_cuts_a_raggedshard_while_installed() -> None:
    """[Note: distribute_tensor's code]: the function object users bound at import keeps its
    identity; while the integration is installed it cuts a RaggedShard share (what FSDP2 users
    do to load full weights into sharded parameters), and without it torch's own code refuses
    the placement."""
    assert torch_distribute_tensor is dtensor_api.distribute_tensor
    for result in run_threaded(_distribute_with_torch, 2, timeout=60):
        assert result["same"] and result["placements"], result
    # one rank: the refusal comes before any collective, and no other rank races the removal
    (message,) = run_threaded(_refused_without, 1, timeout=60)
    assert "unsupported placements RS((0,), (1,))" in message, message
