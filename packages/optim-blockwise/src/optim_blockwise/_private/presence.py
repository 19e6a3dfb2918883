"""Presence flags: which units (parameters) have data this step, checked across ranks
without a host read.

[Note: presence flags, no host synchronization]
A step must not read device data on the host. Which units have data this step (e.g. which
parameters have gradients) can differ between ranks by mistake, and a per-step agreement
collective would need exactly such a read. Instead, with ``present`` given, each piece travels
with one flag byte (in the same buffer, after the data for each destination, padded to 16 bytes);
the owner turns the flags of a unit into a status (0: no rank has data, 1: every rank, 2:
mixed) and sends every unit's status to every rank with the results. Each rank then checks the
statuses with ``torch._assert_async`` (device-side on accelerators, no host read; on CPU it
raises at once): a mixed unit raises on every rank at the same point instead of applying a
result computed from a partial gradient. Sizes never depend on the flags, so the collectives
always match. The flag bytes are made on the device by fills (never copied from host memory)
and kept per presence pattern (``PresenceFlags``): a steady-state step, whose pattern repeats,
reuses them and issues no kernel for them at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["MixedPresenceError", "PresenceFlags", "check_presence", "presence_status"]

_PATTERNS = 64  # presence patterns kept per PresenceFlags (a steady state repeats one)


class MixedPresenceError(RuntimeError):
    """Some ranks had data (e.g. a gradient) for a unit and others did not."""


class PresenceFlags:
    """Flag tensors (1: present, 0: absent) made on the device without host data, kept per
    pattern: ``flags(values, length, dtype, device)``.

    Copying a list of booleans to an accelerator is a pageable host-to-device copy (the host
    waits for it). Here a pattern's tensor is zeros with one fill per run of present entries,
    made the first time the pattern occurs and reused afterwards (the cached tensor is only
    ever read); at most ``_PATTERNS`` patterns are kept, then the cache starts over."""

    def __init__(self) -> None:
        self._made: dict[tuple[object, ...], torch.Tensor] = {}

    def __call__(
        self, values: Sequence[bool], length: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        pattern = tuple(bool(v) for v in values)
        key = (pattern, length, dtype, device)
        out = self._made.get(key)
        if out is None:
            out = torch.zeros(length, dtype=dtype, device=device)
            start = None
            for i, present in enumerate((*pattern, False)):
                if present and start is None:
                    start = i
                elif not present and start is not None:
                    out[start:i].fill_(1)
                    start = None
            if len(self._made) >= _PATTERNS:
                self._made.clear()
            self._made[key] = out
        return out


def presence_status(counts: torch.Tensor, world: int) -> torch.Tensor:
    """Per unit, from how many of ``world`` ranks had it: 0 none, 1 every rank, 2 mixed."""
    mixed = (counts > 0) & (counts < world)
    out: torch.Tensor = (counts == world).to(torch.uint8) + 2 * mixed.to(torch.uint8)
    return out


def check_presence(
    statuses: torch.Tensor, units: Sequence[int], what: str, names: Callable[[int], str] | None
) -> None:
    """Raise on every rank when a unit was present on some ranks only (``statuses[j]`` is
    unit ``units[j]``'s, see ``presence_status``), with a device-side assert: no host read.
    On CPU the assert raises here, and the units are named (host reads are fine then)."""
    message = (
        f"{what}: ranks of a process group disagree on which parameters have gradients this "
        f"step (present on some ranks, None on others); every rank must step the same "
        f"parameters"
    )
    try:
        torch._assert_async((statuses != 2).all(), message)
    except RuntimeError as exc:
        bad = [units[j] for j, s in enumerate(statuses.tolist()) if s == 2]
        label = [names(i) if names else f"unit {i}" for i in bad]
        raise MixedPresenceError(f"{message} (mixed: {label})") from exc
