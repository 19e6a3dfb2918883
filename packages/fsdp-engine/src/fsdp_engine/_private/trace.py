"""FSDP2's trace, line for line: its debug log lines and its profiler ranges, under FSDP2's names.

[Note: FSDP2's trace]
FSDP2 logs ``FSDP::root_pre_forward``, ``FSDP::pre_forward (<fqn>)``, ``FSDP::post_forward``,
``FSDP::pre_backward``, ``FSDP::post_backward``, ``FSDP::root_post_backward`` and
``FSDP::force_complete_post_forward`` with ``logger.debug`` on the logger
``torch.distributed.fsdp.fully_shard``, and opens ``torch.profiler.record_function`` ranges of
the same names (plus ``FSDP::all_gather``, ``FSDP::post_backward_reduce``, the prefetches and
the casts). torch registers the ``fsdp`` log (``TORCH_LOGS=+fsdp``, or
``torch._logging.set_logs(fsdp=logging.DEBUG)``) for the logger ``torch.distributed.fsdp`` and
its children, so we log on that same logger name: whatever enables FSDP2's lines (the
environment variable, ``set_logs``, a handler or level set on the logger by name) enables ours,
and a tool that parses them reads ours alike (the record's path names our file). A module's
name is its name under the root (``named_modules``, several names joined by ", " for a
``fully_shard([a, b])`` group), known once the root has run its first forward; the root's is
empty and a label then has no suffix (FSDP2's ``_with_fqn``).
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch

from fsdp_engine._private import compat

__all__ = ["logger", "traced", "warning_once", "with_fqn"]

# FSDP2's logger name (``_fsdp_state.py``, ``_fsdp_param_group.py``)
logger = logging.getLogger("torch.distributed.fsdp.fully_shard")


def with_fqn(label: str, fqn: str | None) -> str:
    """``label (<fqn>)``, or ``label`` for the root or before the root's first forward."""
    return f"{label} ({fqn})" if fqn else label


def traced(label: str, *, log: bool = True) -> contextlib.AbstractContextManager[object]:
    """A profiler range named ``label``, after a debug line ``label`` when ``log``.

    Without a profiler running, no range is opened (``record_function`` would cost a dispatcher
    call each way, tens of them per module and step, for a range nobody records)."""
    if log and logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s", label, stacklevel=2)  # the caller, not this helper
    if compat.profiler_enabled():
        return torch.profiler.record_function(label)
    return _NO_RANGE


_NO_RANGE = contextlib.nullcontext()


_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def warning_once(message: str) -> None:
    """``message`` at WARNING on FSDP2's logger, once per process (FSDP2's ``warning_once``;
    ``warning_once.cache_clear()`` forgets what was said)."""
    with _WARNED_LOCK:
        if message in _WARNED:
            return
        _WARNED.add(message)
    logger.warning(message, stacklevel=3)


warning_once.cache_clear = _WARNED.clear  # type: ignore[attr-defined]
