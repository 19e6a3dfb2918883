"""Checkpoints: atomic commit, resharding across world sizes (ours, and torch's DCP with its
state-dict API), FSDP2 interop, resume in new processes, a crash during the save.

Numerics: round trips move bits and resumed runs repeat the same arithmetic: bitwise.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from engine_models import batches, loss_fn
from engine_reliability_common import assert_bitwise_equal, build, full_snapshot, train
from engine_training import initial_state, sharded_tiny_llama
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

import fsdp_engine
import fsdp_engine._private.checkpoint_save as ckpt
from fsdp_engine import (
    CheckpointError,
    CheckpointIntegrityError,
    IncompleteCheckpointError,
    is_complete_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from fsdp_engine._private import checkpoint_files
from ragged_dtensor.testing import DistributedFailure, run_processes, run_threaded

pytestmark = pytest.mark.numerics

# -- the commit protocol, one process (no process group) -----------------------------------------


def test_commit_marker_pointer_and_refusals(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert latest_checkpoint(root) is None
    first = save_checkpoint({"w": torch.arange(6.0)}, root / "step_00000001", metadata={"s": 1})
    assert is_complete_checkpoint(first)
    assert (root / "latest").read_text() == "step_00000001"
    info = fsdp_engine.checkpoint_info(first)
    assert info["metadata"] == {"s": 1} and len(info["save_id"]) == 32
    assert set(info["files"]) == {".metadata", "__0_0.distcp"}  # every file has its digests
    second = save_checkpoint({"w": torch.arange(6.0) * 2}, root / "step_00000002")
    assert latest_checkpoint(root) == second
    assert fsdp_engine.checkpoint_info(second)["save_id"] != info["save_id"]
    target = {"w": torch.zeros(6)}
    info = load_checkpoint(target, first)
    assert torch.equal(target["w"], torch.arange(6.0)) and info["world_size"] == 1
    assert fsdp_engine.verify_checkpoint(second)["save_id"]

    # never overwritten in place
    with pytest.raises(FileExistsError, match="step_00000002"):
        save_checkpoint({"w": torch.ones(6)}, second)
    # a directory without the marker (a save that never finished) is refused, by name
    torn = root / "step_00000003"
    torn.mkdir()
    with pytest.raises(IncompleteCheckpointError, match=r"step_00000003.*no COMMITTED marker"):
        load_checkpoint({"w": torch.zeros(6)}, torn)
    with pytest.raises(IncompleteCheckpointError, match="does not exist"):
        load_checkpoint({"w": torch.zeros(6)}, root / "step_00000009")
    assert latest_checkpoint(root) == second  # the torn directory is never picked


def test_latest_follows_a_valid_pointer_else_the_newest_commit_time(tmp_path: Path) -> None:
    """Regressions (issue 14): the highest trailing number won over the pointer (with ``final``
    saved last it returned ``step_10``), and the pointer could name a directory outside the
    root. Now: the pointer when it names a committed checkpoint inside the root, else the
    newest commit time (never the name), with a warning naming the pointer."""
    root = tmp_path / "ckpt"
    step_10 = save_checkpoint({"w": torch.zeros(2)}, root / "step_00000010")
    final = save_checkpoint({"w": torch.ones(2)}, root / "final")
    assert latest_checkpoint(root) == final
    (root / "latest").write_text("step_00000010")  # pointed back at a known-good checkpoint
    assert latest_checkpoint(root) == step_10
    outside = save_checkpoint({"w": torch.ones(2)}, tmp_path / "elsewhere" / "step_00000099")
    partial = root / ".step_00000011.partial"
    partial.mkdir()
    (partial / "COMMITTED").write_text("{}")
    for bad in ("../elsewhere/step_00000099", str(outside), ".step_00000011.partial", "gone"):
        (root / "latest").write_text(bad)
        with pytest.warns(UserWarning, match=r"latest.*not (a directory inside|a committed)"):
            assert latest_checkpoint(root) == final, bad  # newest commit time, not the name
    # a symbolic link inside the root that leads outside it
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "latest").write_text("link")
    with pytest.warns(UserWarning, match="not a directory inside"):
        assert latest_checkpoint(root) == final
    (root / "link").unlink()
    # no pointer: the newest commit time, even when names sort the other way
    (root / "latest").unlink()
    newest = save_checkpoint({"w": torch.ones(2)}, root / "a_first_by_name")
    (root / "latest").unlink()
    assert latest_checkpoint(root) == newest
    # a committed directory whose marker is unreadable is skipped, with a warning naming it
    (newest / "COMMITTED").write_text("{not json")
    with pytest.warns(UserWarning, match=r"a_first_by_name/COMMITTED.*not a valid COMMITTED"):
        assert latest_checkpoint(root) == final


def test_marker_errors_name_the_path(tmp_path: Path) -> None:
    """Regression (issue 14): a COMMITTED marker with invalid JSON gave a raw JSONDecodeError
    without the path."""
    path = save_checkpoint({"w": torch.zeros(2)}, tmp_path / "step_00000001")
    (path / "COMMITTED").write_text("{not json")
    with pytest.raises(CheckpointIntegrityError, match=r"step_00000001/COMMITTED.*not a valid"):
        fsdp_engine.checkpoint_info(path)
    with pytest.raises(CheckpointIntegrityError, match=r"step_00000001/COMMITTED.*not a valid"):
        load_checkpoint({"w": torch.zeros(2)}, path)
    (path / "COMMITTED").write_text('{"format": 2, "world_size": 1, "time": "noon"}')
    with pytest.raises(CheckpointIntegrityError, match=r"COMMITTED.*'time' is 'noon'"):
        fsdp_engine.checkpoint_info(path)


def test_strict_by_default_strict_false_loads_the_subset(tmp_path: Path) -> None:
    path = save_checkpoint({"a": torch.arange(4.0), "b": torch.ones(3)}, tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"in the checkpoint, not in the state dict.*'b'"):
        load_checkpoint({"a": torch.zeros(4)}, path)
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \(1\): 'c'"):
        load_checkpoint({"a": torch.zeros(4), "b": torch.zeros(3), "c": torch.zeros(1)}, path)
    target = {"a": torch.zeros(4), "c": torch.full((1,), 7.0)}
    load_checkpoint(target, path, strict=False)  # the keys both have; 'c' keeps its value
    assert torch.equal(target["a"], torch.arange(4.0)) and target["c"].item() == 7.0
    with pytest.raises(CheckpointError, match=r"'a': shape \(5,\) in the state dict, \(4,\)"):
        load_checkpoint({"a": torch.zeros(5)}, path, strict=False)
    with pytest.raises(CheckpointError, match=r"'a': dtype torch.float64 in the state dict"):
        load_checkpoint({"a": torch.zeros(4, dtype=torch.float64)}, path, strict=False)


def test_damage_is_refused_and_verify_false_skips_the_digests(tmp_path: Path) -> None:
    path = save_checkpoint({"a": torch.arange(1000.0)}, tmp_path / "ck")
    items = fsdp_engine.checkpoint_info(path)["files"]["__0_0.distcp"]["items"]
    offset, length, _ = max(items, key=lambda item: item[1])
    data = bytearray((path / "__0_0.distcp").read_bytes())
    last = data.find(struct.pack("<f", 999.0), offset, offset + length)
    assert last > 0
    data[last] ^= 0x01  # one bit of the tensor's last element
    (path / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=r"ranks \[0\].*'__0_0.distcp'.*damaged"):
        load_checkpoint({"a": torch.zeros(1000)}, path)
    with pytest.raises(CheckpointIntegrityError, match=r"'__0_0.distcp': its bytes do not match"):
        fsdp_engine.verify_checkpoint(path)
    target = {"a": torch.zeros(1000)}
    load_checkpoint(target, path, verify=False)  # no digests checked: the damage goes through
    assert torch.equal(target["a"][:-1], torch.arange(999.0)) and target["a"][-1] != 999.0


# -- resharding across world sizes, bit-exact (threads: real collectives, one process) -------------


def _reshard_phase(
    rank: int, world: int, root: str, load_from: str | None, save_to: str, rows: bool = False
) -> dict[str, torch.Tensor]:
    model, opt = build(world, row_blocks=rows)
    if load_from is None:
        train(model, opt, rank, world, start=0, steps=2)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        load_checkpoint(state, Path(root) / load_from)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    snapshot = full_snapshot(model, opt)
    model_sd, optim_sd = get_state_dict(model, opt)
    save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / save_to)
    return snapshot


def test_save_at_2_load_at_4_then_1_then_2_is_bit_exact(tmp_path: Path) -> None:
    """Parameters and AdamW state (exp_avg, exp_avg_sq, step) survive 2 -> 4 -> 1 -> 2."""
    root = str(tmp_path)
    want = run_threaded(_reshard_phase, 2, root, None, "w2", timeout=120)[0]
    assert any(k.endswith("exp_avg_sq") for k in want) and any(k.endswith(".step") for k in want)
    for world, src, dst in ((4, "w2", "w4"), (1, "w4", "w1"), (2, "w1", "w2b")):
        for got in run_threaded(_reshard_phase, world, root, src, dst, timeout=120):
            assert_bitwise_equal(got, want)


def test_load_under_another_plan_at_odd_world_sizes(tmp_path: Path) -> None:
    """2 ranks, no block policy -> 3 ranks keeping matrix rows whole (another plan, uneven
    shares) -> 5 ranks: bit-exact."""
    root = str(tmp_path)
    want = run_threaded(_reshard_phase, 2, root, None, "w2", timeout=120)[0]
    for world, src, dst, rows in ((3, "w2", "w3", True), (5, "w3", "w5", False)):
        for got in run_threaded(_reshard_phase, world, root, src, dst, rows, timeout=120):
            assert_bitwise_equal(got, want)


def _interop_phase(
    rank: int, world: int, root: str, engine: str, load_from: str | None, save_to: str | None
) -> dict[str, torch.Tensor]:
    model, opt = build(world, engine=engine)
    if load_from is None:
        train(model, opt, rank, world, start=0, steps=2)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        load_checkpoint(state, Path(root) / load_from)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    snapshot = full_snapshot(model, opt)
    if save_to is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / save_to)
    return snapshot


def test_fsdp2_checkpoint_loads_into_ours_and_ours_into_fsdp2(tmp_path: Path) -> None:
    """torch FSDP2 (Shard(0)) at 2 -> ours (RaggedShard) at 4 -> FSDP2 at 2: bit-exact, with
    the AdamW state."""
    root = str(tmp_path)
    want = run_threaded(_interop_phase, 2, root, "fsdp2", None, "fsdp2", timeout=120)[0]
    for got in run_threaded(_interop_phase, 4, root, "ours", "fsdp2", "ours", timeout=120):
        assert_bitwise_equal(got, want)
    for got in run_threaded(_interop_phase, 2, root, "fsdp2", "ours", None, timeout=120):
        assert_bitwise_equal(got, want)


def _mesh_phase(
    rank: int, world: int, root: str, shape: tuple[int, ...], load_from: str | None, save_to: str
) -> dict[str, torch.Tensor]:
    model, opt = build(world, mesh_shape=shape)
    if load_from is None:
        train(model, opt, rank, world, start=0, steps=2)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        load_checkpoint(state, Path(root) / load_from)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    snapshot = full_snapshot(model, opt)
    model_sd, optim_sd = get_state_dict(model, opt)
    save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / save_to)
    return snapshot


def test_hsdp_2x2_checkpoint_loads_into_fsdp_2_and_back(tmp_path: Path) -> None:
    """A job restarted on another mesh: HSDP (2 replicas x 2 shards) -> FSDP over 2 -> HSDP."""
    root = str(tmp_path)
    want = run_threaded(_mesh_phase, 4, root, (2, 2), None, "hsdp", timeout=120)[0]
    for got in run_threaded(_mesh_phase, 2, root, (2,), "hsdp", "fsdp", timeout=120):
        assert_bitwise_equal(got, want)
    for got in run_threaded(_mesh_phase, 4, root, (2, 2), "fsdp", "hsdp2", timeout=120):
        assert_bitwise_equal(got, want)


# -- resume in new processes ----------------------------------------------------------------------


def _resume_run(rank: int, world: int, root: str, phase: str) -> dict[str, Any]:
    model, opt = build(world)
    if phase == "straight":
        losses = train(model, opt, rank, world, start=0, steps=10)
        model_sd, optim_sd = get_state_dict(model, opt)
        save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / "step_00000010")
        losses += train(model, opt, rank, world, start=10, steps=10)
    else:
        path = latest_checkpoint(root)
        assert path is not None and path.name == "step_00000010", path
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        load_checkpoint(state, path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        losses = train(model, opt, rank, world, start=10, steps=10)
    return {"losses": losses, "state": full_snapshot(model, opt)}


@pytest.mark.slow  # CI budget: test_killed_rank_restarts_... resumes in new processes in CI
@pytest.mark.multiprocess
def test_resume_in_new_processes_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    """20 steps straight (checkpoint at 10, which does not perturb training) vs 10 steps +
    checkpoint + new processes + 10 steps: identical losses, parameters and optimizer state."""
    root = str(tmp_path)
    straight = run_processes(_resume_run, 2, root, "straight", timeout=150)
    resumed = run_processes(_resume_run, 2, root, "resume", timeout=150)
    assert len(straight[0]["losses"]) == 20 and len(resumed[0]["losses"]) == 10
    assert resumed[0]["losses"] == straight[0]["losses"][10:]
    for got, want in zip(resumed, straight, strict=True):
        assert_bitwise_equal(got["state"], want["state"])


# -- a crash during the save ----------------------------------------------------------------------


class _DieAfterWritingWriter(checkpoint_files.DigestingWriter):
    """Writes this rank's files, then the process dies (SIGKILL-like: no cleanup, no report)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        future.wait()
        import torch.distributed as dist

        if dist.get_rank() == 1:
            os._exit(9)
        return future


