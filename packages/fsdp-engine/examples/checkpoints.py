from pathlib import Path
from tempfile import mkdtemp

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import init_device_mesh

from fsdp_engine import (
    CheckpointIntegrityError,
    async_save_checkpoint,
    fully_shard,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from ragged_dtensor.testing import run_processes


def job(rank: int, world: int, root: str) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = 0
    path = latest_checkpoint(root)
    if path is not None:  # resume: parameters and optimizer state, any world size
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        start = load_checkpoint(state, path)["metadata"]["step"]
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    pending = None
    for step in range(start + 1, start + 7):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step % 3 == 0:  # checkpoints at steps 3 and 6 (then 9 and 12 on 4 ranks)
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            path = Path(root) / f"step_{step:08d}"
            if step % 2:  # returns once the state is copied: a writer thread writes it
                pending = async_save_checkpoint(state, path, metadata={"step": step})
            else:  # returns once committed (after waiting for the save still writing)
                save_checkpoint(state, path, metadata={"step": step})
    assert pending is not None and pending.done()
    return pending.result().name  # its path, or the error its writer met (on every rank)


if __name__ == "__main__":
    root = mkdtemp()
    print(run_processes(job, 2, root))  # ['step_00000003', 'step_00000003']
    print(run_processes(job, 4, root))  # resumes at step 6 on 4 ranks: ['step_00000009', ...]
    shard = Path(root) / "step_00000012" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1  # one flipped bit
    shard.write_bytes(bytes(data))
    try:  # what load_checkpoint checks as it reads, verify_checkpoint checks offline
        verify_checkpoint(Path(root) / "step_00000012")
    except CheckpointIntegrityError as exc:
        assert "__1_0.distcp" in str(exc)
    else:
        raise AssertionError("the flipped bit was not detected")
    print("ok")
