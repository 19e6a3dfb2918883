"""FSDP2's FSDPModule methods and module-level functions, and its error contract, on fsdp_engine
with torch's FSDP2 as the control (threaded process group, fast).

Numeric kind of every value comparison here: *same arithmetic* (same kernels on the same
unsharded values, one thread per rank, a two-rank mean is a two-term sum times 1/2): bitwise.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from engine_fsdp2 import (
    ALL_GATHER,
    Mlp,
    Stack,
    counting,
    data,
    engine,
    full_grads,
    full_params,
    make,
    shard_stack,
)
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics

ENGINES = ["ours", "fsdp2"]


class _Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = Mlp()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(tokens))


def _unshard_in_backward(rank: int, world: int, impl: str, unshard: bool) -> Any:
    torch.set_num_threads(1)
    api = engine(impl)
    model = make(_Embedded)
    api.fully_shard(model.embed)
    api.fully_shard(model.body)
    api.fully_shard(model)
    if not unshard:
        model.embed.set_unshard_in_backward(False)  # type: ignore[operator]
    tokens = torch.randint(0, 16, (4,), generator=torch.Generator().manual_seed(rank))
    loss = model(tokens).sum()
    with counting() as counts:
        loss.backward()
    return counts.get(ALL_GATHER, 0), full_grads(model)


def test_set_unshard_in_backward_skips_the_gather_and_keeps_gradients() -> None:
    """An embedding's backward does not read its weight: ``set_unshard_in_backward(False)``
    saves its all-gather in backward and the gradients stay the same, like FSDP2."""
    for impl in ENGINES:
        (gathers_on, grads_on), *_ = run_threaded(_unshard_in_backward, 2, impl, True)
        (gathers_off, grads_off), *_ = run_threaded(_unshard_in_backward, 2, impl, False)
        assert gathers_off == gathers_on - 1, (impl, gathers_on, gathers_off)
        for name, grad in grads_on.items():
            assert torch.equal(grad, grads_off[name]), (impl, name)  # type: ignore[arg-type]


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


def _custom_comms(rank: int, world: int) -> Any:
    torch.set_num_threads(1)
    import torch.distributed as dist

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


def _reset(rank: int, world: int) -> Any:
    torch.set_num_threads(1)
    model = make(Stack)
    shard_stack(engine("ours"), model)
    failing = {"on": True}

    def explode(module: nn.Module, args: Any) -> None:
        if failing["on"]:
            raise RuntimeError("boom")

    handle = model.blocks[1].register_forward_pre_hook(explode)
    with contextlib.suppress(RuntimeError):
        model(data(rank)).sum().backward()
    failing["on"] = False
    handle.remove()
    model.reset_iter_state()  # type: ignore[operator]
    model(data(rank)).sum().backward()
    fresh = make(Stack)
    shard_stack(engine("ours"), fresh)
    fresh(data(rank)).sum().backward()
    got, want = full_grads(model), full_grads(fresh)
    return all(torch.equal(got[n], want[n]) for n in want)  # type: ignore[arg-type]


def test_reset_iter_state_recovers_after_an_exception_in_forward() -> None:
    assert all(run_threaded(_reset, 2))


def _unused(rank: int, world: int, keep: bool | None) -> Any:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(8, 8)
            self.unused = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = make(Two)
    engine("ours").fully_shard(model)
    if keep is not None:
        model.set_reduce_scatter_unused_params(keep)  # type: ignore[operator]
    with counting() as counts:
        model(data(rank)).sum().backward()
    zeros = all(
        bool((p.grad.to_local() == 0).all())
        for n, p in model.named_parameters()
        if n.startswith("unused") and p.grad is not None
    )
    return {n: p.grad is not None for n, p in model.named_parameters()}, dict(counts), zeros


def test_parameters_no_rank_used_keep_a_zero_gradient_unless_asked() -> None:
    """The reduction always covers every trainable parameter (a rank that did not use one sends
    zeros, so fsdp_engine never hangs on conditional compute). By default every trainable
    parameter then keeps a ``.grad`` (zeros if no rank used it: the same presence on every
    rank by construction, FSDP2's ``set_reduce_scatter_unused_params(True)``);
    ``set_reduce_scatter_unused_params(False)`` gives one process's presence (None for
    parameters no rank used) for one small all-reduce per backward."""
    for keep in (None, True):
        presence, counts, zeros = run_threaded(_unused, 2, keep)[0]
        assert all(presence.values()) and zeros, presence
        assert "all_reduce" not in counts, counts
    presence, counts, _ = run_threaded(_unused, 2, False)[0]
    assert presence == {
        "used.weight": True,
        "used.bias": True,
        "unused.weight": False,
        "unused.bias": False,
    }
    assert counts.get("all_reduce") == 1, counts


def _replicated(rank: int, world: int, impl: str) -> Any:
    """``replicate()`` (composable DDP) over a model whose submodules are fully_shard modules:
    it leaves their parameters to fully_shard."""
    from torch.distributed._composable import replicate
    from torch.distributed.tensor.experimental import implicit_replication

    torch.set_num_threads(1)
    api = engine(impl)
    model = make(Stack)
    for block in model.blocks:
        api.fully_shard(block)
    replicate(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        loss = model(data(rank, step)).sum()
        loss.backward()
        with implicit_replication():
            optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses, full_params(model)


def test_replicate_over_fully_shard_submodules_trains_like_fsdp2() -> None:
    ours = run_threaded(_replicated, 2, "ours")
    theirs = run_threaded(_replicated, 2, "fsdp2")
    for (l1, p1), (l2, p2) in zip(ours, theirs, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(l1, l2, strict=True))
        for name, value in p2.items():
            assert torch.equal(p1[name], value), name


def _errors(rank: int, world: int, impl: str) -> dict[str, str]:
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
        lambda: _sharded(api).set_reshard_after_forward(2),  # type: ignore[arg-type]
    )
    capture(
        "prefetch of a plain module",
        lambda: _sharded(api).set_modules_to_forward_prefetch([nn.Linear(2, 2)]),
    )
    return out


def _sharded(api: Any) -> Any:
    m = Mlp()
    api.fully_shard(m)
    return m


def test_error_contract_matches_fsdp2() -> None:
    """The same inputs raise the same exception types as FSDP2 (4 ranks)."""
    ours = run_threaded(_errors, 4, "ours")[0]
    theirs = run_threaded(_errors, 4, "fsdp2")[0]
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


def test_unshard_handle_and_dtensor_parameters_after_wait() -> None:
    def body(rank: int, world: int) -> bool:
        model = make(Stack)
        shard_stack(engine("ours"), model)
        handle = model.blocks[0].unshard(async_op=True)  # type: ignore[operator]
        assert handle is not None
        handle.wait()
        unsharded = not isinstance(model.blocks[0].up.weight, DTensor)
        model.blocks[0].reshard()  # type: ignore[operator]
        return unsharded and isinstance(model.blocks[0].up.weight, DTensor)

    assert all(run_threaded(body, 2))
