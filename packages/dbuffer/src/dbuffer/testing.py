"""Tests' and measurements' tools for code built on dbuffer; no package uses them.

- ``load_full_(buffer, tensors)``: copy this rank's share of full tensors into a buffer;
- ``sharded_views(buffer)``: each tensor's shard as a ``RaggedShard`` DTensor over the buffer;
- ``attach_grads(buffer, params)``: ``params[i].grad`` a view of the buffer's unsharded storage;
- ``views_held_elsewhere(buffer)``: whether ``release_shard`` would keep the shard storage;
- ``LiveBytes`` / ``CopiedBytes``: dispatch modes tallying live storage bytes (peak, current)
  and bytes written by copy-like ops, for memory and copy measurements on any device (CPU
  included, where torch keeps no allocator statistics);
- ``simulated_streams`` / ``install_simulated_streams``: a model of accelerator streams on CPU
  (vector clocks, per-stream reads and writes, the caching allocator's per-stream pools and memory
  given back to the device) that reports every access dbuffer's stream protocol, or a caller's
  use of it, leaves unordered (``StreamSimulation.races``); ``simulated_event_now`` is an event on
  the calling rank's current simulated stream.
"""

from __future__ import annotations

from dbuffer._private.conveniences import (
    attach_grads,
    load_full_,
    sharded_views,
    views_held_elsewhere,
)
from dbuffer._private.measure import CopiedBytes, LiveBytes
from dbuffer._private.simulated_streams import (
    SimulatedEvent,
    SimulatedStream,
    StreamSimulation,
    current_simulation,
    install_simulated_streams,
    simulated_event_now,
    simulated_streams,
)

__all__ = [
    "load_full_",
    "sharded_views",
    "attach_grads",
    "views_held_elsewhere",
    "LiveBytes",
    "CopiedBytes",
    "simulated_streams",
    "install_simulated_streams",
    "current_simulation",
    "simulated_event_now",
    "StreamSimulation",
    "SimulatedStream",
    "SimulatedEvent",
]
