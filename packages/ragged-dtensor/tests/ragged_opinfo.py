"""torch's OpInfo database run on RaggedShard DTensors, with Shard(0) as the control.

Each entry of ``op_db`` (float32, CPU) is run on its first samples with every tensor operand of
one or more dimensions distributed over dim 0 (0-d tensors replicated), under one of:
- ``shard0``: torch's ``Shard(0)`` (the control);
- ``ragged``: ``RaggedShard((0,), units)``, one unit per row, rows as even as they go;
- ``ragged_empty``: the same with rank 0 holding nothing.
The in-place variant of an entry, where it has one, is a separate entry (``name_``).

A sample's outcome, against the op on plain tensors (the single-process reference):
- ``pass``: every output (and, in place, the written operand), gathered, equals the reference
  (random ops: the same shape and dtype), and every ragged output's local tensor is its flat
  share;
- ``error``: a clear error, raised on every rank: ``RaggedOpError``, ``NotImplementedError``,
  or torch's DTensor naming the op (``Sharding propagation failed for aten...`` with the
  placements, ``... not supported with DTensor``, ``aten... got mixed torch.Tensor and
  DTensor``);
- ``wrong``: a result that differs from the reference;
- ``crash``: any other exception, a rank that did not finish, or ranks that disagree.
An entry is ``pass`` (every sample passes), ``partial`` (some pass, the others are clear
errors), ``error`` (every sample a clear error), ``wrong`` (any sample wrong) or ``crash``
(any sample crashes, none wrong). Samples the reference itself rejects are not counted.

Tolerance: outputs are compared with ``rtol = atol = 1e-4``. A redistributed op computes what
one process computes (bitwise); a ragged reduction combines per-rank partial sums in another
order, whose float32 error is at most n * eps * sum|x| (eps = 1.2e-7) for n <= a few hundred
elements per reduced slice in these samples (< 1e-4 relative); p-norms and means are no
worse. Ill-conditioned linear algebra of a ``Shard(0)`` control that runs in another order may
exceed it; it is counted as torch's, not ours.

Run as a script to print the table (``python ragged_opinfo.py --world 2``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import hashlib
import json
import logging
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
from torch.distributed.tensor import distribute_tensor as torch_distribute
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ragged_dtensor import RaggedOpError, RaggedShard, distribute_tensor, local_range
from ragged_dtensor.testing import DistributedFailure, run_threaded

PLACEMENTS = ("shard0", "ragged", "ragged_empty")
OUTCOMES = ("pass", "partial", "error", "wrong", "crash")
MAX_SAMPLES = 5
RTOL = ATOL = 1e-4

# The ops of a training step (forward, backward, optimizer), by OpInfo name: every one must
# pass on RaggedShard.
COMMON_TRAINING = (
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "pow",
    "abs",
    "clamp",
    "where",
    "lerp",
    "addcmul",
    "addcdiv",
    "sigmoid",
    "tanh",
    "nn.functional.relu",
    "nn.functional.gelu",
    "nn.functional.silu",
    "sum",
    "mean",
    "var",
    "std",
    "amax",
    "linalg.vector_norm",
    "norm",
    "mm",
    "matmul",
    "addmm",
    "bmm",
    "nn.functional.linear",
    "softmax",
    "log_softmax",
    "nn.functional.layer_norm",
    "nn.functional.rms_norm",
    "nn.functional.cross_entropy",
    "nn.functional.mse_loss",
    "nn.functional.embedding",
    "cat",
    "stack",
    "transpose",
    "t",
    "reshape",
    "view",
    "flatten",
    "clone",
    "zeros_like",
    "ones_like",
    "_foreach_add",
    "_foreach_mul",
    "_foreach_div",
    "_foreach_sqrt",
    "_foreach_lerp",
    "_foreach_addcmul",
    "_foreach_addcdiv",
    "_foreach_norm",
    "_foreach_maximum",
    "_foreach_sub",
    "_foreach_neg",
)


# Random ops (these names, and any sample whose reference call runs an op tagged
# ``nondeterministic_seeded``),
# compared by shape and dtype only: some OpInfos seed the generator inside the call (so one
# process repeats its draw), but the threaded ranks share one generator and draw in turns.
# (Ragged random fills draw what one device draws: test_ragged_rowwise_random.py.)
# Ops whose values are uninitialized memory: compared by shape and dtype, as random ops are
# (running the reference twice can give the same garbage by chance).
UNINITIALIZED_NAMES = (
    "empty",
    "empty_like",
    "empty_strided",
    "empty_permuted",
    "new_empty",
    "new_empty_strided",
)
RANDOM_NAMES = (
    "bernoulli",
    "cauchy",
    "exponential",
    "geometric",
    "log_normal",
    "multinomial",
    "normal",
    "uniform",
    "rand",
    "randn",
    "randint",
    "nn.functional.dropout",
    "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout",
    "nn.functional.rrelu",
    "nn.functional.fractional_max_pool",
)


def opinfo_entries() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]


def entry_name(op: Any, inplace: bool = False) -> str:
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    return name + ("_" if inplace else "")


def deterministic_sample(entries: Sequence[Any], k: int, must: Iterable[str]) -> list[Any]:
    """The entries named in ``must`` plus ``k`` others chosen by a hash of their names (the
    same every run, spread over the database)."""
    wanted = set(must)
    chosen = [op for op in entries if op.name in wanted]
    rest = sorted(
        (op for op in entries if op.name not in wanted),
        key=lambda op: hashlib.sha256(entry_name(op).encode()).hexdigest(),
    )
    return chosen + rest[:k]


# -- samples ---------------------------------------------------------------------------------


class Case:
    """One sample of one entry: plain arguments, and the reference outputs."""

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], inplace: bool
    ) -> None:
        self.fn, self.args, self.kwargs, self.inplace = fn, args, kwargs, inplace
        self.want: Any = None
        self.random = False


class _SeededOps(TorchDispatchMode):
    """Notes whether any op tagged ``nondeterministic_seeded`` (a random op) runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen = True
        return func(*args, **(kwargs or {}))


