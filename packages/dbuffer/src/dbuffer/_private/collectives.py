"""Free functions for the collectives of a DBuffer, and the handle an async collective returns.

[Note: one collective per group, no copies]
The all-gather sends the shard storage itself and receives straight into the unsharded storage,
whose slices already are the full tensors: no copy-in, no copy-out. The reduce-scatter sends the
unsharded gradient storage itself (autograd wrote the gradients into its slices) and receives
straight into the sharded gradient storage. Only a dtype change (mixed precision), a division
or an accumulation adds one fused kernel over the whole group.

[Note: two events per reduction]
A reduction records one event when its reduce-scatter has read the input and one at its end
(after the HSDP all-reduce, the hook and the write into the destination). ``Handle.wait_input``
waits for the first and frees the input: what a cap on reductions in flight needs (the memory
is the input), so the compute stream never waits for an all-reduce to bound memory (FSDP2's
``reduce_scatter_states``). ``Handle.wait`` waits for the second: what a reader of the gradient
needs.

Streams and frees: [Note: streams and frees without record_stream] (streams.py). Arithmetic of
means: [Note: dividing a mean of gradients] (reduction.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dbuffer._private import streams
from dbuffer._private.reduction import ReduceSpec

__all__ = [
    "AllGatherComm",
    "Handle",
    "ReduceScatterComm",
    "all_gather_flat",
    "reduce_scatter_flat",
]

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


class AllGatherComm(Protocol):
    """A user all-gather (FSDP2's ``set_custom_all_gather`` signature)."""

    def __call__(
        self,
        *,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any: ...


class ReduceScatterComm(Protocol):
    """A user reduce-scatter (FSDP2's ``set_custom_reduce_scatter`` signature)."""

    def __call__(
        self,
        *,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any: ...


class Handle:
    """A collective in flight. ``wait()`` completes it (idempotent) and runs its epilogue.

    Until ``wait()`` returns, the destination storage must not be read and the source must not be
    written. On an accelerator ``wait()`` does not block the host: it orders the caller's stream
    after the collective, then hands the temporaries back to the streams that allocated them
    (``streams.hand_back``) before releasing them.
    """

    def __init__(
        self,
        works: Sequence[dist.Work] = (),
        *,
        event: torch.Event | None = None,
        finish: Callable[[], None] | None = None,
        keep: Sequence[torch.Tensor] = (),
        owners: Sequence[torch.Stream] = (),
        device: torch.device | None = None,
        input_event: torch.Event | None = None,
        release_input: Callable[[], None] | None = None,
    ) -> None:
        self._works = list(works)
        self._input_event = input_event
        self._release_input = release_input
        self._input_waited = False
        self._event = event
        self._finish = finish
        self._keep = list(keep)
        self._owners = tuple(owners)
        self._device = device
        self._done = False

    @property
    def done(self) -> bool:
        """True once ``wait()`` has returned."""
        return self._done

    def wait_input(self) -> None:
        """Only the collective's reading of its input: the caller's stream is ordered after it
        and the input is released; what follows it (an HSDP all-reduce, a hook, the write into
        the destination) stays in flight until ``wait()`` ([Note: two events per reduction]).
        Without an event for it (no streams: host-ordered work) this is ``wait()``."""
        if self._done:
            return
        event, self._input_event = self._input_event, None
        if event is None:  # host-ordered (no streams), or already waited
            if self._release_input is not None or not self._input_waited:
                self.wait()
            return
        self._input_waited = True
        device = event.device if self._device is None else self._device
        assert device is not None
        streams.current_stream(device).wait_event(event)
        release, self._release_input = self._release_input, None
        if release is not None:
            release()

    def wait(self) -> None:
        if self._done:
            return
        for work in self._works:
            work.wait()
        if self._event is not None:
            device = self._event.device if self._device is None else self._device
            assert device is not None
            streams.current_stream(device).wait_event(self._event)
        release, self._release_input = self._release_input, None
        if release is not None:
            release()
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        if self._device is not None:
            for owner in self._owners:
                streams.hand_back(owner, self._device)
        self._works, self._keep, self._done = [], [], True


def _wait_work(work: Any) -> None:
    if work is not None and hasattr(work, "wait"):
        work.wait()


def all_gather_flat(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
    finish: Callable[[], None] | None = None,
    keep: Sequence[torch.Tensor] = (),
    ordered: bool = False,
    comm: AllGatherComm | None = None,
) -> Handle:
    """One all-gather of the flat ``inp`` (S elements) into the flat ``out`` (m * S elements).

    ``finish`` runs when the handle completes (frees temporaries); ``keep`` holds tensors alive
    until then. ``ordered``: the all-gather stream already waits for what it must, else it waits
    for the caller's stream now. ``comm``: a user all-gather run in place of the backend's (on
    the all-gather stream, like it).
    """
    if out.numel() != inp.numel() * group.size():
        raise ValueError(
            f"all-gather output has {out.numel()} elements, expected {group.size()} x {inp.numel()}"
        )
    device = inp.device
    stream = streams.comm_stream_for(device, "all_gather")
    if not ordered:
        streams.ordered_after(stream, device, None)
    works: list[Any] = []
    cpu_async = async_op and stream is None
    with streams.on_stream(stream):
        streams.collective_starts("all_gather", stream)
        if comm is None:
            work = dist.all_gather_single(out, inp, group=group, async_op=cpu_async)
        else:
            work = comm(output_tensor=out, input_tensor=inp, group=group, async_op=cpu_async)
            if not cpu_async:
                _wait_work(work)  # a user collective may return work even when synchronous
                work = None
        if cpu_async and work is not None:
            works.append(work)
        end = None if stream is None else streams.event_after(stream, device)
    handle = Handle(
        works, event=end, finish=finish, keep=(out, inp, *keep), owners=(), device=device
    )
    if not async_op:
        handle.wait()
    return handle


def _send_buffer(
    inp: torch.Tensor, rdtype: torch.dtype, spec: ReduceSpec, shard: int
) -> torch.Tensor:
    """The reduce-scatter's input in the reduce dtype with the pre-division or pre-multiplication
    applied: ``inp`` itself when nothing changes it, else one temporary (the caller's stream is
    the reduce-scatter stream here, so the temporary is its memory)."""
    send = inp if rdtype == inp.dtype else inp.to(rdtype)
    scale = None
    if spec.premul_factor is not None and shard > 1:
        scale = 1.0 / spec.premul_factor
    if spec.pre_divide is not None:
        send = send.div_(spec.pre_divide) if send is not inp else inp.div(spec.pre_divide)
    if scale is not None:
        send = send.mul_(scale) if send is not inp else inp.mul(scale)
    return send


def reduce_scatter_flat(
    out: torch.Tensor,
    inp: torch.Tensor,
    shard_group: dist.ProcessGroup,
    replicate_groups: Sequence[dist.ProcessGroup] = (),
    *,
    spec: ReduceSpec,
    reduce_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    async_op: bool = False,
    finish: Callable[[], None] | None = None,
    hook: Callable[[torch.Tensor], None] | None = None,
    hook_stream: torch.Stream | None = None,
    comm: ReduceScatterComm | None = None,
    allocate: Callable[..., torch.Tensor] | None = None,
    partial: torch.Tensor | None = None,
    release_input: Callable[[], None] | None = None,
) -> Handle:
    """Reduce-scatter the flat ``inp`` (m * S) over ``shard_group`` into the flat ``out`` (S),
    then all-reduce the result over each of ``replicate_groups`` (HSDP), with ``spec``'s
    arithmetic ([Note: dividing a mean of gradients]); a shard group of one rank copies instead
    of reducing (no collective, as in FSDP2).

    ``reduce_dtype`` runs the collectives in that dtype (one cast of the whole input before, one
    cast back fused with the write); ``accumulate`` adds the result into ``out``. ``hook(result)``
    runs on the reduced shard in the reduce dtype after the all-reduce and before the
    post-division (FSDP2's all-reduce hook), on ``hook_stream`` (default: the all-reduce stream)
    ordered after the reduction; ``comm`` replaces the backend's reduce-scatter and
    ``allocate(shape, dtype=, device=)`` (its allocator) makes the receive buffer. ``partial``
    (reduce dtype, S elements: earlier microbatches reduce-scattered without their all-reduce)
    is added to the result before the all-reduce (FSDP2's ``partial_reduce_output``).
    ``release_input`` frees ``inp`` once the reduce-scatter has read it (``Handle.wait_input``,
    or ``wait``).

    Streams: the reduce-scatter (and the casts, pre-division and receive buffer) on the
    reduce-scatter stream after the caller's stream; the all-reduce on the all-reduce stream;
    the hook and the epilogue on the last of them; the handle's event after the epilogue.
    """
    world = shard_group.size()
    if inp.numel() != out.numel() * world:
        raise ValueError(
            f"reduce-scatter input has {inp.numel()} elements, expected {world} x {out.numel()}"
        )
    device = inp.device
    rdtype = reduce_dtype or inp.dtype
    direct = not accumulate and rdtype == out.dtype and hook is None
    rs_stream = streams.comm_stream_for(device, "reduce_scatter")
    ar_stream = streams.comm_stream_for(device, "all_reduce")
    host_hook_stream = None
    if rs_stream is None:  # a device without streams: everything runs in order on the host,
        host_hook_stream, hook_stream = hook_stream, None  # the hook "on" its stream (FSDP2)
    # Without streams (gloo) async work can be chained only for the reduce-scatter; the
    # all-reduce over replicas, the hook and the epilogue run in wait().
    defer = async_op and rs_stream is None
    streams.ordered_after(rs_stream, device, None)
    works: list[Any] = []
    with streams.on_stream(rs_stream):
        send = _send_buffer(inp, rdtype, spec, world)
        if direct:
            recv = out
        elif allocate is not None:
            recv = allocate((out.numel(),), dtype=rdtype, device=device)
        else:
            recv = torch.empty(out.numel(), dtype=rdtype, device=device)
        if world == 1:
            if spec.premul_factor is not None:
                torch.div(send, spec.premul_factor, out=recv)
            elif recv is not send:
                recv.copy_(send)
        elif comm is not None:
            streams.collective_starts("reduce_scatter", rs_stream)
            work = comm(
                output_tensor=recv,
                input_tensor=send,
                group=shard_group,
                op=_OPS[spec.scatter_op],
                async_op=defer,
            )
            if defer and work is not None:
                works.append(work)
            elif not defer:
                _wait_work(work)
        else:
            streams.collective_starts("reduce_scatter", rs_stream)
            work = dist.reduce_scatter_single(
                recv, send, op=_OPS[spec.scatter_op], group=shard_group, async_op=defer
            )
            if defer and work is not None:
                works.append(work)
        last = rs_stream
    # [Note: two events per reduction]: the input is free once this is reached, whatever
    # follows on other streams
    input_read = None if rs_stream is None or defer else streams.event_after(rs_stream, device)

    def epilogue() -> torch.Stream | None:
        """The all-reduce, the hook and the write into ``out``; returns the stream it ended on."""
        stream = last
        if partial is not None:  # on the reduce-scatter stream, as FSDP2 accumulates
            with streams.on_stream(stream):
                recv.add_(partial)
        if replicate_groups:
            stream = _follow(stream, ar_stream, device)
            with streams.on_stream(stream):
                for group in replicate_groups:
                    streams.collective_starts("all_reduce", stream)
                    dist.all_reduce(recv, op=_OPS[spec.all_reduce_op], group=group)
        if hook is not None:
            target = hook_stream if hook_stream is not None else ar_stream
            stream = _follow(stream, target, device)
            with streams.on_stream(stream), _as_current(host_hook_stream, device):
                hook(recv)
        with streams.on_stream(stream):
            _write(out, recv, spec.post_divide, direct=direct, accumulate=accumulate)
        return stream

    end: torch.Event | None = None
    if not defer:
        final = epilogue()
        end = None if final is None else streams.event_after(final, device)

    def complete() -> None:
        if defer:
            epilogue()
        if finish is not None:
            finish()

    owners = () if rs_stream is None else (rs_stream,)
    handle = Handle(
        works,
        event=end,
        finish=complete,
        keep=(send, recv, inp, out) if partial is None else (send, recv, inp, out, partial),
        owners=owners,
        device=device,
        input_event=input_read,
        release_input=release_input,
    )
    if not async_op:
        handle.wait()
    return handle


def _as_current(stream: torch.Stream | None, device: torch.device) -> Any:
    """``stream`` as the current stream of ``device``'s module for the body, on a device whose
    streams order nothing (CPU): a hook that asks for its stream sees the one it was given, as
    with FSDP2."""
    if stream is None:
        return contextlib.nullcontext()
    return torch.get_device_module(device.type).stream(stream)


def _follow(
    previous: torch.Stream | None, stream: torch.Stream | None, device: torch.device
) -> torch.Stream | None:
    """Continue on ``stream`` after everything ``previous`` has issued (no streams: None)."""
    if stream is None or previous is None or stream == previous:
        return stream if stream is not None else previous
    stream.wait_event(streams.event_after(previous, device))
    return stream


def _write(
    out: torch.Tensor,
    recv: torch.Tensor,
    post: float | None,
    *,
    direct: bool,
    accumulate: bool,
) -> None:
    """The reduced shard into ``out``: post-division (a division, as FSDP2's, not a
    multiplication by the reciprocal, which rounds differently), cast, accumulation."""
    if direct:
        if post is not None:
            out.div_(post)
    elif accumulate:
        out.add_(recv.div_(post) if post is not None else recv)
    elif post is not None:
        torch.div(recv, post, out=out)
    else:
        out.copy_(recv)
