"""fsdp_engine's use of dbuffer's streams, checked on CPU with dbuffer's simulated streams
(``dbuffer.testing.simulated_streams``; the model is described in its module).

Two ranks (threaded process group, one simulation each) train a 4-layer model for three steps
with everything that issues all-gathers early: the implicit forward prefetch (issued before the
current layer's compute, waiting only on the iteration's inputs-ready event), backward prefetch,
``reshard_after_forward=2`` regathers from the kept parts, bf16 mixed precision (the cast on the
all-gather stream) with an fp32 reduce dtype, and a foreach SGD step on the compute stream between
iterations. The model must see no race, the work must run on all three streams, and removing
the all-gather stream's wait on the free events must be reported.

The same training with the quantized all-gather (``QuantizedAllGather``: FP8 codes and fp32
scales of 4x8 tiles, one packed all-gather per group) adds the all-gather stream's own
temporaries (the quantize's abs / amax / division, the packed send and receive buffers, the
dequantize) and a ``hook`` that reads the gathered codes on the compute stream: no race either,
and removing the wait that orders the hook's reads of the receive buffer before the all-gather
stream reuses it (the hand-back after the hook in dbuffer's packed.py) must be reported.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_engine
from dbuffer._private import collectives as collectives_module
from dbuffer._private import streams as streams_module
from dbuffer.testing import (
    current_simulation,
    install_simulated_streams,
    simulated_event_now,
    simulated_streams,
)
from fsdp_engine._private import gather as gather_module
from ragged_dtensor.testing import run_threaded

_BUILD = threading.Lock()  # ranks are threads sharing torch's generator


class _UserCollectives:
    """A user all-gather and reduce-scatter (FSDP2's custom-collective interface), wrapping
    the backend's: they must run on the communication streams like the built-in ones."""

    def all_gather(self, **kwargs: Any) -> Any:
        return dist.all_gather_single(
            kwargs["output_tensor"],
            kwargs["input_tensor"],
            group=kwargs["group"],
            async_op=kwargs["async_op"],
        )

    def reduce_scatter(self, **kwargs: Any) -> Any:
        return dist.reduce_scatter_single(
            kwargs["output_tensor"],
            kwargs["input_tensor"],
            op=kwargs["op"],
            group=kwargs["group"],
            async_op=kwargs["async_op"],
        )


def _train(
    rank: int,
    world: int,
    reshard: bool | int,
    quantized: bool = False,
    give_back: bool = False,
    extras: str = "",
) -> tuple[list[str], set[str]]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    with _BUILD:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)))
    seen: list[fsdp_engine.QuantizedWeight] = []
    quantize = None
    if quantized:  # every weight is two rows of 4x8 tiles; the biases travel in bf16
        quantize = fsdp_engine.QuantizedAllGather(
            "float8_e4m3fn", block=(4, 8), min_numel=64, hook=seen.append
        )
    policy = fsdp_engine.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, quantized_all_gather=quantize
    )
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    with simulated_streams(give_back=give_back) as sim:
        for layer in model:
            fsdp_engine.fully_shard(
                layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard
            )
        fsdp_engine.fully_shard(model, mesh=mesh, mp_policy=policy)
        modules: list[Any] = [*model, model]
        if "hook" in extras:  # an all-reduce hook on a stream of the user's
            user = sim.stream("user")
            for module in modules:
                module.set_all_reduce_hook(lambda t: t.mul_(1.0), stream=user)
        if "custom" in extras:
            comms = _UserCollectives()
            for module in modules:
                module.set_custom_all_gather(comms.all_gather)
                module.set_custom_reduce_scatter(comms.reduce_scatter)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
        for _ in range(3):
            model(x).float().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if quantized:  # the packed all-gathers ran: the hook saw every weight's FP8 codes
            assert {w.name for w in seen} == {"0.weight"}, {w.name for w in seen}
            assert all(w.codes.dtype == torch.float8_e4m3fn for w in seen)
        return list(sim.races), set(sim.accessed)


def _check_streams(
    monkeypatch: pytest.MonkeyPatch,
    reshard: bool | int,
    quantized: bool,
    planted: bool | str,
    *,
    give_back: bool = False,
    extras: str = "",
) -> None:
    """Train under the simulated streams; ``planted``: frees no longer hand memory back to
    the stream that allocated it, or ``"hook unordered"``: the hook's stream no longer waits for
    the reduction (races the model must report)."""
    install_simulated_streams(monkeypatch)
    monkeypatch.setattr(gather_module, "event_now", simulated_event_now)
    if planted is True:
        monkeypatch.setattr(streams_module, "hand_back", lambda owner, device: None)
    elif planted == "hook unordered":
        real = collectives_module._follow

        def follow(previous: Any, stream: Any, device: torch.device) -> Any:
            if stream is not None and stream.name == "user":
                return stream
            return real(previous, stream, device)

        monkeypatch.setattr(collectives_module, "_follow", follow)
    world = 4 if reshard == 2 else 2
    results: list[Any] = run_threaded(
        _train, world, reshard, quantized, give_back, extras, timeout=120
    )
    expected = {"compute", "all_gather", "reduce_scatter"} | (
        {"user"} if "hook" in extras else set()
    )
    for races, accessed in results:
        assert accessed == expected, accessed
        if planted:
            assert races, "the model saw no race where one was planted"
        else:
            assert races == [], races[:5]


