"""Free functions for the collectives of a DBuffer, and the handle an async collective returns.

[Note: one collective per group, no copies]
The all-gather sends the shard storage itself and receives straight into the unsharded storage,
whose slices already are the full tensors: no copy-in, no copy-out. The reduce-scatter sends the
unsharded gradient storage itself (autograd wrote the gradients into its slices) and receives
straight into the sharded gradient storage. Only a dtype change (mixed precision) or an
accumulation adds one fused kernel over the whole group.

[Note: streams and frees without record_stream]
On an accelerator, all-gathers run on one all-gather stream per device and reduce-scatters (with
the HSDP all-reduce and their epilogue) on one reduce-scatter stream, both high priority, so a
reduction never queues behind a prefetch and neither waits for compute it does not need. Each
collective waits only on the events its data depends on:

- an all-gather on ``ready``, the event marking the last write of its input (the caller's: the
  engine records one when an iteration starts, after the optimizer step), or, without one, on
  the caller's stream at issue time; and on the last event ``note_free`` recorded on each
  stream that freed, since its output storage is allocated *on the all-gather stream* and may
  reuse a block the caller's stream was still reading when it was freed (``DBuffer.reshard``
  records that event before each free). The low-precision cast of the shard runs there too, off
  the compute stream;
- a reduce-scatter on the caller's stream at issue time (the gradients it reduces were just
  computed there); its temporaries (the reduce-dtype cast, the receive buffer) are allocated and
  written on the reduce-scatter stream.

After the collective and its epilogue an event is recorded on its stream and ``Handle.wait``
makes the caller's stream wait on it. Memory the caller's stream owns is freed in ``wait``, after
that ordering; memory a communication stream owns is only ever reused by that stream after it
has waited for the caller's last use. So no ``record_stream``, and frees happen exactly when
``wait`` (or the synchronous call, or ``reshard``) returns. On CPU (gloo) there are no streams;
``async_op`` uses the process group's own asynchronous work objects. The protocol is checked on
CPU against a model of streams, events and the caching allocator's reuse rule
(``tests/test_dbuffer_streams.py``, and the engine's use of it in the repository's
``tests/test_integration_streams.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
import torch.distributed as dist

__all__ = [
    "Handle",
    "ReduceOp",
    "all_gather_flat",
    "comm_stream_for",
    "note_free",
    "order_all_gather",
    "reduce_scatter_flat",
]

ReduceOp = Literal["sum", "avg"]
StreamKind = Literal["all_gather", "reduce_scatter"]

_COMM_STREAMS: dict[tuple[torch.device, str], torch.Stream] = {}
# device -> (stream id -> the last ``note_free`` event recorded on that stream)
_LAST_FREE: dict[torch.device, dict[int, torch.Event]] = {}
_HIGH_PRIORITY = -1  # accelerators' streams: 0 is normal, negative is higher


def comm_stream_for(device: torch.device, kind: StreamKind = "all_gather") -> torch.Stream | None:
    """The ``kind`` communication stream of ``device`` (one per device and kind, shared by all
    buffers, high priority), or None for devices without streams (CPU)."""
    if device.type in {"cpu", "meta"}:
        return None
    stream = _COMM_STREAMS.get((device, kind))
    if stream is None:
        stream = torch.Stream(device=device, priority=_HIGH_PRIORITY)
        _COMM_STREAMS[(device, kind)] = stream
    return stream


def _current(device: torch.device) -> torch.Stream:
    return torch.accelerator.current_stream(device)


def note_free(device: torch.device) -> None:
    """Before freeing memory an all-gather stream allocated: mark how far the caller's stream
    has got (every read of that memory issued so far). The next all-gather waits on it.

    One event per caller stream: a later event on the same stream covers the earlier ones
    (stream order), but not another stream's (e.g. a forward run under a side stream), so the
    last event of every stream that freed is kept."""
    if comm_stream_for(device) is None:
        return
    stream = _current(device)
    event = torch.Event(device=device)
    event.record(stream)
    _LAST_FREE.setdefault(device, {})[stream.stream_id] = event


def order_all_gather(device: torch.device, ready: torch.Event | None) -> torch.Stream | None:
    """Make ``device``'s all-gather stream wait for what the next all-gather depends on: its
    input's last write (``ready``, else the caller's stream now) and the last ``note_free``.
    Returns the stream (None on CPU); allocate the all-gather's output under it."""
    stream = comm_stream_for(device, "all_gather")
    if stream is None:
        return None
    if ready is None:
        ready = torch.Event(device=device)
        ready.record(_current(device))
    stream.wait_event(ready)
    for freed in _LAST_FREE.get(device, {}).values():
        stream.wait_event(freed)
    return stream


