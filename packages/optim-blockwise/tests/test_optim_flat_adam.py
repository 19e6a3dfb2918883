"""FlatAdamW / FlatAdam without an engine: torch's Adam(W) bit for bit on plain parameters and on
parameters that are views of one flat storage (``optim_support.flat_views``, what a flat-buffer
engine makes), with torch's param groups and state format; the run grouping they share with
AdamW8bit. On ``fully_shard`` (checkpoints resharded across world sizes included):
``tests/test_integration_flat_adam_engine.py`` at the repository root.

Every comparison is *same arithmetic* (bitwise): both sides run torch's own Adam kernels on the
same gradients with one intra-op thread.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from optim_support import flat_views, local_of, one_thread, random_units
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import optim_blockwise as ob
from optim_blockwise._private.runs import Slot, group_runs
from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics

# matrices and vectors in stretches and alone: with decay on matrices only, the param groups
# alternate along the storage (runs [0 1] [2 3] [4] [5] [6])
SHAPES = [(24, 16), (40, 16), (16,), (16,), (7, 5), (33,), (16, 24)]
CLASSES: dict[str, Any] = {
    "flat": ob.FlatAdamW,
    "torch": torch.optim.AdamW,
    "flat-adam": ob.FlatAdam,
    "torch-adam": torch.optim.Adam,
}


def _groups(params: list[torch.Tensor], split: bool) -> list[dict[str, Any]]:
    """Decay on matrices, none on vectors at twice the lr (or one group)."""
    if not split:
        return [{"params": params}]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 2e-2},
    ]


def _specs(world: int) -> list[tuple[Any, ...]]:
    # element-granular RaggedShard with empty shares allowed: some ranks hold nothing of a tensor
    return [
        ("ragged", tuple(range(len(s))), random_units(int(torch.Size(s).numel()), world, 7 * i))
        for i, s in enumerate(SHAPES)
    ]


def _train(
    mesh: DeviceMesh | None, kind: str, split: bool, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """4 steps on parameters and gradients viewing one flat storage each (a fresh gradient
    storage every step, like an engine's reduce-scatter output); the last parameter's gradient
    missing at step 2 (then it is a step behind the others)."""
    specs = _specs(mesh.size()) if mesh is not None else [("plain",)] * len(SHAPES)
    with one_thread():
        gen = torch.Generator().manual_seed(0)
        fulls = [torch.randn(s, generator=gen) for s in SHAPES]
        params = [nn.Parameter(t) for t in flat_views(fulls, mesh, specs)]
        opt = CLASSES[kind](_groups(params, split), lr=1e-2, **kwargs)
        for step in range(4):
            grads = [torch.randn(s, generator=gen) for s in SHAPES]
            for p, g in zip(params, flat_views(grads, mesh, specs), strict=True):
                p.grad = g
            if step == 2:
                params[-1].grad = None  # skipped: no decay, no state step, as torch
            opt.step()
        # torch.save of the state (DTensors over views of the flat buffers, most at an offset)
        # works and round-trips
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)["state"]
        ordered = [p for group in opt.param_groups for p in group["params"]]  # torch's indices
        for i, p in enumerate(ordered):
            for key, value in opt.state[p].items():
                assert torch.equal(local_of(loaded[i][key]), local_of(value)), (i, key)
        # local pieces (flat): compared outside the ranks' process group
        state = [
            {k: local_of(v.detach()).clone() for k, v in opt.state[p].items() if k != "step"}
            | {"step": opt.state[p]["step"].clone()}
            for p in params
        ]
        return {
            "params": [local_of(p.detach()).clone() for p in params],
            "state": state,
            "runs": getattr(opt, "runs_last_step", None),
        }


def _dist_train(rank: int, world: int, *args: Any) -> dict[str, Any]:
    return _train(init_device_mesh("cpu", (world,)), *args)


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for i, (x, y) in enumerate(zip(a["params"], b["params"], strict=True)):
        assert torch.equal(x, y), f"param {i} of shape {SHAPES[i]}: not bit-identical"
    for i, (x, y) in enumerate(zip(a["state"], b["state"], strict=True)):
        assert sorted(x) == sorted(y), (i, sorted(x), sorted(y))
        for key in y:
            assert x[key].dtype == y[key].dtype, (i, key)
            assert torch.equal(x[key], y[key]), f"param {i} state {key!r}: not bit-identical"


@pytest.mark.parametrize(
    ("ours", "theirs", "kwargs"),
    [
        ("flat", "torch", {}),
        ("flat", "torch", {"amsgrad": True, "foreach": True}),
        ("flat-adam", "torch-adam", {"weight_decay": 0.01}),
    ],
)
def test_flat_storage_equals_torch_on_one_device(
    ours: str, theirs: str, kwargs: dict[str, Any]
) -> None:
    """Views of one storage in two alternating param groups: parameters and every state tensor
    bit-identical to torch's optimizer, in fewer runs than parameters."""
    a = _train(None, ours, True, kwargs)
    b = _train(None, theirs, True, kwargs)
    _assert_same(a, b)
    assert a["runs"] == 5, a["runs"]


@pytest.mark.parametrize("world", [2, 3])
def test_ragged_shards_of_one_storage_equal_torch(world: int) -> None:
    """RaggedShard DTensors whose local pieces view one storage per rank, empty pieces included
    (state as DTensors with the parameters' placements), against torch.optim.AdamW on the same
    DTensors. One param group: every rank steps two runs, the last parameter apart (a step
    behind), empty pieces joining either."""
    ours = run_threaded(_dist_train, world, "flat", False, {}, timeout=120)
    ref = run_threaded(_dist_train, world, "torch", False, {}, timeout=120)
    for a, b in zip(ours, ref, strict=True):
        _assert_same(a, b)
        assert a["runs"] == 2, a["runs"]


def test_state_dict_moves_between_flat_and_torch_adamw() -> None:
    """torch's AdamW format both ways: FlatAdamW's state loads into torch.optim.AdamW and back,
    and all three continue bit-identically."""
    with one_thread():
        gen = torch.Generator().manual_seed(1)
        fulls = [torch.randn(s, generator=gen) for s in SHAPES]
        sides = [
            [nn.Parameter(t) for t in flat_views(fulls, None, [("plain",)] * 7)] for _ in "abc"
        ]
        first = ob.FlatAdamW(_groups(sides[0], True), lr=1e-2)
        data = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(4)]

        def step(params: list[nn.Parameter], opt: torch.optim.Optimizer, grads: Any) -> None:
            for p, g in zip(params, flat_views(grads, None, [("plain",)] * 7), strict=True):
                p.grad = g
            opt.step()

        for grads in data[:2]:
            step(sides[0], first, grads)
        for side in sides[1:]:
            with torch.no_grad():
                for p, q in zip(side, sides[0], strict=True):
                    p.copy_(q)
        torch_opt = torch.optim.AdamW(_groups(sides[1], True), lr=1e-2)
        torch_opt.load_state_dict(copy.deepcopy(first.state_dict()))  # torch loads by reference
        back = ob.FlatAdamW(_groups(sides[2], True), lr=1e-2)
        back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
        for grads in data[2:]:
            for side, opt in zip(sides, (first, torch_opt, back), strict=True):
                step(side, opt, grads)
    for p, q, r in zip(*sides, strict=True):
        assert torch.equal(p, q) and torch.equal(p, r)
        for key, value in torch_opt.state[q].items():
            assert torch.equal(first.state[p][key], value), key
            assert torch.equal(back.state[r][key], value), key


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.up = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.up(self.embed(tokens)))))


