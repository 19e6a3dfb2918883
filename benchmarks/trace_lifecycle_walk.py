"""How far one module's forward and backward walk through the engine's source (issue 31 item 2).

One step of a 2-layer model (``fully_shard`` on each ``Linear`` and on the root) on one rank
of a gloo group, traced with ``sys.setprofile`` after a warm-up step. Only Python frames in the
sources of ``fsdp_engine``, ``dbuffer`` and ``ragged_dtensor`` count; a frame of another file
(torch's hook machinery, autograd) is outside. Each entry into the engine from outside (a hook
torch calls) is attributed to the ``FSDPState`` it runs for. For the second layer, forward
(pre- and post-forward) and backward (pre- and post-backward) separately:

- ``modules``: distinct source files entered;
- ``entries``: calls that cross into another source file (from outside, or from another of
  our files);
- ``returns``: returns that cross back into another file (or outside);
- ``return edges``: distinct (from file, to file) pairs among the returns from one of our files
  to another (how many ways the walk goes back and forth; torch's FSDP2 gives 4 modules and 6
  edges forward, the figures issue 31 quotes for it).

Run: ``python benchmarks/trace_lifecycle_walk.py`` (prints one line per phase, and with
``--files`` the files entered); ``--fsdp2``: the same walk through torch's FSDP2 (its
``_fully_shard`` files), the control.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dbuffer
import fsdp_engine
import ragged_dtensor

FSDP2 = "--fsdp2" in sys.argv  # the control: torch's FSDP2, its _fully_shard files
if FSDP2:
    import torch.distributed.fsdp._fully_shard as _torch_fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    ROOTS: tuple[str, ...] = (str(Path(_torch_fully_shard.__file__).parent),)
    API: Any = torch.distributed.fsdp
else:
    from fsdp_engine._private.state import FSDPState

    ROOTS = tuple(str(Path(m.__file__).parent) for m in (fsdp_engine, dbuffer, ragged_dtensor))
    API = fsdp_engine
BASE = str(Path(ROOTS[0]).parents[0])


def _ours(frame: FrameType) -> str | None:
    path = frame.f_code.co_filename
    return os.path.relpath(path, BASE) if path.startswith(ROOTS) else None


def _owner(frame: FrameType) -> Any:
    """The FSDPState a frame works for, if it says."""
    local = frame.f_locals
    for value in (local.get("self"), local.get("state"), getattr(local.get("fn"), "__self__", 0)):
        if isinstance(value, FSDPState):
            return value
    ctx = local.get("ctx")
    state = getattr(ctx, "state", None)
    return state if isinstance(state, FSDPState) else None


class Walk:
    """A ``sys.setprofile`` function: per entry into our files from outside, a record of the
    files it entered and the crossings, attributed to the state it ran for."""

    def __init__(self) -> None:
        self.stack: list[tuple[str | None, dict[str, Any] | None]] = []
        self.phase = "forward"
        self.records: list[dict[str, Any]] = []

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            parent, record = self.stack[-1] if self.stack else (None, None)
            file = _ours(frame)
            if file is None:  # outside: the innermost of our files stays the parent's
                self.stack.append((parent, record))
                return
            if record is None or parent is None:
                record = {"owner": None, "phase": self.phase, "files": set(), "entries": 0}
                record["returns"] = 0
                record["edges"] = set()
                self.records.append(record)
            if record["owner"] is None:
                record["owner"] = _owner(frame)
            if file != parent:
                record["entries"] += 1
                record["files"].add(file)
            self.stack.append((file, record))
        elif event == "return" and self.stack:
            file, record = self.stack.pop()
            parent = self.stack[-1][0] if self.stack else None
            if record is not None and _ours(frame) is not None and file != parent:
                record["returns"] += 1
                if parent is not None:
                    record["edges"].add((file, parent))


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    for layer in model:
        API.fully_shard(layer)
    API.fully_shard(model)
    x = torch.randn(4, 16)
    for _ in range(2):  # lazy init and the forward-order prediction
        model(x).sum().backward()
        model.zero_grad()
    walk = Walk()
    loss = None

    def forward() -> None:
        nonlocal loss
        loss = model(x).sum()

    sys.setprofile(walk)
    forward()
    walk.phase = "backward"
    assert loss is not None
    loss.backward()
    sys.setprofile(None)
    target = model[1]._get_fsdp_state() if FSDP2 else model[1].__dict__["_fsdp_engine_state"]
    for phase in ("forward", "backward"):
        entry: dict[str, Any] = {"files": set(), "entries": 0, "returns": 0, "edges": set()}
        for record in walk.records:
            if record["owner"] is target and record["phase"] == phase:
                entry["files"] |= record["files"]
                entry["edges"] |= record["edges"]
                entry["entries"] += record["entries"]
                entry["returns"] += record["returns"]
        print(
            f"layer 1 {phase}: modules {len(entry['files'])}, return edges "
            f"{len(entry['edges'])} (crossings: {entry['entries']} calls, {entry['returns']} "
            "returns)"
        )
        if "--files" in sys.argv:
            print("   ", sorted(entry["files"]))
            print("   ", sorted(entry["edges"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
