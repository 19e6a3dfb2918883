"""``async_save_checkpoint`` (issue 28 item 1): the training thread checks and copies, a writer
thread writes, hashes and commits; what it commits is the state at the call, bit for bit, and
it loads at any world size; errors before the write raise at once, the write's own errors come
from ``result()`` on every rank, and an error nobody retrieved is reported, never lost.

One process (no process group) for the protocol; real gloo processes for the collectives (a
writer thread needs a process group of its own; torch's threaded test group is per thread).

Numerics: checkpoints move bits: bitwise.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_reliability_common import assert_bitwise_equal, build, full_snapshot, train
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fsdp_engine
from fsdp_engine import (
    AfterCommitError,
    AsyncSaveHandle,
    CheckpointError,
    async_save_checkpoint,
    checkpoint_info,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from fsdp_engine._private import checkpoint_files, checkpoint_save
from fsdp_engine._private.checkpoint_staging import stage_state_dict
from ragged_dtensor.testing import run_processes, run_threaded

pytestmark = pytest.mark.numerics

WRITER = "fsdp_engine-checkpoint-writer"


class _Gate:
    """Holds every background write until ``open()``; records the threads that wrote and
    computed digests."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.threads: set[str] = set()
        self.nice: set[int] = set()

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    held_gate = _Gate()
    real_write, real_record = checkpoint_save.write, checkpoint_files.file_record

    def held(*args: Any, **kwargs: Any) -> Path:
        held_gate.threads.add(threading.current_thread().name)
        if sys.platform.startswith("linux"):
            held_gate.nice.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert held_gate.opened.wait(60), "the test never opened the gate"
        return real_write(*args, **kwargs)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        held_gate.threads.add(f"digest: {threading.current_thread().name}")
        return real_record(*args, **kwargs)

    monkeypatch.setattr(checkpoint_save, "write", held)
    monkeypatch.setattr(checkpoint_files, "file_record", recorded)
    yield held_gate
    held_gate.open()


def _state() -> dict[str, Any]:
    flat = torch.arange(40, dtype=torch.float32)
    return {
        "a": flat[4:16].view(3, 4),  # two views of one storage, at offsets
        "b": flat[20:30],
        "t": flat[:16].view(4, 4).t(),  # not contiguous
        "zero": torch.empty(0, 3),
        "step": torch.tensor(7, dtype=torch.int64),
        "nested": {"list": [torch.ones(2), "text", 3], "lr": 0.1},
    }


def _zeros_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    return state


def test_returns_after_staging_and_commits_the_state_at_the_call(
    tmp_path: Path, gate: _Gate
) -> None:
    state = _state()
    want = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    metadata = {"step": 7}
    handle = async_save_checkpoint(state, tmp_path / "step_7", metadata=metadata)
    assert isinstance(handle, AsyncSaveHandle) and not handle.done()
    assert "writing" in repr(handle) and handle.path == tmp_path / "step_7"
    assert latest_checkpoint(tmp_path) is None  # partial until the commit
    # training goes on at once: the tensors, the nested list and the metadata change
    state["a"].add_(100)
    state["b"].zero_()
    state["nested"]["list"][0].fill_(5)
    state["nested"]["list"].append("late")
    metadata["step"] = 8
    assert not handle.wait(timeout=0.05)
    gate.open()
    assert handle.result(timeout=60) == tmp_path / "step_7"
    assert handle.done() and handle.exception() is None and "committed" in repr(handle)
    # the write and every digest ran on the writer thread, none on this one
    assert gate.threads and all(WRITER in name for name in gate.threads), gate.threads
    # at the lowest CPU priority: it takes the cores training leaves idle (this thread keeps its)
    if sys.platform.startswith("linux"):
        assert gate.nice == {19}, gate.nice
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19
    assert latest_checkpoint(tmp_path) == tmp_path / "step_7"
    assert checkpoint_info(tmp_path / "step_7")["metadata"] == {"step": 7}
    verify_checkpoint(tmp_path / "step_7")
    target = _zeros_like(_state())
    target["nested"]["list"][1] = "other"
    load_checkpoint(target, tmp_path / "step_7")
    for key in ("a", "b", "t", "zero", "step"):
        assert torch.equal(target[key], want[key]), key
    assert torch.equal(target["nested"]["list"][0], torch.ones(2))
    assert target["nested"]["list"][1:] == ["text", 3] and target["nested"]["lr"] == 0.1