def _model_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Decay on matrices, none on norms and biases at twice the lr, the embedding with its own
    lr and betas."""
    decay, no_decay, embed = [], [], []
    for name, p in model.named_parameters():
        (embed if name.startswith("embed") else decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2e-2},
        {"params": embed, "weight_decay": 0.05, "lr": 5e-3, "betas": (0.8, 0.99)},
    ]


@pytest.mark.parametrize("amsgrad", [False, True])
def test_plain_parameters_and_missing_gradients(amsgrad: bool) -> None:
    """Plain parameters (each its own storage: runs of one) with gradients that come and go: a
    parameter without a gradient is skipped (no decay, no state step), like torch; later it
    steps at its own count."""
    torch.manual_seed(0)
    a_model, b_model = _Small(), _Small()
    b_model.load_state_dict(a_model.state_dict())
    a = ob.FlatAdamW(_model_groups(a_model), lr=1e-2, amsgrad=amsgrad)
    b = torch.optim.AdamW(_model_groups(b_model), lr=1e-2, amsgrad=amsgrad)
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        tokens = torch.randint(0, 50, (4, 9), generator=gen)
        for model, opt in ((a_model, a), (b_model, b)):
            logits = model(tokens[:, :-1])
            nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            if step in (1, 2):
                model.up.weight.grad = None
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(a_model.named_parameters(), b_model.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert sorted(a.state[p]) == sorted(b.state[q]), name
        for key in b.state[q]:
            assert torch.equal(a.state[p][key], b.state[q][key]), (name, key)


def test_unsupported_flags_are_refused_by_name() -> None:
    p = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"capturable=True"):
        ob.FlatAdamW([p], capturable=True)
    with pytest.raises(ValueError, match=r"differentiable=True"):
        ob.FlatAdam([p], differentiable=True)


def test_run_grouping_rule() -> None:
    """``group_runs``, the rule FlatAdamW and AdamW8bit share: storage order; a join needs equal
    keys and data and gradient that follow the run's last member with elements; members without
    elements are left out (``skip``) or share the current run (``join``), and a run of them
    takes the next member with its key wherever that member lies."""
    store = torch.zeros(40)
    grads = torch.zeros(40)
    key = (store.untyped_storage().data_ptr(), store.dtype, store.device)

    def slot(offset: int, numel: int) -> Slot:
        return Slot(key, offset, numel, True)

    # members in parameter order; storage order is 1, 0, 2, 3, 4, 5
    spans = [(10, 5), (0, 10), (15, 0), (15, 5), (30, 0), (30, 10)]
    slots = [slot(o, n) for o, n in spans]
    g = [grads[o : o + n] for o, n in spans]
    keys = [0, 0, 0, 0, 1, 1]
    skip = group_runs(slots, g, keys)
    assert [(r.members, r.numel, r.anchor) for r in skip] == [((1, 0, 3), 20, 1), ((5,), 10, 5)]
    join = group_runs(slots, g, keys, empty="join")
    assert [(r.members, r.numel, r.anchor) for r in join] == [
        ((1, 0, 2, 3), 20, 1),
        ((4, 5), 10, 5),  # an empty member with another key starts a run; 5 anchors it
    ]
    moved = [*g[:3], grads[16:21], *g[4:]]  # member 3's gradient no longer follows
    assert [r.members for r in group_runs(slots, moved, keys)] == [(1, 0), (3,), (5,)]
    refused = group_runs(slots, g, keys, may_join=lambda prev, nxt: nxt != 3)
    assert [r.members for r in refused] == [(1, 0), (3,), (5,)]
