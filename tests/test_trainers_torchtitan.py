"""torchtitan's FSDP helpers on a small torchtitan LLaMA-3 built directly (its Trainer defaults
to CUDA), switched to fsdp_engine: ``apply_fsdp_to_decoder`` shards it with
``torchtitan.distributed.fsdp``'s ``fully_shard`` and ``MixedPrecisionPolicy``, then its
gradient-division switch sets ``set_gradient_divide_factor(1.0)`` on every module that is
``isinstance`` its ``FSDPModule``; its ``ChunkedLossWrapper`` unshards/reshards ``lm_head``
and toggles its gradient sync on the same check. 2 gloo processes, SGD (a gradient division
left on would halve every update), gradient accumulation 2, 3 steps. FSDP2 runs torchtitan's
divide factor 1.0 on gloo only with ``set_force_sum_reduction_for_comms(True)`` (its
``PREMUL_SUM`` is not a gloo op; ``torchtitan_run`` in ``trainer_workers.py``): ours is
compared with that setting and without it.

``torchtitan.distributed.fsdp`` binds FSDP2's names when it is imported, so both import
orders of [Note: the switch] are tested: imported before the switch and named to it
(``as_torch_fsdp(modules=["torchtitan.distributed.fsdp"])``, restored afterwards), and
imported after ``use_as_torch_fsdp()``. Every loss and every first-step gradient is bitwise
FSDP2's (kind (a) of [Note: comparisons of the trainer tests] in ``trainer_workers.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trainer_workers as tw

from ragged_dtensor.testing import run_processes

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def named() -> list[dict[str, Any]]:
    return run_processes(tw.run_torchtitan, 2, "named", timeout=900, env=tw.ENV)


def _assert_same(ours: dict[str, Any], fsdp2: dict[str, Any]) -> None:
    assert ours["losses"] == fsdp2["losses"]
    assert ours["grads"].keys() == fsdp2["grads"].keys()
    for name, grad in fsdp2["grads"].items():
        assert torch.equal(ours["grads"][name], grad), name


def test_torchtitan_named_module_trains_bitwise_like_fsdp2(named: list[dict[str, Any]]) -> None:
    for result in named:
        assert result["fsdp2"]["engine"] == "fsdp2"
        assert result["ours"]["engine"] == "ours"
        _assert_same(result["ours"], result["fsdp2"])
        # torchtitan's setting as it is (FSDP2 needs force-sum on gloo: trainer_workers.py)
        assert result["ours as torchtitan sets it"]["engine"] == "ours"
        _assert_same(result["ours as torchtitan sets it"], result["fsdp2"])
        assert result["restored"]  # torchtitan's module holds torch's objects again


def test_torchtitan_imported_after_the_switch_trains_bitwise_like_fsdp2(
    named: list[dict[str, Any]],
) -> None:
    switched = run_processes(tw.run_torchtitan, 2, "switch-first", timeout=900, env=tw.ENV)
    for rank, result in enumerate(switched):
        assert result["ours"]["engine"] == "ours"
        _assert_same(result["ours"], named[rank]["fsdp2"])
