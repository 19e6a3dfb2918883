"""The model catalogue, the scale report's qualitative findings, and quality on real groups."""

from __future__ import annotations

import math

import pytest
from planner_testing import check_plan_independently

import shard_planner as sp
from shard_planner.projection import MODELS, catalogue_model
from shard_planner.projection._private.report import parse_granularity, report_rows

# Published parameter counts (base models, without DeepSeek's multi-token-prediction module).
PUBLISHED = {
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.55e9,
    "gpt-oss-120b": 116.8e9,
    "deepseek-v3-671b": 671.0e9,
    "qwen3-30b-a3b": 30.5e9,
}


@pytest.mark.parametrize("name", MODELS)
def test_parameter_counts_match_published_sizes(name: str) -> None:
    model = catalogue_model(name)
    assert model.numel == pytest.approx(PUBLISHED[name], rel=0.002)
    assert {g.name for g in model.groups} >= {"embed", "head"}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("rows", [1, 16, 32, 128])
@pytest.mark.parametrize("tile", [False, True])
def test_blocks_follow_the_documented_rule(name: str, rows: int, tile: bool) -> None:
    for group in catalogue_model(name).groups:
        for weight, spec in zip(group.weights, group.specs(rows, tile=tile), strict=True):
            assert spec.numel == weight.numel and spec.numel % spec.block == 0
            if not weight.matrix:
                assert spec.block == 1
                continue
            h, c = weight.shape[-2], weight.shape[-1]  # rows of one matrix of the stack
            block_rows = spec.block // c
            assert spec.block % c == 0 and h % block_rows == 0  # never across two matrices
            if tile:
                assert block_rows == (rows if h % rows == 0 else h)
            else:
                assert block_rows == math.gcd(rows, h)


def _tile_cut(weight_shape: tuple[int, ...], tile: int, cut_row: int) -> bool:
    """Whether a cut before flat row ``cut_row`` of a stack of matrices cuts a tile."""
    h = weight_shape[-2]
    return (cut_row % h) % tile != 0


@pytest.mark.parametrize("tile", [32, 128])
def test_tile_blocks_keep_every_per_expert_tile_whole(tile: int) -> None:
    """Regression: GPT-OSS's fused experts ([128, 2880, 5760], 2880 = 22.5 x 128) got 128-row
    blocks counted over the flattened stack, which straddle experts, so boundaries fell inside
    the per-expert 128 x 128 tiles. Every multiple of the block must be a tile-row boundary of
    one expert."""
    layer = catalogue_model("gpt-oss-120b").groups[1]
    for weight in layer.weights:
        if not weight.matrix:
            continue
        c = weight.shape[-1]
        block_rows = weight.block(tile, tile=True) // c
        total_rows = weight.numel // c
        for cut in range(block_rows, total_rows, block_rows):
            assert not _tile_cut(weight.shape, tile, cut), (weight.name, cut)
    fused = {w.name: w for w in layer.weights}["mlp.experts.gate_up_proj"]
    assert fused.block(128, tile=True) == 2880 * 5760  # whole experts: 128 does not divide 2880
    assert fused.block(32, tile=True) == 32 * 5760
    # the old rule: 128 rows of the flattened stack; its 23rd block starts inside expert 1's
    # tile row 0 (row 2944 = 2880 + 64), i.e. it cuts a tile
    assert _tile_cut(fused.shape, 128, 23 * 128)


def test_block_rule_examples() -> None:
    layer = next(g for g in catalogue_model("deepseek-v3-671b").groups if g.name == "moe_layer")
    by_name = {w.name: w for w in layer.weights}
    assert len(layer.weights) == 9 + 2 + 3 * 256 + 3
    # 576 rows: 128-row blocks do not tile it; gcd(128, 576) = 64 rows do.
    assert by_name["self_attn.kv_a_proj_with_mqa.weight"].block(128) == 64 * 7168
    gpt = catalogue_model("gpt-oss-120b").groups[1]
    fused = {w.name: w for w in gpt.weights}["mlp.experts.gate_up_proj"]
    assert fused.shape == (128, 2880, 5760) and fused.block(128) == 64 * 5760