def _crash_during_save(rank: int, world: int, root: str) -> None:
    model, opt = build(world)
    train(model, opt, rank, world, start=0, steps=1)
    model_sd, optim_sd = get_state_dict(model, opt)
    save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / "step_00000001")
    snapshot = full_snapshot(model, opt)
    if rank == 0:
        torch.save(snapshot, Path(root) / "expected.pt")
    train(model, opt, rank, world, start=1, steps=1)
    checkpoint_files.DigestingWriter = _DieAfterWritingWriter  # type: ignore[misc]
    model_sd, optim_sd = get_state_dict(model, opt)
    save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / "step_00000002")
    raise AssertionError("unreachable: rank 1 dies inside the save")


def _load_latest(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    model, opt = build(world)
    path = latest_checkpoint(root)
    assert path is not None and path.name == "step_00000001", path
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    load_checkpoint(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    snapshot = full_snapshot(model, opt)
    # the restarted job saves the same step again: the dead save's partial directory goes
    model_sd, optim_sd = get_state_dict(model, opt)
    save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / "step_00000002")
    return snapshot


@pytest.mark.slow  # CI budget (11 s): runs in `nox -s slow`
@pytest.mark.multiprocess
def test_a_rank_killed_during_the_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path
    start = time.monotonic()
    with pytest.raises(DistributedFailure):
        run_processes(_crash_during_save, 2, str(root), timeout=90)
    assert time.monotonic() - start < 90
    partial = root / ".step_00000002.partial"
    assert partial.is_dir() and any(partial.iterdir()), "the dead save wrote part of its files"
    assert not (root / "step_00000002").exists()
    with pytest.raises(IncompleteCheckpointError, match=r"\.step_00000002\.partial"):
        load_checkpoint({}, partial)
    # the previous checkpoint is still the latest and loads bit-exactly
    want = torch.load(root / "expected.pt")
    for got in run_threaded(_load_latest, 2, str(root), timeout=120):
        assert_bitwise_equal(got, want)
    assert not partial.exists() and latest_checkpoint(root) == root / "step_00000002"


def _save_twice(rank: int, world: int, root: str) -> str:
    model, opt = build(world)
    model_sd, optim_sd = get_state_dict(model, opt)
    save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / "step_00000001")
    model_sd, optim_sd = get_state_dict(model, opt)
    try:
        save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / "step_00000002")
    except CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_failed_commit_raises_on_every_rank_commits_nothing_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank's data and DCP's ``.metadata`` are written, then the commit fails on rank 0
    (disk full writing the marker): all ranks raise the same error saying it was NOT committed,
    and the partial directory is gone (regression, issue 14: it stayed, and with the disk full
    every later save failed until someone deleted it)."""
    real = ckpt.write_durably

    def flaky(path: Path, text: str) -> None:
        if path.name == ckpt.COMMIT_MARKER and "step_00000002" in str(path):
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(ckpt, "write_durably", flaky)
    messages = run_threaded(_save_twice, 2, str(tmp_path), timeout=120)
    assert messages[0] == messages[1], messages
    message = messages[0]
    assert message.startswith("CheckpointError: save_checkpoint: committing"), message
    assert "writing the COMMITTED marker" in message and "No space left" in message, message
    assert "NOT committed" in message and "was removed" in message, message
    assert not (tmp_path / ".step_00000002.partial").exists()
    assert not (tmp_path / "step_00000002").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"


class _FullDiskWriter(checkpoint_files.DigestingWriter):
    """Rank 1 runs out of disk in the middle of writing its shards."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        import torch.distributed as dist

        if dist.get_rank() == 1 and "step_00000002" in str(self.path):
            (Path(self.path) / "__1_0.distcp").write_bytes(b"half a shard")
            raise OSError(28, "No space left on device")
        return super().write_data(plan, planner)


