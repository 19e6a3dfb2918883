"""Tools for testing code built on dbuffer; no package uses them.

- ``simulated_streams`` / ``install_simulated_streams``: a model of accelerator streams on CPU
  (vector clocks, per-stream reads and writes, the caching allocator's per-stream pools and memory
  given back to the device) that reports every access dbuffer's stream protocol, or a caller's
  use of it, leaves unordered (``StreamSimulation.races``); ``simulated_event_now`` is an event on
  the calling rank's current simulated stream.
"""

from __future__ import annotations

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
    "simulated_streams",
    "install_simulated_streams",
    "current_simulation",
    "simulated_event_now",
    "StreamSimulation",
    "SimulatedStream",
    "SimulatedEvent",
]