@pytest.mark.parametrize("reshard", [True, 2])
@pytest.mark.parametrize("planted", [False, True])
def test_engine_streams_have_no_race(
    reshard: bool | int, planted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _check_streams(monkeypatch, reshard, False, planted)


@pytest.mark.parametrize(("reshard", "planted"), [(True, False), (2, False), (True, True)])
def test_quantized_engine_streams_have_no_race(
    reshard: bool | int, planted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # planted: the hook's reads of the receive buffer no longer order its reuse
    _check_streams(monkeypatch, reshard, True, planted)


@pytest.mark.parametrize("planted", [False, True])
def test_engine_streams_have_no_race_when_memory_is_given_back(
    planted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24, defect 2: with blocks given back to the device (``empty_cache``, an OOM retry,
    expandable segments) every free must already be ordered after every use."""
    _check_streams(monkeypatch, True, False, planted, give_back=True)


@pytest.mark.parametrize("planted", [False, "hook unordered"])
def test_the_all_reduce_hook_stream_is_ordered(
    planted: bool | str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24, defect 1: ``set_all_reduce_hook(hook, stream=s)``: ``s`` waits for the
    reduction, the gradient's readers wait for ``s``, and the reduced shard goes back to the
    reduce-scatter stream's pool only after ``s`` used it (checked with blocks given back)."""
    _check_streams(monkeypatch, True, False, planted, give_back=True, extras="hook")


def test_custom_collectives_run_on_the_communication_streams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 24, defect 5: a user all-gather / reduce-scatter ran synchronously on the compute
    stream; now on the all-gather and reduce-scatter streams, ordered like the built-in ones."""
    _check_streams(monkeypatch, True, False, False, give_back=True, extras="custom")


def _train_hsdp(rank: int, world: int) -> tuple[list[str], list[tuple[int, int, int]]]:
    """HSDP (2 replicas x 2 shards) under the simulated streams, two steps; what each cap wait
    saw (``_CapProbe``)."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    with _BUILD:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    with simulated_streams(give_back=True) as sim:
        for layer in model:
            fsdp_engine.fully_shard(layer, mesh=mesh)
        fsdp_engine.fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return list(sim.races), list(_CapProbe.seen.get(rank, []))


class _CapProbe:
    """Wraps ``IterationContext.before_reduction``: at each reduction that had to wait for an
    older one (the in-flight cap, 1 by default), records how far the compute stream is ordered
    after the all-reduce stream, how far that stream has got, and how far the compute stream is
    ordered after the reduce-scatter stream (per rank: the ranks are threads)."""

    seen: ClassVar[dict[int, list[tuple[int, int, int]]]] = {}

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        from fsdp_engine._private import iteration

        real = iteration.IterationContext.before_reduction
        cls.seen = {}

        def before_reduction(ctx: Any, group: Any, label: str) -> None:
            waits = bool(ctx.in_flight) and len(ctx.in_flight) >= ctx.max_in_flight
            real(ctx, group, label)
            sim = current_simulation()
            if waits and sim is not None and "all_reduce" in sim.streams:
                compute = sim.compute.clock
                ar = sim.streams["all_reduce"].clock["all_reduce"]
                entry = (compute.get("all_reduce", 0), ar, compute.get("reduce_scatter", 0))
                cls.seen.setdefault(dist.get_rank(), []).append(entry)

        monkeypatch.setattr(iteration.IterationContext, "before_reduction", before_reduction)


@pytest.mark.parametrize("planted", [False, True])
def test_hsdp_cap_waits_for_the_reduce_scatter_only(
    planted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31 item 4: at the cap on reductions in flight, the compute stream waits for the
    older reduction's reduce-scatter (its input is then freed), not for its replica all-reduce
    (FSDP2: a layer costs max(compute, RS), not max(compute, RS + AR)); the gradients' readers
    still wait for the whole reduction (no race, with blocks given back). ``planted``: the cap
    waits for the whole reduction again (the old behaviour): the check must fail."""
    from fsdp_engine._private.param_group import ParamGroup

    install_simulated_streams(monkeypatch)
    monkeypatch.setattr(gather_module, "event_now", simulated_event_now)
    _CapProbe.install(monkeypatch)
    if planted:
        monkeypatch.setattr(ParamGroup, "wait_for_reduce_input", ParamGroup.wait_for_reduce)
    results: list[Any] = run_threaded(_train_hsdp, 4, timeout=120)
    for races, seen in results:
        assert races == [], races[:5]
        assert len(seen) == 6, seen  # 3 cap waits per backward (4 groups), 2 steps
        # every cap wait ordered compute after a reduce-scatter
        assert all(rs > 0 for _, _, rs in seen), seen
        overlapped = [compute < ar for compute, ar, _ in seen]
        if planted:
            assert not any(overlapped), seen
        else:
            assert all(overlapped), seen
