"""Shared helpers for optim-blockwise tests: build sharded params, run N steps, slice references.

No tests here; module-level functions so that spawned gloo processes can import them by name.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import optim_blockwise as ob
from ragged_dtensor import RaggedShard

DEVICE_TYPE = "cpu"  # tests run on the CPU process groups (gloo / threaded)

UNALIGNED = "ignore:AdamW8bit. parameter .* is sharded with a rank boundary:UserWarning"
"""``filterwarnings`` for tests that shard on purpose without AdamW8bit's block policy: the
construction-time warning about it is expected there (and tested in the agreement tests)."""

# A sharding spec (picklable): ("ragged", dims, units) | ("chunk",) | ("plain",)
Spec = tuple[Any, ...]


def random_units(total: int, world: int, seed: int, allow_zero: bool = True) -> tuple[int, ...]:
    """A random composition of ``total`` into ``world`` parts (zeros allowed)."""
    rng = random.Random(seed)
    while True:
        cuts = sorted(rng.randint(0, total) for _ in range(world - 1))
        parts = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
        if allow_zero or all(parts):
            return tuple(parts)


def ragged_spec(shape: tuple[int, ...], world: int, unit: int, seed: int) -> Spec:
    """RaggedShard over all dims (element granularity) with units of ``unit`` elements."""
    numel = math.prod(shape)
    assert numel % unit == 0
    return ("ragged", tuple(range(len(shape))), random_units(numel // unit, world, seed))


def shard(full: torch.Tensor, mesh: DeviceMesh | None, spec: Spec) -> torch.Tensor:
    """This rank's tensor for ``full`` under ``spec`` (a DTensor, or ``full`` itself)."""
    if spec[0] == "plain" or mesh is None:
        return full.clone()
    if spec[0] == "chunk":
        return distribute_tensor(full, mesh, [Shard(0)])
    _, dims, units = spec
    placement = RaggedShard(dims, units)
    r = placement.flat_range(full.shape, mesh.get_local_rank(0))
    local = full.reshape(-1)[r.start : r.stop].clone()
    return DTensor.from_local(
        local, mesh, [placement], shape=full.shape, stride=full.stride(), run_check=False
    )


def local_of(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).reshape(-1)