def _run_reference(case: Case, seed: int) -> Any:
    torch.manual_seed(seed)
    args, kwargs = copy.deepcopy((case.args, case.kwargs))
    with _SeededOps() as mode:
        out = case.fn(*args, **kwargs)
    case.random |= mode.seen  # some OpInfos seed the generator inside the call
    return (out, args[0]) if case.inplace else out


def _same(a: Any, b: Any) -> bool:
    try:
        _compare(a, b)
    except AssertionError:
        return False
    return True


def build_cases(op: Any, inplace: bool) -> list[Case]:
    fn = op.inplace_variant if inplace else op.op
    if fn is None:
        return []
    cases: list[Case] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
        except Exception:
            return []
        for sample in samples[:MAX_SAMPLES]:
            case = Case(fn, (sample.input, *sample.args), dict(sample.kwargs), inplace)
            if inplace and not isinstance(sample.input, torch.Tensor | list):
                continue
            if not any(
                isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[0] > 0
                for t in pytree.tree_leaves((case.args, case.kwargs))
            ):
                continue  # nothing to distribute: every operand would be replicated
            try:
                case.want = _run_reference(case, 0)
                again = _run_reference(case, 1)
            except Exception:
                continue  # the reference rejects it: not counted
            case.random |= (
                op.name.startswith(RANDOM_NAMES)
                or op.name in UNINITIALIZED_NAMES
                or not _same(case.want, again)
            )
            cases.append(case)
    return cases


# -- distributing ----------------------------------------------------------------------------


def _units(rows: int, world: int, empty_first: bool) -> tuple[int, ...]:
    holders = world - 1 if empty_first and world > 1 else world
    base, extra = divmod(rows, holders)
    units = [base + (1 if k < extra else 0) for k in range(holders)]
    return (0, *units) if holders < world else tuple(units)


