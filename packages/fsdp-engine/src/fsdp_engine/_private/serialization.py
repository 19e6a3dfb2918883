"""The plain per-rank save: ``torch.save(model.state_dict(), f"rank{r}.pt")``, then
``model.load_state_dict(torch.load(...))`` at the same world size, as with FSDP2.

[Note: the per-rank save]
Two things stood between our sharded state dict and torch's serialization, both fixed where our
DTensors are made, with nothing of torch changed:
- a DTensor over a local view that starts at a storage offset reports a non-zero ``data_ptr()``,
  and ``torch.save`` then takes it for a tensor with a storage ("invalid python storage"); and
  a view pickles its whole storage (a rank's whole group shard for one parameter). Ours have
  local tensors over storage slices of their own, at offset 0 ([Note: DTensors over views] in
  compat): each pickles its own elements, and its wrapper reports 0.
- ``torch.load`` defaults to ``weights_only=True``, whose unpickler takes only allowlisted
  classes: torch allowlists its own DTensor, DeviceMesh and placements when
  ``torch.distributed.tensor`` is imported; ``allow_raggedshard_in_weights_only_load``
  allowlists ``RaggedShard`` the same way (``torch.serialization.add_safe_globals``, torch's
  public registry), when ``fully_shard`` is first called. A process that loads such a file
  without having called ``fully_shard`` passes it itself: ``with
  torch.serialization.safe_globals([ragged_dtensor.RaggedShard]): torch.load(...)``.
"""

from __future__ import annotations

import threading

import torch

from ragged_dtensor import RaggedShard

__all__ = ["allow_raggedshard_in_weights_only_load"]

_LOCK = threading.Lock()
_ALLOWED = False


def allow_raggedshard_in_weights_only_load() -> None:
    """Allowlist ``RaggedShard`` for ``torch.load(weights_only=True)`` (once)."""
    global _ALLOWED
    if _ALLOWED:
        return
    with _LOCK:
        if not _ALLOWED:
            torch.serialization.add_safe_globals([RaggedShard])
            _ALLOWED = True
