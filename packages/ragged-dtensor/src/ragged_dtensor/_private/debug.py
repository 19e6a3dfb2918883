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
import json
import os
import sys
import sysconfig
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

__all__ = [
    "DEBUG_ENV",
    "TIMEOUT_ENV",
    "CollectiveMismatchError",
    "collective_checks_enabled",
    "collective_checks",
    "enter_from_env",
    "exit_env_checks",
]

DEBUG_ENV = "RAGGED_DTENSOR_DEBUG_COLLECTIVES"
TIMEOUT_ENV = "RAGGED_DTENSOR_DEBUG_TIMEOUT"
DEFAULT_TIMEOUT_S = 10.0
_SKIPPED = (str(Path(torch.__file__).resolve().parent), sysconfig.get_paths()["stdlib"])


class CollectiveMismatchError(RuntimeError):
    """Debug mode: the ranks of a process group are not at the same collective (the message
    names the group, each rank's operation and sizes, and the ranks that are elsewhere)."""


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


def _group_of(bound: Mapping[str, Any]) -> dist.ProcessGroup | None:
    if "process_group" in bound:
        return dist.ProcessGroup.unbox(bound["process_group"])
    name = bound.get("group_name")
    if isinstance(name, str):
        resolve = getattr(dist.distributed_c10d, "_resolve_process_group")  # noqa: B009
        group: dist.ProcessGroup = resolve(name)
        return group
    if isinstance(name, torch.ScriptObject):
        return dist.ProcessGroup.unbox(name)
    return None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def _sizes(compared: str | None, bound: Mapping[str, Any]) -> str:
    """What must agree across ranks: the compared argument's shapes and dtypes (``None``: the
    dtypes of every tensor argument)."""
    if compared is None:
        dtypes = sorted(
            {str(t.dtype).removeprefix("torch.") for v in bound.values() for t in _tensors(v)}
        )
        return f"dtypes {', '.join(dtypes)}; sizes may differ"
    if not compared:
        return ""
    shown = [
        f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in _tensors(bound[compared])
    ]
    if len(shown) == 1:
        return shown[0]
    return "[" + ", ".join(shown) + "]"


_OURS = ("ragged_dtensor", "dbuffer", "fsdp_engine", "optim_blockwise", "shard_planner")


def _caller() -> str:
    """Who issued the collective: the innermost and outermost frames in this monorepo's packages
    (torch, the standard library and this module skipped) and the first frame of the user's
    code that called them."""
    frame = sys._getframe(2)
    ours: list[str] = []
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIPPED) and path != __file__ and not path.startswith("<"):
            parts = Path(path).parts
            here = f"{'/'.join(parts[-3:])}:{frame.f_lineno} {frame.f_code.co_name}"
            if not any(package in parts for package in _OURS):
                return f"{_span(ours)} (called from {here})" if ours else here
            ours.append(here)
        frame = frame.f_back  # type: ignore[assignment]
    return _span(ours) if ours else "torch internals"