def test_fsdp2_even_split_doubles_the_gpt_oss_expert_buffer_at_256_ranks() -> None:
    layer = catalogue_model("gpt-oss-120b").groups[1]
    experts = [w for w in layer.weights if w.name.startswith("mlp.experts.")]
    shapes = [w.shape for w in experts]
    at_128 = sp.fsdp2_layout(shapes, [1] * len(shapes), 128)
    at_256 = sp.fsdp2_layout(shapes, [1] * len(shapes), 256)
    assert at_128.padding_ratio == pytest.approx(0.0)
    assert at_256.padding_ratio == pytest.approx(1.0)  # 128 experts on 256 ranks: 2x buffer
    ours = sp.plan(layer.specs(1), 256, 8)
    assert ours.padding_ratio < 0.001


def test_report_reproduces_the_qualitative_findings() -> None:
    grans = [parse_granularity(t) for t in ("1", "16", "128")]
    rows = report_rows(["gpt-oss-120b"], [64, 256, 1024], grans)
    table = {(r.world_size, r.granularity): r for r in rows}
    # FSDP2's per-tensor even split pads GPT-OSS ~2x at 256 ranks (all groups together).
    assert table[(256, "1")].fsdp2 > 90.0
    # 128-row granularity makes padding jump with the world size (and the bound agrees).
    steps = [table[(m, "128")].lower_bound for m in (64, 256, 1024)]
    assert steps[0] < 2.0 < steps[1] < 10.0
    assert steps[2] > 50.0
    for r in rows:
        assert r.lower_bound <= r.ours + 1e-9
        assert r.ours <= min(r.naive, r.megatron, r.paper) + 1e-9
    # Where the naive layout pays ~17% for 128-row blocks at 64 ranks, we pay ~1.3% (= bound).
    assert table[(64, "128")].naive > 15.0
    assert table[(64, "128")].ours == pytest.approx(table[(64, "128")].lower_bound)


@pytest.mark.parametrize(
    ("name", "group", "rows", "world"),
    [
        ("gpt-oss-120b", "layer", 1, 256),
        ("gpt-oss-120b", "layer", 16, 64),
        ("deepseek-v3-671b", "moe_layer", 1, 1024),
        ("deepseek-v3-671b", "moe_layer", 16, 256),
        ("qwen3-30b-a3b", "layer", 16, 64),
        ("llama3-70b", "layer", 1, 1024),
    ],
)
def test_padding_within_half_a_point_of_the_bound(
    name: str, group: str, rows: int, world: int
) -> None:
    g = next(x for x in catalogue_model(name).groups if x.name == group)
    specs = g.specs(rows)
    p = sp.plan(specs, world, 8)
    p.validate()
    bound = sp.lower_bound(specs, world, 8)
    gap_points = 100.0 * world * (p.shard_size - bound) / g.numel
    assert gap_points <= 0.5
    assert p.shard_size <= sp.naive_plan(specs, world, 8).shard_size


def test_catalogue_plan_invariants_small_world() -> None:
    g = catalogue_model("llama3-8b").groups[1]
    specs = g.specs(16)
    p = sp.plan(specs, 8, 8)
    check_plan_independently(p, specs)


def test_unknown_model_and_granularity() -> None:
    with pytest.raises(ValueError, match="model must be one of"):
        catalogue_model("gpt-5")
    with pytest.raises(ValueError, match="block granularity 'x'"):
        parse_granularity("x")
    with pytest.raises(ValueError, match="block granularity '0'"):
        parse_granularity("0")
    assert parse_granularity("32x32").rows == 32 and parse_granularity("32x32").tile
    with pytest.raises(ValueError, match="square tile"):
        parse_granularity("32x16")
