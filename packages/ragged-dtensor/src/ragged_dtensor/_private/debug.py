"""Collective debug mode: before each collective, check that every rank is at the same one.

[Note: where the check sits]
Ranks that issue different collectives, or the same ones in another order, hang until the
process group's timeout (30 min for gloo, NCCL the same or forever) or abort the process (gloo's
"Is there a distributed collective mismatch"). Who issues them varies: ``torch.distributed``
calls of every package (all-gathers, reduce-scatters, object collectives of checkpoints), and
DTensor's functional collectives (``full_tensor``, ``clip_grad_norm_``, redistributions), many
of them issued while DTensor lowers an op in its ``__torch_dispatch__``, below the autograd key.
Every one of them reaches the dispatcher as a ``c10d::*`` op (``torch.distributed.all_reduce``
-> ``ProcessGroup.allreduce`` -> ``c10d::allreduce_``) or a ``_c10d_functional::*`` op. So the
debug mode pushes a ``TorchDispatchMode`` while it is on: it sees every op dispatched (it lets
DTensor lower its ops first, so DTensor's plain-tensor collectives come back to it) and runs the
check before each collective op. One place sees every collective, whoever issued it; it costs
one Python call per dispatched op, and nothing at all (no mode, no collective) unless it is on.

[Note: when it is on]
Never at import. ``with collective_checks():`` turns it on for a block. With
``RAGGED_DTENSOR_DEBUG_COLLECTIVES=1`` it is turned on when the DTensor integration is installed
(the first ``RaggedShard`` constructed, or ``install_dtensor_integration()``), on that thread,
and off when the integration is removed. If another dispatch mode is active on that thread at
that moment, entering would break that mode's exit (modes are a stack), so a ``RuntimeWarning``
says the checks were not entered and names the mode.

[Note: the check]
The check must not be a collective itself (it would be paired with whatever the other ranks
issue next), so it goes through the process group's key-value store. For the n-th collective of
a process group, each rank writes ``(op, sizes, step)`` under ``<group>/<n>/<rank>`` and waits
for the others' entries (bounded by ``RAGGED_DTENSOR_DEBUG_TIMEOUT``, default 10 s):

- all entries equal: every rank claims the verdict "go" for ``<group>/<n>`` (an atomic
  compare-and-set) and enters the collective;
- entries differ: every rank sees the same entries and raises the same
  ``CollectiveMismatchError``, naming the group, each rank's operation, sizes, step and caller;
- a rank still missing at the timeout: the waiting rank claims the verdict "abort" (unless a
  rank claimed "go" first: then the late rank did arrive) and raises naming the ranks that are
  elsewhere and the last collective each of them entered; a late rank reads "abort" and raises
  too; a rank waiting at another group's collective for a rank that raised times out there.

So every rank raises within about two timeouts, before any mismatched collective runs. ``step``
is the number of ``torch.optim`` steps this process took since the process group was made (a
global optimizer hook), so a rank
that runs ahead or behind by a step is caught even when the collectives look alike.

Limits: the mode lives on the thread that turned it on (and the autograd threads its backward
passes run on); collectives issued from other threads are not checked. torch's
threaded test process group is Python and bypasses the dispatcher. Point-to-point
``send``/``recv`` are not checked (they pair explicitly). Not for ``torch.compile``d code.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from ragged_dtensor._private.debug_check import DEBUG_ENV, CollectiveMismatchError, _Checker

__all__ = [
    "DEBUG_ENV",
    "TIMEOUT_ENV",
    "CollectiveMismatchError",
    "collective_checks_enabled",
    "collective_checks",
    "enter_from_env",
    "exit_env_checks",
]

TIMEOUT_ENV = "RAGGED_DTENSOR_DEBUG_TIMEOUT"
DEFAULT_TIMEOUT_S = 10.0


# The collective ops: ``name -> (what users call it, the argument whose shapes must agree)``;
# ``None``: sizes may differ per rank (all-to-all splits), dtypes are compared.
_C10D_OPS: dict[str, tuple[str, str | None]] = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce_coalesced", "tensors"),
    "allgather_": ("all_gather", "input_tensors"),
    "_allgather_base_": ("all_gather_into_tensor", "input_tensor"),
    "allgather_coalesced_": ("all_gather_coalesced", "input_list"),
    "allgather_into_tensor_coalesced_": ("all_gather_into_tensor_coalesced", "inputs"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "_reduce_scatter_base_": ("reduce_scatter_tensor", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor_coalesced", "inputs"),
    "broadcast_": ("broadcast", "tensors"),
    "reduce_": ("reduce", "tensors"),
    "gather_": ("gather", "input_tensors"),
    "scatter_": ("scatter", "output_tensors"),
    "alltoall_": ("all_to_all", None),
    "alltoall_base_": ("all_to_all_single", None),
    "barrier": ("barrier", ""),
}
_FUNCTIONAL_OPS: dict[str, tuple[str, str | None]] = {
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce_coalesced", "inputs"),
    "all_reduce_coalesced_": ("all_reduce_coalesced", "inputs"),
    "all_gather_into_tensor": ("all_gather_into_tensor", "input"),
    "all_gather_into_tensor_out": ("all_gather_into_tensor", "input"),
    "all_gather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", "inputs"),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", "inputs"),
    "all_to_all_single": ("all_to_all_single", None),
    "broadcast": ("broadcast", "input"),
    "broadcast_": ("broadcast", "input"),
}

_FUNCTIONAL_AUTOGRAD_OPS: dict[str, tuple[str, str | None]] = {
    "all_gather_into_tensor": ("all_gather_into_tensor", "input"),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", "input"),
    "all_to_all_single": ("all_to_all_single", None),
}


class _Active:
    """The checks in force: their checker, dispatch mode, optimizer hook and thread."""

    def __init__(self, timeout: float, source: str) -> None:
        self.checker = _Checker(timeout)
        self.source = source
        self.thread = threading.current_thread()
        ops: dict[Any, tuple[str, str | None, list[str]]] = {}
        for namespace, table in (
            ("c10d", _C10D_OPS),
            ("_c10d_functional", _FUNCTIONAL_OPS),
            ("_c10d_functional_autograd", _FUNCTIONAL_AUTOGRAD_OPS),
        ):
            for name, (display, compared) in table.items():
                op = _op(namespace, name)
                if op is not None:
                    ops[op] = (display, compared, [a.name for a in op._schema.arguments])
        self.mode = _CheckMode(self.checker, ops)
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.hook = register_optimizer_step_post_hook(self.checker.count_step)
        # this thread and the autograd threads, which inherit the dispatch-mode state of the
        # thread calling backward
        self.mode.__enter__()  # type: ignore[no-untyped-call]

    def exit(self) -> None:
        if threading.current_thread() is not self.thread and not self.thread.is_alive():
            self.hook.remove()  # the mode ended with its thread (its mode stack was per thread)
            return
        if threading.current_thread() is not self.thread:
            raise RuntimeError(
                f"ragged_dtensor: the collective checks were entered on thread "
                f"{self.thread.name!r}; leave them (or remove the DTensor integration that "
                f"entered them) on that thread, not on {threading.current_thread().name!r}"
            )
        top = _get_current_dispatch_mode()
        if top is not self.mode:
            raise RuntimeError(
                f"ragged_dtensor: cannot leave the collective checks: another dispatch mode "
                f"({top!r}) was entered after them and is still active; leave it first"
            )
        self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        self.hook.remove()


_active: _Active | None = None
_active_lock = threading.Lock()


def collective_checks_enabled() -> bool:
    """Whether the collective debug mode is on (``collective_checks()``, or
    ``RAGGED_DTENSOR_DEBUG_COLLECTIVES=1`` when the DTensor integration was installed)."""
    return _active is not None


def _env_requested() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _env_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        timeout = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds") from None
    if timeout <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return timeout


def enter_from_env() -> bool:
    """Enter the checks on this thread if the environment asks for them (the DTensor integration
    calls this when it is installed). True if they were entered here."""
    global _active
    if not _env_requested():
        return False
    timeout = _env_timeout()
    with _active_lock:
        if _active is not None:
            return False
        current = _get_current_dispatch_mode()
        if current is not None:
            # entering under another mode would pop that mode when it exits (modes are a stack)
            warnings.warn(
                f"{DEBUG_ENV}=1: the collective checks were not entered, because the DTensor "
                f"integration was installed while the dispatch mode {current!r} was active; "
                f"use `with ragged_dtensor.collective_checks():` around the code to check",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        _active = _Active(timeout, "env")
        return True


def exit_env_checks() -> None:
    """Leave the checks ``enter_from_env`` entered (the integration calls this on removal)."""
    global _active
    with _active_lock:
        if _active is None or _active.source != "env":
            return
        _active.exit()
        _active = None


@contextlib.contextmanager
def collective_checks(timeout: float | None = None) -> Iterator[None]:
    """Check, before every collective this thread issues in the block (and its autograd threads),
    that every rank of the process group is at the same collective (see the module note);
    ``timeout`` seconds to wait for the other ranks (default ``RAGGED_DTENSOR_DEBUG_TIMEOUT``,
    else 10). Nested or already on: the block runs under the checks in force."""
    global _active
    if timeout is not None and not timeout > 0:
        raise ValueError(f"collective_checks(timeout={timeout!r}): expected a positive number")
    with _active_lock:
        if _active is not None:
            entered = None
        else:
            entered = _active = _Active(timeout if timeout is not None else _env_timeout(), "call")
    try:
        yield
    finally:
        if entered is not None:
            with _active_lock:
                entered.exit()
                _active = None


def _op(namespace: str, name: str) -> Any:
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):  # not in this torch build
        return None


class _CheckMode(TorchDispatchMode):
    """Sees every op dispatched on this thread, including those DTensor issues while it lowers
    an op (subclasses are let through first, so their plain-tensor ops come back here); runs
    the check before each collective."""

    def __init__(
        self, checker: _Checker, ops: Mapping[Any, tuple[str, str | None, list[str]]]
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.checker = checker
        self.ops = ops

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor lowers it to plain-tensor ops first
        spec = self.ops.get(func)
        if spec is not None:
            display, compared, names = spec
            bound = dict(zip(names, args, strict=False))
            bound.update(kwargs)
            self.checker.check(display, compared, bound)
        return func(*args, **kwargs)