def _distribute(t: torch.Tensor, mesh: Any, kind: str) -> Any:
    world = mesh.size(0)
    if t.ndim == 0 or t.shape[0] == 0:
        return torch_distribute(t, mesh, [Replicate()])
    if kind == "shard0":
        return torch_distribute(t, mesh, [Shard(0)])
    units = _units(t.shape[0], world, kind == "ragged_empty")
    return distribute_tensor(t, mesh, [RaggedShard((0,), units)])


def _to_dtensors(value: Any, mesh: Any, kind: str) -> Any:
    return pytree.tree_map(
        lambda v: _distribute(v.clone(), mesh, kind) if isinstance(v, torch.Tensor) else v,
        value,
    )


def _gather(value: Any) -> Any:
    return pytree.tree_map(lambda v: v.full_tensor() if isinstance(v, DTensor) else v, value)


def _compare(got: Any, want: Any, shapes_only: bool = False) -> None:
    got_leaves, got_tree = pytree.tree_flatten(got)
    want_leaves, want_tree = pytree.tree_flatten(want)
    if got_tree != want_tree:
        raise AssertionError(f"structure {got_tree} != {want_tree}")
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                raise AssertionError(f"{type(g)} for a tensor")
            if g.shape != w.shape or g.dtype != w.dtype:
                raise AssertionError(f"{g.shape} {g.dtype} != {w.shape} {w.dtype}")
            if not shapes_only:
                torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, equal_nan=True)
        elif not shapes_only and g != w and not (_is_nan(g) and _is_nan(w)):
            raise AssertionError(f"{g!r} != {w!r}")


def _is_nan(value: object) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _is_clear(exc: BaseException) -> bool:
    """An error that names the op (and DTensor's placements): ours, torch's "no sharding
    strategy", or torch's own DTensor refusals."""
    if isinstance(exc, RaggedOpError | NotImplementedError):
        return True
    text = str(exc)
    return any(
        clear in text
        for clear in (
            "Sharding propagation failed for aten.",
            "not supported with DTensor",
            "got mixed torch.Tensor and DTensor",
        )
    )


def _run_sample(rank: int, world: int, case: Case, kind: str) -> tuple[str, str]:
    mesh = init_device_mesh("cpu", (world,))
    try:
        args, kwargs = _to_dtensors((case.args, case.kwargs), mesh, kind)
    except Exception as exc:  # a layout torch cannot make: not counted
        return "skip", repr(exc)[:200]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = case.fn(*args, **kwargs)
            got = _gather((out, args[0]) if case.inplace else out)
    except Exception as exc:
        return ("error" if _is_clear(exc) else "crash"), f"{type(exc).__name__}: {exc}"[:300]
    try:
        _check_flat((out, args[0]) if case.inplace else out)
        _compare(got, case.want, shapes_only=case.random)
    except AssertionError as exc:
        return "wrong", str(exc)[:300]
    return "pass", ""