def _span(frames: Sequence[str]) -> str:
    return frames[0] if len(frames) == 1 else f"{frames[0]} ... {frames[-1]}"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class _Checker:
    """The store-based check of [Note: the check]; one per process."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.steps = 0
        self._lock = threading.Lock()
        self._sequence: dict[str, int] = {}
        self._world: Any = None
        self._generation = 0

    def count_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._lock:
            if dist.is_initialized():
                self._prefix()  # a new process group starts counting from 0
            self.steps += 1

    def _prefix(self) -> str:
        """Keys of this process group generation (a new ``init_process_group``, a torchrun
        restart on a surviving store: a fresh namespace, so stale entries are never read)."""
        world = dist.distributed_c10d._world.default_pg
        if world is not self._world:
            self._world = world
            self._generation += 1
            self._sequence.clear()
            self.steps = 0
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return f"ragged_dtensor/debug/{restart}/{self._generation}"

    def check(self, op: str, compared: str | None, bound: Mapping[str, Any]) -> None:
        group = _group_of(bound)
        if group is None or group.size() <= 1 or not dist.is_initialized():
            return
        with self._lock:
            prefix = self._prefix()
            name = group.group_name
            seq = self._sequence.get(name, 0) + 1
            self._sequence[name] = seq
        entry = {"op": op, "sizes": _sizes(compared, bound), "step": self.steps}
        where = _caller()
        _Check(self, dist.distributed_c10d._get_default_store(), prefix, group, seq).run(
            entry, where
        )


class _Check:
    """One rank's check of one collective (the n-th of its group)."""

    def __init__(
        self, checker: _Checker, store: Any, prefix: str, group: dist.ProcessGroup, seq: int
    ) -> None:
        self.checker = checker
        self.store = store
        self.prefix = prefix
        self.group = group
        self.seq = seq
        self.rank = group.rank()
        self.size = group.size()
        self.ranks = dist.get_process_group_ranks(group)
        self.base = f"{prefix}/{group.group_name}/{seq}"
        self.keys = [f"{self.base}/{k}" for k in range(self.size)]
        self.verdict = f"{self.base}/verdict"

    def _group(self) -> str:
        backend = dist.get_backend(self.group)
        return (
            f"process group {self.group.group_name!r} (global ranks {self.ranks}, {backend}), "
            f"its collective #{self.seq}"
        )

    def run(self, entry: dict[str, Any], where: str) -> None:
        mine = json.dumps({**entry, "where": where}, sort_keys=True)
        me = self.ranks[self.rank]
        seen = f"{entry['op']} on group {self.group.group_name!r} (#{self.seq}) at step " + (
            f"{entry['step']}, from {where}"
        )
        self.store.multi_set([self.keys[self.rank], f"{self.prefix}/where/{me}"], [mine, seen])
        self._wait(entry, where)
        values = [json.loads(_text(v)) for v in self.store.multi_get(self.keys)]
        verdict = _text(self.store.compare_set(self.verdict, "", "go"))
        if verdict != "go":
            raise CollectiveMismatchError(verdict.removeprefix("abort:"))
        agreed = {json.dumps({k: v[k] for k in ("op", "sizes", "step")}) for v in values}
        if len(agreed) > 1:
            raise CollectiveMismatchError(self._mismatch(values))
        if self.seq > 2:  # every rank is past collective seq - 2 (see the module note)
            old = f"{self.prefix}/{self.group.group_name}/{self.seq - 2}"
            self.store.delete_key(f"{old}/{self.rank}")
            if self.rank == 0:
                self.store.delete_key(f"{old}/verdict")

    def _wait(self, entry: dict[str, Any], where: str) -> None:
        """Until every rank's entry is in (one blocking store wait), or the timeout: then the
        verdict is claimed (see the module note)."""
        try:
            self.store.wait(self.keys, timedelta(seconds=self.checker.timeout))
            return
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise
        message = self._timeout(entry, where)
        verdict = _text(self.store.compare_set(self.verdict, "", "abort:" + message))
        if verdict == "go":  # the missing rank arrived just now, and another rank saw everyone
            self.store.wait(self.keys, timedelta(seconds=self.checker.timeout))
            return
        raise CollectiveMismatchError(verdict.removeprefix("abort:"))

    def _mismatch(self, values: Sequence[Mapping[str, Any]]) -> str:
        groups: dict[str, list[int]] = {}
        first: dict[str, Mapping[str, Any]] = {}
        for k, value in enumerate(values):
            key = json.dumps({f: value[f] for f in ("op", "sizes", "step")})
            groups.setdefault(key, []).append(self.ranks[k])
            first.setdefault(key, value)
        lines = [
            f"collective mismatch on {self._group()}: the ranks issued different collectives "
            f"(checked by {DEBUG_ENV}):"
        ]
        for key, ranks in groups.items():
            value = first[key]
            lines.append(f"  ranks {ranks} are at {_describe(value)}, from {value['where']}")
        return "\n".join(lines)

    def _timeout(self, entry: dict[str, Any], where: str) -> str:
        present = [bool(self.store.check([key])) for key in self.keys]
        waiting = [self.ranks[k] for k, p in enumerate(present) if p]
        missing = [self.ranks[k] for k, p in enumerate(present) if not p]
        lines = [
            f"collective timeout on {self._group()}: ranks {waiting} waited "
            f"{self.checker.timeout:g} s at {_describe(entry)} (from {where}) for ranks "
            f"{missing}, which are elsewhere (checked by {DEBUG_ENV}):"
        ]
        for rank in missing:
            key = f"{self.prefix}/where/{rank}"
            last = _text(self.store.get(key)) if self.store.check([key]) else None
            lines.append(
                f"  rank {rank}: last entered {last}"
                if last
                else f"  rank {rank}: has not entered any checked collective yet"
            )
        return "\n".join(lines)


def _describe(value: Mapping[str, Any]) -> str:
    sizes = f"({value['sizes']})" if value["sizes"] else "()"
    return f"{value['op']}{sizes} at step {value['step']}"