def test_staging_copies_each_storage_once_and_keeps_the_views() -> None:
    state = _state()
    staged = stage_state_dict(state).state_dict
    a, b, t = staged["a"], staged["b"], staged["t"]
    assert (
        a.untyped_storage().data_ptr()
        == b.untyped_storage().data_ptr()
        == (t.untyped_storage().data_ptr())
    )
    assert a.untyped_storage().data_ptr() != state["a"].untyped_storage().data_ptr()
    assert a.untyped_storage().nbytes() <= 30 * 4  # the span the views cover, not more
    assert t.stride() == state["t"].stride() and not t.is_contiguous()
    assert b.storage_offset() - a.storage_offset() == 16
    for key in ("a", "b", "t", "zero", "step"):
        assert torch.equal(staged[key], state[key]) and staged[key].dtype == state[key].dtype
    assert staged["nested"]["list"][1:] == ["text", 3] and staged["nested"]["lr"] == 0.1
    assert torch.equal(staged["nested"]["list"][0], torch.ones(2))
    assert staged["nested"]["list"] is not state["nested"]["list"]
    # one storage viewed in two dtypes (the engine's flat buffers are): one copy, both views
    raw = torch.arange(16, dtype=torch.int32)
    halves = raw.view(torch.int16)[8:16]
    both = stage_state_dict({"i32": raw[2:6], "i16": halves}).state_dict
    assert torch.equal(both["i32"], raw[2:6]) and torch.equal(both["i16"], halves)
    assert both["i32"].untyped_storage().data_ptr() == both["i16"].untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"digest": "md5"}, ValueError, r"digest='md5'; expected one of"),
        ({"metadata": {"when": object()}}, TypeError, r"metadata must be a JSON-serializable"),
        ({"path": "exists"}, FileExistsError, r"already exists; checkpoints are never"),
        ({"state_dict": {"w": torch.empty(3, device="meta")}}, CheckpointError, r"'w' is on the"),
        ({"state_dict": [torch.ones(1)]}, TypeError, r"state_dict must be a dict, got list"),
    ],
)
def test_errors_before_the_write_raise_at_once_as_save_checkpoint_raises(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    (tmp_path / "exists").mkdir()
    args = {"state_dict": {"w": torch.ones(3)}, "path": tmp_path / "new", **kwargs}
    if args["path"] == "exists":
        args["path"] = tmp_path / "exists"
    for api in (save_checkpoint, async_save_checkpoint):
        with pytest.raises(error, match=rf"{api.__name__}: .*{fragment}"):
            api(**args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


class _FullDiskWriter(checkpoint_files.DigestingWriter):
    """Rank 1 (or the only rank) runs out of disk in the middle of writing its shards."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 1
        if rank == 1 and "step_00000003" in str(self.path):
            (Path(self.path) / f"__{rank}_0.distcp").write_bytes(b"half a shard")
            raise OSError(28, "No space left on device")
        return super().write_data(plan, planner)


def test_a_failed_write_raises_from_result_cleans_up_and_the_next_save_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint({"w": torch.zeros(2)}, tmp_path / "step_00000002")
    monkeypatch.setattr(checkpoint_files, "DigestingWriter", _FullDiskWriter)
    handle = async_save_checkpoint({"w": torch.ones(2)}, tmp_path / "step_00000003")
    with pytest.raises(CheckpointError, match=r"(?s)async_save_checkpoint: writing.*No space left"):
        handle.result(timeout=60)
    assert "Nothing was committed" in str(handle.exception())
    assert not (tmp_path / ".step_00000003.partial").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    monkeypatch.undo()
    async_save_checkpoint({"w": torch.ones(2)}, tmp_path / "step_00000003").result(timeout=60)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000003"


def test_an_error_nobody_retrieved_is_reported_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's future keeps an error until someone asks; a training loop that never calls
    ``result()`` would lose it. The next save of the process (either API) warns with it."""
    monkeypatch.setattr(checkpoint_files, "DigestingWriter", _FullDiskWriter)
    for next_save in (async_save_checkpoint, save_checkpoint):
        handle = async_save_checkpoint({"w": torch.ones(2)}, tmp_path / "step_00000003")
        handle.wait(timeout=60)
        with pytest.warns(RuntimeWarning, match=r"(?s)step_00000003.*nobody retrieved.*No space"):
            result = next_save({"w": torch.ones(2)}, tmp_path / f"{next_save.__name__}")
        if isinstance(result, AsyncSaveHandle):
            result.result(timeout=60)
        with pytest.raises(CheckpointError):  # still there for whoever asks
            handle.result()
    # retrieved: nothing to report
    handle = async_save_checkpoint({"w": torch.ones(2)}, tmp_path / "step_00000003")
    with pytest.raises(CheckpointError):
        handle.result(timeout=60)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        save_checkpoint({"w": torch.ones(2)}, tmp_path / "after")
    assert not [w for w in seen if w.category is RuntimeWarning], seen


def test_saves_run_one_at_a_time(tmp_path: Path, gate: _Gate) -> None:
    """The next save (either API) waits for the one still writing: the commit protocol's
    cleanup never meets a live partial directory, and one staged copy is held at a time."""
    first = async_save_checkpoint({"w": torch.zeros(2)}, tmp_path / "step_00000001")
    calls: list[Any] = []
    second = threading.Thread(
        target=lambda: calls.append(
            async_save_checkpoint({"w": torch.ones(2)}, tmp_path / "step_00000002")
        )
    )
    second.start()
    second.join(timeout=0.3)
    assert second.is_alive() and not first.done()  # blocked behind the first, held at the gate
    gate.open()
    second.join(timeout=60)
    assert first.result(timeout=60) == tmp_path / "step_00000001"
    assert calls[0].result(timeout=60) == tmp_path / "step_00000002"
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    save_checkpoint({"w": torch.ones(2)}, tmp_path / "step_00000003")  # waits too (none left)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000003"


def test_a_failure_after_the_commit_comes_from_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = checkpoint_save.write_durably

    def flaky(path: Path, text: str) -> None:
        if path.name == ".latest.tmp" and text == "step_00000002":
            raise OSError(28, "No space left on device")
        real(path, text)

    save_checkpoint({"w": torch.zeros(2)}, tmp_path / "step_00000001")
    monkeypatch.setattr(checkpoint_save, "write_durably", flaky)
    handle = async_save_checkpoint({"w": torch.ones(2)}, tmp_path / "step_00000002")
    with pytest.raises(AfterCommitError, match=r"IS committed and loadable.*'latest' pointer"):
        handle.result(timeout=60)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"


def test_the_public_api_lists_the_async_save() -> None:
    assert {"async_save_checkpoint", "AsyncSaveHandle"} <= set(fsdp_engine.__all__)
    assert json.loads(json.dumps(fsdp_engine.__all__)) == fsdp_engine.__all__


# -- real processes: the writer's own gloo group, training going on meanwhile -------------------


def _async_run(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each engine trains 2 steps and saves asynchronously with our API; a third step runs while
    the writer writes. Then a save in which rank 1's disk fills up."""
    torch.set_num_threads(1)
    threads: set[str] = set()
    real_record = checkpoint_files.file_record

    def recorded(*args: Any, **kwargs: Any) -> Any:
        threads.add(threading.current_thread().name)
        return real_record(*args, **kwargs)

    checkpoint_files.file_record = recorded  # type: ignore[assignment]
    out: dict[str, Any] = {}
    engine = "ours"
    for engine in ("fsdp2", "ours"):
        model, opt = build(world, engine=engine)
        train(model, opt, rank, world, start=0, steps=2)
        out[engine] = full_snapshot(model, opt)
        model_sd, optim_sd = get_state_dict(model, opt)
        handle = async_save_checkpoint(
            {"model": model_sd, "optim": optim_sd},
            Path(root) / engine / "step_00000002",
            metadata={"step": 2},
        )
        train(model, opt, rank, world, start=2, steps=1)  # collectives while the writer's run
        out[f"{engine} path"] = str(handle.result(timeout=120))
    # ranks that name different paths: the writers' agreement, before anything is written
    model_sd, optim_sd = get_state_dict(model, opt)
    handle = async_save_checkpoint(
        {"model": model_sd, "optim": optim_sd}, Path(root) / engine / f"rank_{rank}"
    )
    error = handle.exception(timeout=120)
    out["paths"] = f"{type(error).__name__}: {error}"
    checkpoint_files.DigestingWriter = _FullDiskWriter  # type: ignore[misc]
    model_sd, optim_sd = get_state_dict(model, opt)
    handle = async_save_checkpoint(
        {"model": model_sd, "optim": optim_sd}, Path(root) / engine / "step_00000003"
    )
    error = handle.exception(timeout=120)
    out["failure"] = f"{type(error).__name__}: {error}"
    out["threads"] = sorted(threads)
    import torch.distributed as dist

    from fsdp_engine._private.checkpoint_async import _WRITERS, timeout_of

    writer_group = _WRITERS[-1].group
    assert writer_group is not None and writer_group is not dist.group.WORLD
    out["timeouts"] = (timeout_of(writer_group), timeout_of(dist.group.WORLD))
    return out


def _load(rank: int, world: int, path: str, engine: str) -> dict[str, torch.Tensor]:
    model, opt = build(world, engine=engine)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    load_checkpoint(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return full_snapshot(model, opt)


@pytest.mark.multiprocess
def test_async_saves_at_2_load_bitwise_at_1_and_3_and_every_rank_learns_a_failure(
    tmp_path: Path,
) -> None:
    """Ours and FSDP2's state dicts (the control: the API takes any DTensor state dict), saved
    asynchronously at world size 2 while training goes on, load into ours at 1 and 3 and into
    FSDP2 at 3 with the values at the call; digests computed on the writer thread only; ranks
    that name different paths, and a full disk on rank 1, are the same CheckpointError on both
    ranks, nothing committed."""
    out = run_processes(_async_run, 2, str(tmp_path), timeout=240)
    want = out[0]
    assert_bitwise_equal(want["ours"], want["fsdp2"])
    for rank_out in out:
        assert rank_out["threads"] and all(WRITER in t for t in rank_out["threads"]), rank_out
    writer, training = out[0]["timeouts"]
    assert writer == training and training.total_seconds() == 240, out[0]["timeouts"]
    assert out[0]["paths"] == out[1]["paths"], out
    assert "the ranks were given different paths" in out[0]["paths"], out[0]["paths"]
    assert out[0]["failure"] == out[1]["failure"], out
    assert out[0]["failure"].startswith("CheckpointError: async_save_checkpoint: writing")
    assert "ranks [1]: OSError" in out[0]["failure"] and "No space left" in out[0]["failure"]
    assert not (tmp_path / "ours" / ".step_00000003.partial").exists()
    for engine in ("fsdp2", "ours"):
        path = tmp_path / engine / "step_00000002"
        assert want[f"{engine} path"] == str(path) and latest_checkpoint(tmp_path / engine) == path
        assert checkpoint_info(path)["metadata"] == {"step": 2}
        verify_checkpoint(path)
        for world in (1, 3):
            for got in run_threaded(_load, world, str(path), "ours", timeout=120):
                assert_bitwise_equal(got, want[engine])
    for got in run_threaded(_load, 3, str(tmp_path / "ours" / "step_00000002"), "fsdp2"):
        assert_bitwise_equal(got, want["ours"])
    assert sorted(os.listdir(tmp_path / "ours")) == ["latest", "step_00000002"]


_AT_EXIT = """
import sys, torch
from pathlib import Path
from fsdp_engine import async_save_checkpoint
from fsdp_engine._private import checkpoint_files

class Full(checkpoint_files.DigestingWriter):
    def write_data(self, plan, planner):
        raise OSError(28, "No space left on device")

root = Path(sys.argv[1])
if sys.argv[2] == "fail":
    checkpoint_files.DigestingWriter = Full
async_save_checkpoint({"w": torch.arange(1000.0)}, root / "step_00000001")
print("returned", flush=True)
"""


def test_a_process_ending_while_its_save_writes_finishes_it_or_reports_its_error(
    tmp_path: Path,
) -> None:
    """The interpreter joins the writer thread at exit: the save commits. Had it failed, with
    nobody asking, the exit reports the error (a warning on stderr), instead of losing it."""
    import subprocess

    script = tmp_path / "ends.py"
    script.write_text(_AT_EXIT)
    for mode in ("ok", "fail"):
        root = tmp_path / mode
        done = subprocess.run(
            [sys.executable, "-W", "default", str(script), str(root), mode],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0 and "returned" in done.stdout, done.stderr
        if mode == "ok":
            assert latest_checkpoint(root) == root / "step_00000001", done.stderr
            verify_checkpoint(root / "step_00000001")
        else:
            assert latest_checkpoint(root) is None
            assert "nobody retrieved" in done.stderr and "No space left" in done.stderr, done.stderr