def _check_flat(value: Any) -> None:
    """A ragged DTensor's local tensor is its flat share: 1-D, of its range's size."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, DTensor) and any(isinstance(p, RaggedShard) for p in leaf.placements):
            flat = local_range(leaf)
            local = leaf.to_local()
            if local.ndim != 1 or local.numel() != flat.numel:
                raise AssertionError(
                    f"ragged local tensor of shape {tuple(local.shape)} for the range {flat}"
                )


def run_case(case: Case, kind: str, world: int, timeout: float = 30.0) -> tuple[str, str]:
    """A sample's outcome on ``world`` threaded ranks (the worst rank's)."""
    try:
        results = run_threaded(_run_sample, world, case, kind, timeout=timeout)
    except DistributedFailure as exc:
        return "crash", str(exc).strip().splitlines()[-1][:300]
    if any(r[0] == "skip" for r in results):
        return "skip", results[0][1]
    order = ("crash", "wrong", "error", "pass")
    outcome = min((r[0] for r in results), key=order.index)
    if len({r[0] for r in results}) > 1 and outcome == "error":
        outcome = "crash"  # ranks disagree: one raised, another went on
    detail = next(r[1] for r in results if r[0] == outcome) if outcome != "pass" else ""
    return outcome, detail


def entry_outcome(samples: Sequence[str]) -> str | None:
    counted = [s for s in samples if s != "skip"]
    if not counted:
        return None
    for bad in ("wrong", "crash"):
        if bad in counted:
            return bad
    if all(s == "pass" for s in counted):
        return "pass"
    return "partial" if "pass" in counted else "error"


def run_entries(
    entries: Sequence[Any],
    world: int,
    kinds: Sequence[str] = PLACEMENTS,
    progress: Callable[[str, dict[str, tuple[str, str]]], None] | None = None,
    inplace: bool = True,
) -> dict[str, dict[str, tuple[str, str]]]:
    """entry name -> placement kind -> (outcome, first detail); the in-place variants too
    unless ``inplace=False``."""
    table: dict[str, dict[str, tuple[str, str]]] = {}
    for op in entries:
        for variant in (False, True) if inplace else (False,):
            cases = build_cases(op, variant)
            if not cases:
                continue
            row: dict[str, tuple[str, str]] = {}
            for kind in kinds:
                results = [run_case(c, kind, world) for c in cases]
                outcome = entry_outcome([r[0] for r in results])
                if outcome is None:
                    continue
                detail = next((d for o, d in results if o not in ("pass", "skip")), "")
                row[kind] = (outcome, detail)
            if row:
                table[entry_name(op, variant)] = row
                if progress is not None:
                    progress(entry_name(op, variant), row)
    return table


def summarize(table: dict[str, dict[str, tuple[str, str]]]) -> dict[str, collections.Counter[str]]:
    counts: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in PLACEMENTS}
    for row in table.values():
        for kind, (outcome, _) in row.items():
            counts[kind][outcome] += 1
    return counts


def markdown(table: dict[str, dict[str, tuple[str, str]]], world: int) -> str:
    counts = summarize(table)
    names = {
        "shard0": "`Shard(0)`",
        "ragged": "`RaggedShard` (even)",
        "ragged_empty": "`RaggedShard` (rank 0 empty)",
    }
    lines = [
        f"| placement ({world} ranks, {len(table)} entries) | " + " | ".join(OUTCOMES) + " |",
        "|---|" + "---:|" * len(OUTCOMES),
    ]
    for kind in PLACEMENTS:
        if counts[kind]:
            lines.append(
                f"| {names[kind]} | " + " | ".join(str(counts[kind][o]) for o in OUTCOMES) + " |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--details", action="store_true")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--stop", type=int, default=None)
    parser.add_argument("--json", help="also write the table to this file")
    parser.add_argument("--merge", nargs="*", default=[], help="print the table of these files")
    ns = parser.parse_args()
    if ns.merge:  # later files' rows replace earlier ones'
        merged: dict[str, dict[str, tuple[str, str]]] = {}
        for path in ns.merge:
            with open(path) as fh:
                merged.update(
                    {k: {q: tuple(v) for q, v in r.items()} for k, r in json.load(fh).items()}
                )
        print(markdown(merged, ns.world))
        return
    entries = opinfo_entries()[ns.start : ns.stop]
    if ns.only:
        entries = [op for op in entries if op.name in ns.only]

    def progress(name: str, row: dict[str, tuple[str, str]]) -> None:
        cells = " ".join(f"{k}={o}" for k, (o, _) in row.items())
        print(f"# {name} {cells}", file=sys.stderr, flush=True)

    logging.disable(logging.WARNING)
    table = run_entries(entries, ns.world, progress=progress)
    if ns.json:
        with open(ns.json, "w") as fh:
            json.dump(table, fh, indent=0)
    print(markdown(table, ns.world))
    if ns.details:
        for name, row in sorted(table.items()):
            for kind, (outcome, detail) in row.items():
                shown = (
                    ("wrong", "crash")
                    if kind == "shard0"
                    else ("partial", "error", "wrong", "crash")
                )
                if outcome in shown:
                    print(f"{name:40s} {kind:13s} {outcome:8s} {detail[:160]}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
