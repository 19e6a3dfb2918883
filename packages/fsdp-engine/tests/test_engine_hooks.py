"""User hooks and collectives: the all-reduce hook, custom all-gather and reduce-scatter, the
post-optimizer event, post-accumulate-grad hooks on sharded parameters, forward methods other
than ``forward``, and their errors, like FSDP2 (torch's FSDP2 as the control, threaded).

Numeric kind of every value comparison here: *same arithmetic* (same kernels on the same
unsharded values, one thread per rank, a two-rank mean is a two-term sum times 1/2): bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from engine_fsdp2 import (
    ENGINES,
    Mlp,
    Stack,
    data,
    engine,
    full_grads,
    full_params,
    make,
    shard_stack,
)
from torch import nn
from torch.distributed.tensor import init_device_mesh

from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics


def _all_reduce_hook(rank: int, world: int, impl: str, hooked: bool) -> Any:
    torch.set_num_threads(1)
    api = engine(impl)
    model = make(Mlp)
    api.fully_shard(model)
    calls: list[torch.dtype] = []
    if hooked:

        def hook(output: torch.Tensor) -> None:
            calls.append(output.dtype)
            output.mul_(2.0)  # the hook may change the reduced gradient in place

        model.set_all_reduce_hook(hook)  # type: ignore[operator]
    model(data(rank)).sum().backward()
    return calls, full_grads(model)


def test_set_all_reduce_hook_sees_the_reduced_gradient() -> None:
    """The hook runs once per group per backward on the reduced gradient (reduce dtype) before
    it becomes ``.grad``: doubling it doubles every gradient, like FSDP2."""
    for impl in ENGINES:
        calls, doubled = run_threaded(_all_reduce_hook, 2, impl, True)[0]
        _, plain = run_threaded(_all_reduce_hook, 2, impl, False)[0]
        assert calls == [torch.float32], (impl, calls)
        for name, grad in plain.items():
            assert torch.equal(doubled[name], grad * 2), (impl, name)  # type: ignore[operator]


def _hook_errors(rank: int, world: int, impl: str) -> list[str]:
    api = engine(impl)
    out = []
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make(Mlp)
    api.fully_shard(model, mesh=hsdp)
    try:
        model.set_all_reduce_hook(lambda t: None, stream=torch.cpu.Stream())  # type: ignore[operator]
    except ValueError as exc:
        out.append(str(exc))
    model = make(Mlp)
    api.fully_shard(model)
    model.set_allocate_memory_from_process_group_for_comm(True)  # type: ignore[operator]
    model.set_custom_all_gather(object())  # type: ignore[operator]
    try:
        model.set_allocate_memory_from_process_group_for_comm(True)  # type: ignore[operator]
    except AssertionError:
        out.append("AssertionError")
    for bad in ([nn.Linear(2, 2)],):
        try:
            api.share_comm_ctx(bad)
        except ValueError:
            out.append("share_comm_ctx ValueError")
    api.share_comm_ctx([model])
    return out


def test_hook_and_allocation_errors_match_fsdp2() -> None:
    """A stream for the all-reduce hook with native HSDP is refused; PG-allocated buffers do not
    combine with a custom collective; share_comm_ctx takes fully_shard modules only."""
    want = [
        "stream cannot be set when using native HSDP",
        "AssertionError",
        "share_comm_ctx ValueError",
    ]
    for impl in ENGINES:
        assert run_threaded(_hook_errors, 4, impl)[0] == want, impl


def _custom_comms(rank: int, world: int) -> Any:
    torch.set_num_threads(1)

    model = make(Mlp)
    engine("ours").fully_shard(model)
    calls: list[str] = []

    class Gather:
        def __call__(
            self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool
        ) -> Any:
            calls.append("all_gather")
            return dist.all_gather_single(output_tensor, input_tensor, group=group)

    class ReduceScatter:
        def __call__(
            self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool
        ) -> Any:
            calls.append("reduce_scatter")
            return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)

    model.set_custom_all_gather(Gather())  # type: ignore[operator]
    model.set_custom_reduce_scatter(ReduceScatter())  # type: ignore[operator]
    model(data(rank)).sum().backward()
    custom = full_grads(model)
    plain = make(Mlp)
    engine("ours").fully_shard(plain)
    plain(data(rank)).sum().backward()
    return calls, custom, full_grads(plain)


def test_custom_all_gather_and_reduce_scatter_are_used() -> None:
    """``set_custom_all_gather`` / ``set_custom_reduce_scatter`` collectives run on the group's
    own flat buffers and give the same gradients as the built-in ones."""
    for calls, custom, plain in run_threaded(_custom_comms, 2):
        assert calls == ["all_gather", "reduce_scatter"], calls
        for name, grad in plain.items():
            assert torch.equal(custom[name], grad), name  # type: ignore[arg-type]


def _post_optim_event(rank: int, world: int, impl: str, with_event: bool) -> Any:
    torch.set_num_threads(1)
    api = engine(impl)
    model = make(Stack)
    shard_stack(api, model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        loss = model(data(rank, step)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if with_event:
            model.set_post_optim_event(torch.cpu.current_stream().record_event())  # type: ignore[operator]
        losses.append(loss.detach())
    return losses


def test_set_post_optim_event_is_waited_and_training_is_unchanged() -> None:
    for impl in ENGINES:
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                run_threaded(_post_optim_event, 2, impl, True)[0],
                run_threaded(_post_optim_event, 2, impl, False)[0],
                strict=True,
            )
        ), impl


def _hooks(rank: int, world: int, in_backward: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    api = engine("ours")
    model = make(Stack)
    shard_stack(api, model)
    counts: dict[str, int] = {}
    if in_backward:
        optims = {p: torch.optim.AdamW([p], lr=1e-2, foreach=False) for p in model.parameters()}

        def step(param: torch.Tensor) -> None:
            optims[param].step()  # type: ignore[index]
            optims[param].zero_grad()  # type: ignore[index]

        for name, param in model.named_parameters():

            def count(p: torch.Tensor, name: str = name) -> None:
                assert p.grad is not None  # the reduced gradient is there
                counts[name] = counts.get(name, 0) + 1

            param.register_post_accumulate_grad_hook(count)
            param.register_post_accumulate_grad_hook(step)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for it in range(3):
        model(data(rank, it)).sum().backward()
        if not in_backward:
            optim.step()
            optim.zero_grad()
    return {"counts": counts, "params": full_params(model)}


def test_post_accumulate_grad_hooks_on_sharded_parameters_run() -> None:
    """Hooks registered on the sharded parameters run once per backward with the reduced
    gradient, so an optimizer step inside the hook (optimizer in backward) gives the same
    parameters as the usual step after backward, bitwise."""
    hooked = run_threaded(_hooks, 2, True)
    plain = run_threaded(_hooks, 2, False)
    for a, b in zip(hooked, plain, strict=True):
        assert set(a["counts"].values()) == {3} and len(a["counts"]) == 12, a["counts"]
        for name, value in b["params"].items():
            assert torch.equal(a["params"][name], value), name


class _Vision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, kernel_size=4, stride=4)

    def features(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.patch(imgs).flatten(2).transpose(1, 2)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.features(imgs).sum(dim=1)


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = _Vision()
        self.proj = nn.Linear(8, 4)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.proj(self.vision.features(imgs))  # not ``forward``


def _forward_method(rank: int, world: int, impl: str) -> Any:
    torch.set_num_threads(1)
    api = engine(impl)
    model = make(_Tower)
    api.fully_shard(model.vision)
    api.fully_shard(model.proj)
    api.fully_shard(model)
    api.register_fsdp_forward_method(model.vision, "features")
    api.register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not fully_shard: a no-op
    imgs = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(rank))
    loss = model(imgs).sum()
    loss.backward()
    return loss.detach(), full_grads(model)


def test_register_fsdp_forward_method_unshards_around_another_method() -> None:
    """A method other than ``forward`` registered with ``register_fsdp_forward_method``
    all-gathers before and reshards after, so calling it works and trains like FSDP2."""
    ours = run_threaded(_forward_method, 2, "ours")
    theirs = run_threaded(_forward_method, 2, "fsdp2")
    for (l1, g1), (l2, g2) in zip(ours, theirs, strict=True):
        assert torch.equal(l1, l2)
        for name, grad in g2.items():
            assert torch.equal(g1[name], grad), name  # type: ignore[arg-type]
