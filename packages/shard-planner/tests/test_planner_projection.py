"""The projection and the advisor on the catalogue (no torch: these run in the package's venv).

The measured validation (engine peaks under the fake process group, gloo timings) lives in the
repository's root tests, which have torch.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shard_planner.projection as proj
from shard_planner.projection._private.activations import activation_bytes, forward_flops
from shard_planner.projection._private.cli import main

WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@pytest.mark.parametrize("name", proj.MODELS)
def test_every_catalogue_model_projects_from_8_to_16384(name: str) -> None:
    model = proj.catalogue_model(name)
    setup = proj.Setup(activation_checkpointing=True)
    previous_shards = math.inf
    for m in WORLDS:
        p = proj.project(model, m, proj.GPUS["H100"], setup)
        for e in (p.ours, p.fsdp2):
            parts = dict(e.breakdown)
            assert e.peak_bytes == pytest.approx(sum(parts.values()), abs=16)
            assert e.step_s > e.compute_s > 0 and e.optimizer_s > 0
            assert e.padding_ratio >= 0
            assert math.isfinite(e.step_s)
        # shards shrink with the world size (no padding explosion for ours at block 1)
        assert dict(p.ours.breakdown)["parameter shards"] <= previous_shards
        previous_shards = dict(p.ours.breakdown)["parameter shards"]
        assert p.ours.padding_ratio < 0.5


def test_paper_finding_gpt_oss_fsdp2_fits_128_not_256_ours_both() -> None:
    """veScale-FSDP's GPT-OSS-120B result (REFERENCE.md section 5): FSDP2 fits 80 GB at 128
    ranks and not at 256 (128 experts over 256 ranks: the even split pads the expert buffers to
    twice their size); ours fits at both. Setup stated: seq 4096, micro-batch 1, bf16 compute
    and reduction (FSDP2's default with ``param_dtype=bf16``), fp32 parameters, AdamW."""
    model = proj.catalogue_model("gpt-oss-120b")
    gpu = proj.GPUS["H800"]
    setup = proj.Setup(seq=4096, micro_batch=1, reduce_bytes=2)
    at = {m: proj.project(model, m, gpu, setup) for m in (128, 256)}
    budget = gpu.usable_bytes
    assert at[128].fsdp2.fits(budget) and not at[256].fsdp2.fits(budget)
    assert at[128].ours.fits(budget) and at[256].ours.fits(budget)
    assert at[256].fsdp2.padding_ratio > 0.9 and at[256].ours.padding_ratio < 0.001
    # the mechanism: FSDP2's gathered buffers double from 128 to 256, ours stay the layer
    gathered = {m: dict(p.fsdp2.breakdown)["gathered parameters"] for m, p in at.items()}
    assert gathered[256] > 1.9 * gathered[128]
    ours = {m: dict(p.ours.breakdown)["gathered parameters"] for m, p in at.items()}
    assert ours[256] == pytest.approx(ours[128], rel=0.01)


def test_activation_formula_by_hand() -> None:
    """LLaMA-3-8B, bf16: the terms of the activations Note, added up by hand."""
    layer = proj.catalogue_model("llama3-8b").groups[1]
    h, q, kv, f, heads, c = 4096, 4096, 1024, 14336, 32, 2
    attention = 2 * h * c + 4 + (q + 2 * kv) * c + q * c + heads * 4
    mlp = 2 * h * c + 4 + 4 * f * c
    assert activation_bytes(layer, c) == attention + mlp
    assert activation_bytes(layer, c, checkpointing=True) == h * c
    # forward FLOPs: 2 x weights + causal attention 2 * seq * (d_qk + d_v) / 2
    weights = 2 * q * h + 2 * kv * h + 3 * f * h
    assert forward_flops(layer, 4096) == 2 * weights + 4096 * (q + q)


def test_moe_flops_count_active_experts_only() -> None:
    layer = proj.catalogue_model("qwen3-30b-a3b").groups[1]
    s = layer.layer
    assert s is not None and s.top_k == 8 and s.experts == 128
    dense = sum(w.numel for w in layer.weights if w.matrix and "experts." not in w.name)
    expert = 3 * s.expert_ffn * s.hidden
    assert forward_flops(layer, 1) == pytest.approx(
        2 * (dense + s.top_k * expert) + 1 * (s.q_dim + s.v_dim)
    )


def test_hsdp_and_grouping_change_what_they_should() -> None:
    model = proj.catalogue_model("llama3-70b")
    gpu = proj.GPUS["H100"]
    setup = proj.Setup(activation_checkpointing=True, block_rows=16)
    fsdp = proj.project(model, 4096, gpu, setup)
    hsdp = proj.project(model, 4096, gpu, setup, shard_ranks=256)
    assert hsdp.replicas == 16 and hsdp.ours.padding_ratio < fsdp.ours.padding_ratio
    assert (
        dict(hsdp.ours.breakdown)["parameter shards"]
        > dict(fsdp.ours.breakdown)["parameter shards"]
    )
    grouped = proj.project(model, 4096, gpu, setup, shard_ranks=256, layers_per_group=4)
    assert grouped.ours.padding_ratio < hsdp.ours.padding_ratio
    assert sum(g.count for g in grouped.ours.groups) == 2 + 80 // 4
    with pytest.raises(ValueError, match="divisor of the world size"):
        proj.project(model, 4096, gpu, setup, shard_ranks=3)


def test_advisor_at_16384_ranks_picks_hsdp_and_grouping_and_says_why() -> None:
    """LLaMA-3-70B at 16-row blocks pads 76.7% per layer at m=4096: the advice must be a
    smaller shard group, with layers stacked where one layer still pads over 1%."""
    model = proj.catalogue_model("llama3-70b")
    setup = proj.Setup(activation_checkpointing=True, block_rows=16)
    advice = proj.advise(model, 16384, proj.GPUS["H100"], setup)
    chosen = advice.chosen
    assert chosen is not None
    assert chosen.padding_ratio <= 0.01 and chosen.peak_bytes <= advice.budget_bytes
    assert chosen.replicas > 1 and chosen.shard_ranks < 16384
    for c in advice.candidates:
        if c is not chosen and c.acceptable:
            assert c.step_s >= chosen.step_s
    text = advice.explain()
    assert "rejected: padding over 1%" in text and "rejected: needs" in text
    assert "-> shard" in text
    groups = advice.module_groups(model.layers)
    flat = [n for g in groups for n in g]
    assert flat.count("embed") == 1 and flat.count("head") == 1
    assert [int(n) for n in flat if n.isdigit()] == list(range(80))
    assert advice.mesh_shape == (chosen.replicas, chosen.shard_ranks)


def test_advisor_reports_when_nothing_fits() -> None:
    advice = proj.advise(
        proj.catalogue_model("llama3-70b"), 8, proj.GPUS["H100"], proj.Setup(), budget_bytes=10**9
    )
    assert advice.chosen is None and "no candidate fits" in advice.explain()
    with pytest.raises(ValueError, match="no mesh fits"):
        advice.mesh_shape  # noqa: B018
    with pytest.raises(ValueError, match="does not divide the world size 8"):
        proj.advise(proj.catalogue_model("llama3-8b"), 8, proj.GPUS["H100"], shard_choices=[3])


def test_setup_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match=r"Setup\.mfu"):
        proj.Setup(mfu=0)
    with pytest.raises(ValueError, match=r"Setup\.optimizer"):
        proj.Setup(optimizer="lion")
    with pytest.raises(ValueError, match=r"Setup\.seq"):
        proj.Setup(seq=0)


