"""Kernel launches per optimizer step, counted at the dispatcher on CPU: ours against torch's.

Every aten op that reaches the dispatcher during one ``opt.step()`` (after two warm-up steps) is
counted with a ``TorchDispatchMode``. A foreach op counts once: on CUDA it is one multi-tensor
launch per ~chunk of tensors, on CPU its per-tensor loop runs below the mode. This is how
launches are measured without a GPU: on CUDA each counted op is (at least) one kernel launch.

Two tables (markdown on stdout, ``--json PATH`` for the numbers):

1. A 32-layer model's parameters (per layer: q, k, v, o ``d x d``, up ``d x 4d``, down
   ``4d x d``, two norms ``d``), laid out as ``fully_shard`` lays out a group: every layer's
   parameters (and gradients) views of one flat storage. ``torch.optim.AdamW(foreach=True)``
   against ours.
2. One group (one flat storage) of ``P`` parameters, ``P`` in 8, 32, 128: launches per step must
   not grow with ``P``. Muon's Newton-Schulz runs per matrix (each matrix needs its own), so
   its launches are split into NS and the rest; the rest is the part foreach serves.

Run from the repository root: ``python benchmarks/bench_launches.py`` (about 20 s on one CPU).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import optim_blockwise as ob
from optim_blockwise._private import muon_update

D = 64  # model width: small (the counts do not depend on it), one AdamW8bit block per norm
_NO_KERNEL = {
    # metadata-only ops and allocations: no kernel is launched for them
    "view",
    "_unsafe_view",
    "alias",
    "as_strided",
    "detach",
    "slice",
    "select",
    "narrow",
    "unsqueeze",
    "squeeze",
    "expand",
    "t",
    "transpose",
    "permute",
    "split",
    "split_with_sizes",
    "unbind",
    "_reshape_alias",
    "diagonal",
    "empty",
    "empty_strided",
    "empty_like",
    "_record_function_enter_new",
    "_record_function_exit",
}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.in_ns = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if name not in _NO_KERNEL:
            self.ops["ns" if self.in_ns else "rest"] += 1
        return func(*args, **(kwargs or {}))


def _flat_params(shapes: list[tuple[int, ...]], gen: torch.Generator) -> list[torch.nn.Parameter]:
    """Parameters and gradients as views of one flat storage each (a ``fully_shard`` group)."""
    total = sum(torch.Size(s).numel() for s in shapes)
    flat = torch.randn(total, generator=gen)
    flat_grad = torch.zeros(total)
    out, at = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        p = torch.nn.Parameter(flat[at : at + n].view(s))
        p.grad = flat_grad[at : at + n].view(s)
        out.append(p)
        at += n
    return out


def _layer_shapes() -> list[tuple[int, ...]]:
    return [(D, D)] * 4 + [(D, 4 * D), (4 * D, D), (D,), (D,)]


OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "torch AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "torch AdamW (for-loop)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    "ours FlatAdamW": lambda ps: ob.FlatAdamW(ps, lr=1e-3),
    "ours AdamW8bit": lambda ps: ob.AdamW8bit(ps, lr=1e-3, block_size=64, min_8bit_size=0),
    "ours Muon (+ AdamW path)": lambda ps: ob.Muon(ps, lr=0.02, ns_dtype=torch.float32),
}


def _launches(
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    groups: list[list[tuple[int, ...]]],
) -> dict[str, int]:
    gen = torch.Generator().manual_seed(0)
    params = [p for shapes in groups for p in _flat_params(shapes, gen)]
    opt = make(params)
    for _ in range(2):
        for p in params:
            assert p.grad is not None
            p.grad.copy_(torch.randn(p.shape, generator=gen))
        opt.step()
    counter = _Count()
    ns = muon_update.newton_schulz

    def counted_ns(*args: Any, **kwargs: Any) -> torch.Tensor:
        counter.in_ns = True
        try:
            return ns(*args, **kwargs)
        finally:
            counter.in_ns = False

    muon_update.newton_schulz = counted_ns  # type: ignore[assignment]
    try:
        with counter:
            opt.step()
    finally:
        muon_update.newton_schulz = ns
    return {
        "total": sum(counter.ops.values()),
        "ns": counter.ops["ns"],
        "rest": counter.ops["rest"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--json", default=None, help="write the counts as JSON here")
    parser.add_argument("--out", default=None, help="a folder: writes launches.json there")
    args, _ = parser.parse_known_args()  # nox -s bench passes its posargs to every benchmark
    if args.out and not args.json:
        os.makedirs(args.out, exist_ok=True)
        args.json = os.path.join(args.out, "launches.json")
    model = [_layer_shapes() for _ in range(args.layers)]
    n_params = sum(len(g) for g in model)
    results: dict[str, Any] = {"layers": args.layers, "params": n_params, "model": {}, "group": {}}
    print(f"Launches per step (dispatched aten ops), {args.layers}-layer model, {n_params} params")
    print("(every layer one flat storage, as fully_shard lays out a group):\n")
    print("| optimizer | launches / step | of which Newton-Schulz | per parameter |")
    print("|---|---|---|---|")
    for name, make in OPTIMIZERS.items():
        got = _launches(make, model)
        results["model"][name] = got
        print(f"| {name} | {got['total']} | {got['ns']} | {got['total'] / n_params:.2f} |")
    sizes = (8, 32, 128)
    print("\nOne group (one flat storage) of P parameters (half d x d matrices, half norms):\n")
    print("| optimizer | " + " | ".join(f"P = {p}" for p in sizes) + " | grows with P |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for name, make in OPTIMIZERS.items():
        row = []
        for p in sizes:
            got = _launches(make, [[(D, D), (D,)] * (p // 2)])
            row.append(got)
            results["group"].setdefault(name, {})[p] = got
        rest = [r["rest"] for r in row]
        cells = [f"{r['rest']}" + (f" + {r['ns']} NS" if r["ns"] else "") for r in row]
        print(f"| {name} | " + " | ".join(cells) + f" | {'yes' if rest[-1] > rest[0] else 'no'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
