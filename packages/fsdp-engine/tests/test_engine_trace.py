"""The issue order of collectives relative to forward/backward compute equals FSDP2's, except
where ours is deliberately earlier.

A 4-layer model plus a root (``engine_trace``), world size 2 (threaded process group), three
iterations. Events: ``AG:Lk`` / ``RS:Lk`` (an all-gather / reduce-scatter of layer k's group, or
the root's), ``F:Lk`` / ``B:Lk`` (layer k's forward / backward compute starts).

The one deliberate difference ([Note: implicit forward prefetch] in state.py): from the second
iteration on, the all-gather of the layer that runs next is issued in this layer's pre-forward,
before its compute (FSDP2 issues it after that compute, in the next layer's pre-forward, and
overlaps it only through the all-gather stream). Everything else -- the backward prefetch of the
previous layer, each reduce-scatter right after its layer's backward, the root's at the end --
is FSDP2's order.
"""

from __future__ import annotations

from engine_trace import trace, trace_checkpointed_backward

from ragged_dtensor.testing import run_threaded


def _both(rank: int, world: int) -> dict[str, list[list[str]]]:
    return {engine: trace(engine, rank, world, iterations=3) for engine in ("ours", "fsdp2")}


def deliberately_earlier(events: list[str]) -> list[str]:
    """FSDP2's order with each forward all-gather of layer k+1 moved before layer k's compute."""
    out = list(events)
    for k in range(3):
        i, j = out.index(f"F:L{k}"), out.index(f"AG:L{k + 1}")
        assert j == i + 1, (k, out)  # FSDP2: right after layer k's compute was issued
        out[i], out[j] = out[j], out[i]
    return out


def test_issue_order_equals_fsdp2_except_the_forward_prefetch() -> None:
    results = run_threaded(_both, 2, timeout=120)
    assert results[0] == results[1]  # every rank issues the same collectives in the same order
    ours, fsdp2 = results[0]["ours"], results[0]["fsdp2"]
    assert fsdp2[0] == fsdp2[1] == fsdp2[2]
    forward = [e for e in fsdp2[0] if not e.startswith(("B:", "RS:"))][:9]
    assert forward == [
        "AG:root",
        "AG:L0",
        "F:L0",
        "AG:L1",
        "F:L1",
        "AG:L2",
        "F:L2",
        "AG:L3",
        "F:L3",
    ]
    assert ours[0] == fsdp2[0]  # the first iteration knows no order yet: FSDP2's exactly
    assert ours[1] == ours[2] == deliberately_earlier(fsdp2[1])
    # the backward half, FSDP2's: prefetch of the previous layer before this layer's backward,
    # its reduce-scatter right after, the root's (and the input layer's) at the end
    backward = ours[1][ours[1].index("F:L3") + 1 :]
    assert backward == [
        "AG:L3",
        "AG:L2",
        "B:L3",
        "RS:L3",
        "AG:L1",
        "B:L2",
        "RS:L2",
        "AG:L0",
        "B:L1",
        "RS:L1",
        "B:L0",
        "RS:root",
        "RS:L0",
    ]


def _regather(rank: int, world: int) -> dict[str, list[list[str]]]:
    return {
        engine: trace(engine, rank, world, iterations=2, reshard_after_forward=2, mark_async=True)
        for engine in ("ours", "fsdp2")
    }


def test_reshard_after_forward_k_regathers_are_prefetched() -> None:
    """``reshard_after_forward=2`` on 4 ranks: backward rebuilds each layer from the parts kept
    after forward with an all-gather inside 2-rank sub-groups (``AG:Lk/2``). Those are issued
    where FSDP2 issues its own (the next layer of backward's, before this layer's backward; the
    last layer's in the root's pre-backward) and, like any prefetch, asynchronously (``~``):
    they overlap the backward compute before them. (FSDP2 on CPU issues every collective
    synchronously.)"""
    results = run_threaded(_regather, 4, timeout=180)
    assert all(r == results[0] for r in results)
    ours, fsdp2 = results[0]["ours"], results[0]["fsdp2"]
    plain = [[e.rstrip("~") for e in it] for it in ours]
    assert plain[1] == deliberately_earlier([e.rstrip("~") for e in fsdp2[1]])
    assert not any(e.endswith("~") for e in fsdp2[1])
    backward = ours[1][ours[1].index("F:L3") + 1 :]
    assert [e for e in backward if e.startswith("AG:")] == [
        "AG:L3/2~",  # prefetched by the root's pre-backward
        "AG:L2/2~",
        "AG:L1/2~",
        "AG:L0/2~",
    ]


def _checkpointed(rank: int, world: int) -> dict[str, list[str]]:
    return {e: trace_checkpointed_backward(e, rank, world) for e in ("ours", "fsdp2")}


def test_backward_prefetch_inside_activation_checkpointing_is_fsdp2s() -> None:
    """Checkpoint-wrapped layers with a fully_shard group nested inside each, and explicit
    backward prefetching (layer k prefetches layer k-1 and its inner group): the recompute
    inside backward gathers nothing twice, and the backward's collectives (the explicit
    prefetches, each reduce-scatter after its group's backward) are FSDP2's, in order."""
    results = run_threaded(_checkpointed, 2, timeout=120)
    assert results[0] == results[1]
    ours, fsdp2 = results[0]["ours"], results[0]["fsdp2"]
    assert ours == fsdp2, (ours, fsdp2)
    assert fsdp2 == [
        "AG:L3",  # the root's pre-backward: the last layer (its own default prefetch)
        "AG:L3.in",  # layer 3's inner group, when the recompute runs its forward
        "AG:L2",  # layer 3's explicit prefetches
        "AG:L2.in",
        "RS:L3.in",
        "RS:L3",
        "AG:L1",
        "AG:L1.in",
        "RS:L2.in",
        "RS:L2",
        "AG:L0",
        "AG:L0.in",
        "RS:L1.in",
        "RS:L1",
        "RS:L0.in",
        "RS:root",
        "RS:L0",
    ]