def test_a_failed_write_cleans_up_and_the_next_save_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP reports rank 1's ENOSPC to every rank: every rank raises naming the rank and the
    error, the partial directory is removed, and the next save works."""
    monkeypatch.setattr(checkpoint_files, "DigestingWriter", _FullDiskWriter)
    messages = run_threaded(_save_twice, 2, str(tmp_path), timeout=120)
    assert messages[0] == messages[1], messages
    assert "writing" in messages[0] and "ranks [1]: OSError" in messages[0], messages[0]
    assert "No space left" in messages[0] and "Nothing was committed" in messages[0]
    assert not (tmp_path / ".step_00000002.partial").exists()
    monkeypatch.undo()
    save_checkpoint({"w": torch.zeros(2)}, tmp_path / "step_00000002")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"


def test_a_failed_pointer_update_says_the_checkpoint_is_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (issue 14): when writing ``latest`` failed after the rename, the error said
    "not committed" although the directory was committed and loadable. Now every rank raises
    AfterCommitError saying it IS committed; the stale pointer is removed, so latest_checkpoint
    finds the new checkpoint by commit time."""
    real = ckpt.write_durably

    def flaky(path: Path, text: str) -> None:
        if path.name == ".latest.tmp" and text == "step_00000002":
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(ckpt, "write_durably", flaky)
    messages = run_threaded(_save_twice, 2, str(tmp_path), timeout=120)
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("AfterCommitError:"), messages[0]
    assert "IS committed and loadable" in messages[0] and "'latest' pointer" in messages[0]
    assert "stale" in messages[0] and "was removed" in messages[0], messages[0]
    assert not (tmp_path / "latest").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    fsdp_engine.verify_checkpoint(tmp_path / "step_00000002")


