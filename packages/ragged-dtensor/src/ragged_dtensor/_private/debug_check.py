"""The store-based check of the collective debug mode (debug.py, [Note: the check]): the entries
each rank writes, the verdict, and the mismatch and timeout messages naming each rank's caller."""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DEBUG_ENV = "RAGGED_DTENSOR_DEBUG_COLLECTIVES"
_SKIPPED = (str(Path(torch.__file__).resolve().parent), sysconfig.get_paths()["stdlib"])
# this module and debug.py (whose dispatch mode calls the check) are skipped in callers
_HERE = (__file__, os.path.join(os.path.dirname(__file__), "debug.py"))


class CollectiveMismatchError(RuntimeError):
    """Debug mode: the ranks of a process group are not at the same collective (the message
    names the group, each rank's operation and sizes, and the ranks that are elsewhere)."""


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
        if not path.startswith(_SKIPPED) and path not in _HERE and not path.startswith("<"):
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