def test_gpu_specs_name_their_sources() -> None:
    for gpu in proj.GPUS.values():
        assert gpu.source and gpu.memory_bytes > gpu.usable_bytes > 0
    assert set(proj.GPUS) == {"H100", "H800", "H200", "B200"}
    assert proj.GPUS["H800"].nvlink_bytes_per_s < proj.GPUS["H100"].nvlink_bytes_per_s
    for net in proj.NETWORKS.values():
        assert net.source and net.inter_bytes_per_s == 50e9


def test_project_and_advise_commands(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["project", "--model", "gpt-oss-120b", "--world", "128,256", "--gpu", "H800"]
    assert main([*args, "--reduce-dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "| gpt-oss-120b | 128 | 1x128 |" in out and "| yes / yes |" in out
    assert "| gpt-oss-120b | 256 | 1x256 |" in out and "| yes / no |" in out
    assert main([*args, "--format", "json", "--activation-checkpointing"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["world"] for r in rows] == [128, 256]
    assert rows[0]["setup"]["activation_checkpointing"] is True
    assert set(rows[0]["ours"]["breakdown"]) >= {"parameter shards", "activations"}
    adv = ["advise", "--model", "llama3-70b", "--world", "16384", "--gpu", "H100"]
    assert main([*adv, "--block-rows", "16", "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "advice: init_device_mesh(device, (" in out and "fully_shard groups" in out
    assert main([*adv, "--budget-gb", "1"]) == 1
    assert main(["project", "--model", "llama3-8b", "--world", "8", "--mfu", "2"]) == 2


def test_plot_command_writes_pngs(tmp_path: Path) -> None:
    out = tmp_path / "plots"
    assert main(["plot", "--model", "llama3-8b", "--world", "8,64,1024", "--out", str(out)]) == 0
    png = out / "projection_llama3-8b.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _shared_configs() -> Path:
    """The project's shared model configs: ``$SHARD_PLANNER_MODEL_CONFIGS``, else
    ``../shared/data/model-configs.json`` from the repository root (where CI has it), else
    ``/work/shared/data/model-configs.json``."""
    env = os.environ.get("SHARD_PLANNER_MODEL_CONFIGS")
    root = Path(__file__).resolve().parents[3]
    tried = [Path(env)] if env else []
    tried += [root.parent / "shared" / "data" / "model-configs.json"]
    tried += [Path("/work/shared/data/model-configs.json")]
    for path in tried:
        if path.is_file():
            return path
    pytest.fail(
        "model-configs.json not found; tried "
        + ", ".join(str(p) for p in tried)
        + " (set SHARD_PLANNER_MODEL_CONFIGS to its path)"
    )


def test_embedded_configs_equal_the_shared_data() -> None:
    """The package embeds the hyper-parameters (so ``pip install shard-planner`` alone works);
    they must be the project's shared ones, key for key."""
    shared = json.loads(_shared_configs().read_text(encoding="utf-8"))
    names = {k for k in shared if not k.startswith("_")}
    assert names == set(proj.MODELS)
    from shard_planner.projection._private.catalogue import CONFIGS

    for name in names:
        published = {k: v for k, v in shared[name].items() if not k.startswith("_")}
        assert CONFIGS[name] == published, name


def test_projection_and_advice_never_import_torch() -> None:
    """``pip install shard-planner`` alone is enough: the commands run without torch."""
    code = (
        "import sys; from shard_planner.projection._private.cli import main; "
        "assert main(['project', '--model', 'llama3-8b', '--world', '8,16384']) == 0; "
        "assert main(['advise', '--model', 'llama3-8b', '--world', '64']) == 0; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "advice: init_device_mesh" in done.stdout