def test_the_next_save_removes_partial_directories_left_under_the_root(tmp_path: Path) -> None:
    """A save that died (SIGKILL, power loss) left ``.step_7.partial``; the next save under the
    same root, whatever its name, removes it (a root belongs to one job)."""
    dead = tmp_path / ".step_00000007.partial"
    dead.mkdir()
    (dead / "__0_0.distcp").write_bytes(b"x" * 100)
    save_checkpoint({"w": torch.zeros(2)}, tmp_path / "step_00000008")
    assert not dead.exists()


# -- checkpoint after an evaluation forward --------------------------------------------------------


def _eval_then_save(rank: int, world: int, root: str, engine: str) -> dict[str, Any]:
    model, opt = build(world, engine=engine)
    train(model, opt, rank, world, start=0, steps=1)
    with torch.no_grad():  # a validation loss: forward only, no backward follows
        loss_fn(model, batches(1, world)[0].chunk(world)[rank])
    kinds = sorted({type(v).__name__ for v in model.state_dict().values()})
    try:
        model_sd, optim_sd = get_state_dict(model, opt)
        save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / engine)
    except Exception as exc:
        return {"kinds": kinds, "save": f"{type(exc).__name__}: {exc}"}
    return {"kinds": kinds, "save": "saved"}


def test_checkpoint_after_an_eval_forward_like_fsdp2(tmp_path: Path) -> None:
    """Train, evaluate under ``no_grad``, checkpoint: the usual loop. FSDP2's state dict holds
    sharded DTensors and saves. Regression (found here, fixed in 7b3b105): ours kept the root's
    parameters unsharded after the forward (the root skips resharding because backward
    normally follows), so ``model.state_dict()`` held plain full tensors for them and
    ``get_state_dict(model, opt)`` raised ``KeyError: 0``."""
    theirs = run_threaded(_eval_then_save, 2, str(tmp_path), "fsdp2", timeout=120)
    ours = run_threaded(_eval_then_save, 2, str(tmp_path), "ours", timeout=120)
    assert theirs[0] == {"kinds": ["DTensor"], "save": "saved"}, theirs
    assert ours[0] == {"kinds": ["DTensor"], "save": "saved"}, ours