def make_optimizer(kind: str, params: list[Any], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    if kind == "adamw8bit":
        return ob.AdamW8bit(params, **kwargs)
    if kind == "muon":
        return ob.Muon(params, **kwargs)
    raise ValueError(kind)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Intra-op threads pinned to 1 for the block, then restored.

    Bitwise comparisons are "same arithmetic" tests: every side must run the same kernels with
    the same thread count (a GEMM's reduction split depends on it). Ranks run with 1 thread
    (``run_processes`` sets it, ``dist_run_steps`` sets it on threaded ranks); so do references.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_steps(
    mesh: DeviceMesh | None,
    kind: str,
    shapes: list[tuple[int, ...]],
    specs: list[Spec],
    steps: int,
    kwargs: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> list[dict[str, torch.Tensor]]:
    """Run ``steps`` steps on seeded data; per param: local param and every state tensor.

    With 1 intra-op thread (see ``one_thread``), on every side of a comparison."""
    with one_thread():
        return _run_steps(mesh, kind, shapes, specs, steps, kwargs, dtype, seed)


def _run_steps(
    mesh: DeviceMesh | None,
    kind: str,
    shapes: list[tuple[int, ...]],
    specs: list[Spec],
    steps: int,
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    seed: int,
) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    params = [torch.nn.Parameter(shard(f, mesh, sp)) for f, sp in zip(fulls, specs, strict=True)]
    opt = make_optimizer(kind, params, kwargs)
    for step in range(steps):
        for p, s, sp in zip(params, shapes, specs, strict=True):
            # Vary magnitudes across steps and tensors so blocks see different scales.
            scale = 10.0 ** ((step % 3) - 1)
            p.grad = shard(torch.randn(s, generator=gen).mul(scale).to(dtype), mesh, sp)
        opt.step()
    out = []
    for p in params:
        record = {"param": local_of(p.detach()).clone()}
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor):
                record[key] = value.clone()
        out.append(record)
    return out


def dist_run_steps(rank: int, world: int, *args: Any) -> list[dict[str, torch.Tensor]]:
    """``run_steps`` on a 1-D mesh of all ranks (for run_threaded / run_processes)."""
    torch.manual_seed(0)
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    return run_steps(mesh, *args)


def expected_slice(
    full_record: dict[str, torch.Tensor],
    start: int,
    stop: int,
    block: int,
) -> dict[str, torch.Tensor]:
    """The part of a single-device record that the rank holding ``[start, stop)`` must hold."""
    out = {}
    for key, value in full_record.items():
        if key == "step":
            out[key] = value
        elif key.endswith("_absmax"):
            lo = start // block
            hi = -(-stop // block) if stop > start else lo
            out[key] = value[lo:hi]
        else:
            out[key] = value.reshape(-1)[start:stop]
    return out


def ranges_of(shape: tuple[int, ...], spec: Spec, world: int) -> list[tuple[int, int]]:
    from optim_blockwise._private.layout import chunk_ranges

    if spec[0] == "chunk":
        return list(chunk_ranges(shape, world))
    if spec[0] == "plain":
        return [(0, math.prod(shape))] * world
    _, _dims, units = spec
    placement = RaggedShard(spec[1], units)
    return [
        (placement.flat_range(shape, k).start, placement.flat_range(shape, k).stop)
        for k in range(world)
    ]


def assert_records_equal(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    where: str,
    atol: float = 0.0,
) -> None:
    assert set(got) == set(want), f"{where}: state keys {sorted(got)} != {sorted(want)}"
    for key, b in want.items():
        a = got[key]
        assert a.dtype == b.dtype, f"{where}/{key}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}/{key}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        if atol == 0.0 or not a.is_floating_point():
            assert torch.equal(a, b), f"{where}/{key}: not bit-identical " + (
                f"(max diff {(a.double() - b.double()).abs().max().item():.3g})"
                if a.numel()
                else ""
            )
        else:
            label = f"{where}/{key}"
            torch.testing.assert_close(
                a, b, atol=atol, rtol=0.0, msg=lambda m, label=label: f"{label}: {m}"
            )


def check_against_single(
    results: list[list[dict[str, torch.Tensor]]],
    single: list[dict[str, torch.Tensor]],
    shapes: list[tuple[int, ...]],
    specs: list[Spec],
    block: int,
    atol: float = 0.0,
) -> None:
    world = len(results)
    for i, (shape, spec) in enumerate(zip(shapes, specs, strict=True)):
        for rank, (lo, hi) in enumerate(ranges_of(shape, spec, world)):
            want = expected_slice(single[i], lo, hi, block)
            got = results[rank][i]
            if spec[0] == "plain":
                want = single[i]
            assert_records_equal(got, want, f"param {i} shape {shape} {spec} rank {rank}", atol)


def to_bytes(value: Any) -> bytes:
    """Serialize for the result queue of spawned processes.

    torch.multiprocessing ships tensors as shared-memory file descriptors, which break when the
    sending process has exited before the parent unpickles them; plain bytes always arrive.
    """
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    import io

    return torch.load(io.BytesIO(data), weights_only=True)


def dist_run_steps_bytes(rank: int, world: int, *args: Any) -> bytes:
    return to_bytes(dist_run_steps(rank, world, *args))


def flat_views(
    fulls: list[torch.Tensor], mesh: DeviceMesh | None, specs: list[Spec]
) -> list[torch.Tensor]:
    """Like ``shard`` for every tensor, but every local piece is a view of one flat storage of
    this rank, in order (what a flat-buffer engine such as fsdp-engine makes)."""
    pieces = [local_of(shard(f, mesh, sp)) for f, sp in zip(fulls, specs, strict=True)]
    storage = torch.cat(pieces) if pieces else torch.zeros(0)
    out: list[torch.Tensor] = []
    pos = 0
    for full, spec, piece in zip(fulls, specs, pieces, strict=True):
        view = storage[pos : pos + piece.numel()]
        pos += piece.numel()
        if spec[0] == "plain" or mesh is None:
            out.append(view.view(full.shape))
            continue
        _, dims, units = spec
        out.append(
            DTensor.from_local(
                view,
                mesh,
                [RaggedShard(dims, units)],
                shape=full.shape,
                stride=full.stride(),
                run_check=False,
            )
        )
    return out


def run_flat_steps(
    mesh: DeviceMesh | None,
    kind: str,
    shapes: list[tuple[int, ...]],
    specs: list[Spec],
    steps: int,
    kwargs: dict[str, Any],
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """``run_steps`` with parameters and gradients that are views of one flat storage each (one
    gradient storage per step, like an engine's reduce-scatter output)."""
    with one_thread():
        gen = torch.Generator().manual_seed(0)
        fulls = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        params = [torch.nn.Parameter(t) for t in flat_views(fulls, mesh, specs)]
        opt = make_optimizer(kind, params, kwargs)
        for step in range(steps):
            scale = 10.0 ** ((step % 3) - 1)
            grads = [torch.randn(s, generator=gen).mul(scale).to(dtype) for s in shapes]
            for p, g in zip(params, flat_views(grads, mesh, specs), strict=True):
                p.grad = g
            opt.step()
        records = []
        for p in params:
            record = {"param": local_of(p.detach()).clone()}
            for key, value in opt.state[p].items():
                if isinstance(value, torch.Tensor):
                    record[key] = value.clone()
            records.append(record)
        return {"records": records, "stats": dict(getattr(opt, "last_step_stats", {}))}


def dist_run_flat_steps(rank: int, world: int, *args: Any) -> dict[str, Any]:
    mesh = init_device_mesh(DEVICE_TYPE, (world,))
    return run_flat_steps(mesh, *args)


# -- host reads ---------------------------------------------------------------------------------

_HOST_READ_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "item"}
"""Ops that read device data on the host (``item``, ``bool``, ``float`` all dispatch to
``_local_scalar_dense``) or whose output shape depends on device data."""
_HOST_READ_METHODS = {"tolist", "numpy", "__array__"}
"""Tensor methods that read the data on the host without a dispatched op on a CPU tensor."""


def _in_test_backend() -> bool:
    """Inside the threaded process group's own collective (a test backend that copies with
    Python slicing): not the optimizer's work."""
    frame: Any = sys._getframe()
    while frame is not None:
        if frame.f_code.co_filename.endswith("multi_threaded_pg.py"):
            return True
        frame = frame.f_back
    return False


class HostReads:
    """``with HostReads() as reads: ...``: every host synchronization this thread causes.

    ``reads`` lists, by op name:

    - reads of device data on the host: ``_local_scalar_dense`` (what ``item()``, ``bool()``,
      ``float()`` dispatch to), ops with data-dependent output shapes, ``Tensor.tolist`` /
      ``numpy`` (no dispatched op on a CPU tensor: caught as a torch function);
    - host data made into a tensor: ``lift_fresh`` (``torch.tensor(list)``: on an accelerator a
      pageable host-to-device copy), and any copy between two devices (``_to_copy`` / ``copy_``).

    On CPU nothing synchronizes, but the same code on CUDA would wait at each of these: counting
    them on CPU is how the step's host syncs are tested without a GPU. Modes are thread-local,
    so each threaded rank counts its own; the threaded process group's Python copies are left
    out (``_in_test_backend``).
    """

    def __init__(self) -> None:
        self.reads: list[str] = []
        self._modes: list[Any] = []

    def __enter__(self) -> list[str]:
        reads = self.reads

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                kwargs = kwargs or {}
                name = func.__name__.split(".")[0]
                if (
                    name in _HOST_READ_OPS
                    or name.startswith("lift_fresh")
                    or _crosses_devices(name, args, kwargs)
                ) and not _in_test_backend():
                    reads.append(name)
                return func(*args, **kwargs)

        class Function(TorchFunctionMode):
            def __torch_function__(
                self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                name = getattr(func, "__name__", "")
                if name in _HOST_READ_METHODS and not _in_test_backend():
                    reads.append(name)
                return func(*args, **(kwargs or {}))

        self._modes = [Function(), Dispatch()]
        for mode in self._modes:
            mode.__enter__()
        return reads

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def _crosses_devices(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    if name == "_to_copy":
        target = kwargs.get("device")
        return target is not None and torch.device(target) != args[0].device
    if name == "copy_":
        return bool(args[0].device != args[1].device)
    return False
