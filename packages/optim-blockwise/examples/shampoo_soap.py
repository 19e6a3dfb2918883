import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import optim_blockwise as ob
from ragged_dtensor import RaggedShard
from ragged_dtensor.testing import run_threaded

policy = ob.Shampoo.block_policy(max_preconditioner_dim=32)
assert policy("w", torch.empty(96, 40)) == 32 * 40  # bands of 32 rows: never cut


def train(rank: int, world: int, kind: str) -> torch.Tensor:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(96, 40, generator=torch.Generator().manual_seed(0))
    placement = RaggedShard((0,), (1, 2))  # units of 32 rows: rank 0 rows 0-31, rank 1 32-95
    r = placement.flat_range(full.shape, rank)

    def sharded(t: torch.Tensor) -> DTensor:
        local = t.reshape(-1)[r.start : r.stop].clone()
        return DTensor.from_local(local, mesh, [placement], shape=t.shape, stride=t.stride())

    weight = torch.nn.Parameter(sharded(full))
    kw = {"lr": 1e-2, "max_preconditioner_dim": 32, "precondition_frequency": 2}
    opt = ob.Shampoo([weight], **kw) if kind == "shampoo" else ob.SOAP([weight], **kw)
    for step in range(4):
        weight.grad = sharded(torch.randn(96, 40, generator=torch.Generator().manual_seed(step)))
        opt.step()
        assert opt.last_step_stats["collectives"] == 0  # every 32 x 32 tile is local
    return weight.to_local()


for kind in ("shampoo", "soap"):
    print(kind, torch.cat(run_threaded(train, 2, kind)).shape)  # torch.Size([3840])
