"""``.item()`` of a Partial DTensor reads the tensor's value, not this rank's partial value.

torch 2.13 runs ``aten._local_scalar_dense`` on the local tensor without propagation, so
``x.norm(2).item()`` of a ragged share gave each rank its share's norm; Adafactor takes its step
size from exactly that and its parameters differed from one process's by ~5e-3 with no error.
Values are compared with plain torch: sums and norms of 7 / 30 fp32 terms within rtol 1e-5
(summation order only); Adafactor after two steps within atol 1e-6 (a few eps of the ~1 values).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, init_device_mesh

from ragged_dtensor import RaggedShard, distribute_tensor
from ragged_dtensor.testing import run_threaded

X = torch.linspace(-2.0, 3.0, 30).reshape(5, 6).sin() * 2


def _reads(rank: int, world: int) -> list[float]:
    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(X.clone(), mesh, [RaggedShard((0, 1), (13, 17))])
    n = x.norm(2)
    assert n.placements[0].is_partial()
    return [n.item(), float(x.sum()), x.flatten()[:7].norm(3).item(), x.abs().max().item()]


def test_item_of_a_partial_is_the_full_value_on_every_rank() -> None:
    want = [X.norm(2).item(), X.sum().item(), X.flatten()[:7].norm(3).item(), X.abs().max().item()]
    for got in run_threaded(_reads, 2, timeout=120):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


SHAPES = [(5, 6), (7,), (3, 4)]
LAYOUTS = [((0,), (2, 3)), ((0,), (3, 4)), ((0, 1), (5, 7))]  # rows cut, a vector, a flat cut


def _data() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(2)]
    return params, grads


def _adafactor(params: list[torch.Tensor], wrap: Any) -> list[torch.Tensor]:
    _, grads = _data()
    opt = torch.optim.Adafactor(params, lr=1e-2, foreach=False)
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = wrap(g, p)
        opt.step()
    return [p.detach().full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]


def _sharded_adafactor(rank: int, world: int) -> list[torch.Tensor]:
    mesh = init_device_mesh("cpu", (world,))
    full, _ = _data()
    params = [
        torch.nn.Parameter(distribute_tensor(v, mesh, [RaggedShard(*lay)]))
        for v, lay in zip(full, LAYOUTS, strict=True)
    ]
    return _adafactor(params, lambda g, p: distribute_tensor(g, mesh, p.placements))


def test_adafactor_over_ragged_shares_equals_one_process() -> None:
    full, _ = _data()
    want = _adafactor([torch.nn.Parameter(v) for v in full], lambda g, p: g)
    for got in run_threaded(_sharded_adafactor, 2, timeout=120):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