class Handle:
    """A collective in flight. ``wait()`` completes it (idempotent) and runs its epilogue.

    Until ``wait()`` returns, the destination storage must not be read and the source must not be
    written. On an accelerator ``wait()`` does not block the host: it orders the caller's stream
    after the collective.
    """

    def __init__(
        self,
        works: Sequence[dist.Work] = (),
        *,
        event: torch.Event | None = None,
        finish: Callable[[], None] | None = None,
        keep: Sequence[torch.Tensor] = (),
    ) -> None:
        self._works = list(works)
        self._event = event
        self._finish = finish
        self._keep = list(keep)
        self._done = False

    @property
    def done(self) -> bool:
        """True once ``wait()`` has returned."""
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        for work in self._works:
            work.wait()
        if self._event is not None:
            torch.accelerator.current_stream(self._event.device).wait_event(self._event)
        finish, self._finish = self._finish, None
        self._works, self._keep, self._done = [], [], True
        if finish is not None:
            finish()


@contextlib.contextmanager
def _on_comm_stream(
    device: torch.device, kind: StreamKind, *, ordered: bool = False
) -> Iterator[list[torch.Event]]:
    """Run the body on ``device``'s ``kind`` stream (after the caller's stream now, unless
    ``ordered``: the caller made it wait already); yields a list that receives the event
    marking the end of the body (empty on CPU)."""
    stream = comm_stream_for(device, kind)
    done: list[torch.Event] = []
    if stream is None:
        yield done
        return
    if not ordered:
        ready = torch.Event(device=device)
        ready.record(_current(device))
        stream.wait_event(ready)
    with stream:
        yield done
        end = torch.Event(device=device)
        end.record(stream)
    done.append(end)