def _state_dict_roundtrip(rank: int, world: int, path: str, phase: str) -> list[float]:
    model, _ = sharded_tiny_llama(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(4, 4)
    losses = []
    if phase == "save":
        for tokens in data[:2]:
            loss_fn(model, tokens.chunk(world)[rank]).backward()
            opt.step()
            opt.zero_grad()
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        torch.save({k: v.clone() for k, v in full.items()}, f"{path}/full-{rank}.pt")
        return losses
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    saved = torch.load(f"{path}/full-0.pt")
    for key, value in saved.items():
        assert torch.equal(full[key], value), key
    # and a full (unsharded) state dict loads too
    fresh, _ = sharded_tiny_llama(world)
    # (torch replaces the values of the dict it is given by DTensors: pass a copy)
    set_model_state_dict(fresh, dict(saved), options=StateDictOptions(full_state_dict=True))
    again = get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True))
    for key, value in saved.items():
        assert torch.equal(again[key], value), key
    return [float(len(saved))]


@pytest.mark.slow  # CI budget; threaded 2->4->1->2 and the gloo resume test stay in CI
@pytest.mark.multiprocess
def test_checkpoint_saved_at_2_loads_at_4(tmp_path: Path) -> None:
    run_processes(_state_dict_roundtrip, 2, str(tmp_path), "save", timeout=300)
    loaded = run_processes(_state_dict_roundtrip, 4, str(tmp_path), "load", timeout=300)
    assert all(n == [float(len(initial_state()))] for n in loaded)