def _supports_avg(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == "nccl"


def predivide_factor(dtype: torch.dtype, ranks: int) -> int:
    """[Note: dividing a mean of gradients]
    A mean over ``ranks`` of gradients in a dtype of small range (anything but fp32 and bf16,
    e.g. fp16) is computed as ``sum(g / p) / (ranks / p)`` with ``p`` the power of two nearest
    below ``sqrt(ranks)`` that divides it: summing ``ranks`` fp16 gradients first can overflow
    at scale, dividing each by ``ranks`` first can underflow. fp32 and bf16 sum first and
    divide once. This is FSDP2's rule (``_get_gradient_divide_factors``), so the two engines
    round alike."""
    if dtype in (torch.float32, torch.bfloat16):
        return 1
    pre = 1
    while ranks % pre == 0 and ranks / pre > pre:
        pre *= 2
    return pre


def all_gather_flat(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
    finish: Callable[[], None] | None = None,
    keep: Sequence[torch.Tensor] = (),
    ordered: bool = False,
) -> Handle:
    """One all-gather of the flat ``inp`` (S elements) into the flat ``out`` (m * S elements).

    ``finish`` runs when the handle completes (frees temporaries); ``keep`` holds tensors alive
    until then. ``ordered``: the all-gather stream already waits for what it must
    (``order_all_gather``), else it waits for the caller's stream now.
    """
    if out.numel() != inp.numel() * dist.get_world_size(group):
        raise ValueError(
            f"all-gather output has {out.numel()} elements, expected "
            f"{dist.get_world_size(group)} x {inp.numel()}"
        )
    works: list[dist.Work] = []
    cpu_async = async_op and comm_stream_for(inp.device) is None
    with _on_comm_stream(inp.device, "all_gather", ordered=ordered) as done:
        work = dist.all_gather_single(out, inp, group=group, async_op=cpu_async)
        if cpu_async and work is not None:
            works.append(work)
    handle = Handle(works, event=done[0] if done else None, finish=finish, keep=(out, inp, *keep))
    if not async_op:
        handle.wait()
    return handle


def reduce_scatter_flat(
    out: torch.Tensor,
    inp: torch.Tensor,
    shard_group: dist.ProcessGroup,
    replicate_groups: Sequence[dist.ProcessGroup] = (),
    *,
    op: ReduceOp = "sum",
    reduce_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    async_op: bool = False,
    finish: Callable[[], None] | None = None,
) -> Handle:
    """Reduce-scatter the flat ``inp`` (m * S) over ``shard_group`` into the flat ``out`` (S),
    then all-reduce the result over each of ``replicate_groups`` (HSDP).

    The result is the sum over every rank of the groups (or the mean for ``op="avg"``: the sum
    divided by the product of the group sizes, done once after the last collective, fused with
    the accumulation or the cast). ``reduce_dtype`` runs the collectives in that dtype (one cast
    of the whole input before, one cast back fused with the write). ``accumulate`` adds the
    result into ``out`` instead of overwriting it.
    """
    world = dist.get_world_size(shard_group)
    if inp.numel() != out.numel() * world:
        raise ValueError(
            f"reduce-scatter input has {inp.numel()} elements, expected {world} x {out.numel()}"
        )
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce op must be 'sum' or 'avg', got {op!r}")
    divisor = world
    for group in replicate_groups:
        divisor *= dist.get_world_size(group)
    rdtype = reduce_dtype or inp.dtype
    pre = predivide_factor(rdtype, divisor) if op == "avg" else 1
    native_avg = (
        op == "avg" and pre == 1 and all(_supports_avg(g) for g in (shard_group, *replicate_groups))
    )
    red = dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
    direct = not accumulate and rdtype == out.dtype
    works: list[dist.Work] = []
    stream = comm_stream_for(inp.device, "reduce_scatter")
    # Without a comm stream, async work can be chained only for the reduce-scatter; the
    # all-reduce over replicas and the epilogue run in wait().
    defer = async_op and stream is None

    def epilogue() -> None:
        for group in replicate_groups:
            dist.all_reduce(recv, op=red, group=group)
        # [Note: dividing a mean of gradients]: a division (what FSDP2 and gloo's AVG do),
        # not a multiplication by the reciprocal, which rounds differently for odd counts
        post = divisor // pre if op == "avg" and not native_avg else 1
        if direct:
            if post != 1:
                out.div_(post)
        elif accumulate:
            out.add_(recv.div_(post) if post != 1 else recv)
        elif post != 1:
            torch.div(recv, post, out=out)
        else:
            out.copy_(recv)

    with _on_comm_stream(inp.device, "reduce_scatter") as done:
        # Temporaries made (and the cast run) on the reduce-scatter stream: see [Note: streams
        # and frees without record_stream]
        send = inp if rdtype == inp.dtype else inp.to(rdtype)
        if pre != 1:  # a temporary when inp is already in the reduce dtype
            send = send.div_(pre) if send is not inp else inp.div(pre)
        recv = out if direct else torch.empty(out.numel(), dtype=rdtype, device=out.device)
        work = dist.reduce_scatter_single(recv, send, op=red, group=shard_group, async_op=defer)
        if defer and work is not None:
            works.append(work)
        if not defer:
            epilogue()

    def complete() -> None:
        if defer:
            epilogue()
        if finish is not None:
            finish()

    handle = Handle(
        works, event=done[0] if done else None, finish=complete, keep=(send, recv, inp, out)
    )
    if not async_op:
        handle.wait()
    return handle
