"""``torch.compile`` of Hugging Face decoder layers with ``fsdp_engine.fully_shard`` on CPU.

- Graph breaks per block (``torch._dynamo.explain``) of layer 0 of each model: the plain HF
  layer, and the layer after ``fully_shard`` when dynamo traces the module call with its hooks
  (``module.compile()`` in place), ours and FSDP2. Like FSDP2's, our hooks run under
  ``torch._dynamo.disable`` while dynamo traces, so they add no break (asserted). Measured with
  transformers 5.23.0 ((graphs, breaks) plain / ours / FSDP2): LLaMA (1, 0) for all three;
  Qwen3-MoE and GPT-OSS (7, 6) for all three, their 6 breaks the eager experts loop's
  data-dependent ``nonzero`` (HF's code, the same with any engine).
- torchtitan's way (``compile_layers``: the compiled layer replaces the layer *before*
  ``fully_shard``, so the hooks run outside the graph) with ``fullgraph=True`` and inductor
  trains LLaMA 20 steps at world size 2 to the eager losses within ``LOSS_TOL`` (``aot_eager``
  in CI, ``inductor`` in ``nox -s hf_slow``): inductor fuses
  and reorders reductions no longer than ``K = GLOBAL_BATCH * SEQ`` terms (hidden 128, vocab
  ~100, 256 tokens), the bound of kind (b) in ``hf_workers.py``. The MoE models (whose eager
  experts loop over data-dependent experts and so cannot be one graph) compile with graph breaks
  in the ``slow`` session (``nox -s hf_slow``).
"""

from __future__ import annotations

from typing import Any

import hf_workers as hw
import pytest
import torch
from torch.distributed.tensor import init_device_mesh

from ragged_dtensor.testing import run_processes

pytestmark = pytest.mark.multiprocess

OUR_CODE = ("fsdp_engine", "dbuffer", "ragged_dtensor")


def _explain(module: torch.nn.Module, args: Any, kwargs: Any) -> dict[str, Any]:
    torch._dynamo.reset()
    out = torch._dynamo.explain(module)(*args, **kwargs)
    reasons = []
    for reason in out.break_reasons:
        where = [f"{f.filename}:{f.lineno} {f.name}" for f in reason.user_stack]
        reasons.append({"reason": str(reason.reason).splitlines()[0][:200], "stack": where})
    return {"graphs": out.graph_count, "breaks": out.graph_break_count, "reasons": reasons}


def _graph_breaks(rank: int, world: int, names: list[str]) -> dict[str, dict[str, Any]]:
    import hf_models as hf

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    found: dict[str, dict[str, Any]] = {}
    for name in names:
        found[name] = {}
        for engine in ("plain", "ours", "fsdp2"):
            model = hf.build_model(hw.config(name), seed=hw.SEED)
            layer = hf.decoder_layers(model)[0]
            seen: dict[str, Any] = {}

            def grab(module: Any, args: Any, kwargs: Any, seen: dict[str, Any] = seen) -> None:
                seen.setdefault("inputs", (args, kwargs))

            handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
            if engine != "plain":
                hf.shard_model(model, hw._fully_shard(engine), mesh=mesh)
            model(input_ids=hw.probe_input())  # the layer's real inputs (and lazy init)
            handle.remove()
            args, kwargs = seen["inputs"]
            found[name][engine] = _explain(layer, args, kwargs)
    torch._dynamo.reset()
    return found


@pytest.mark.parametrize(
    "names",
    [
        # CI budget (16 s): the fullgraph compile test keeps compiled layers in CI
        pytest.param(["llama"], id="llama", marks=pytest.mark.slow),
        # explain() traces every data-dependent expert iteration: minutes on 2 cores
        pytest.param(["moe", "gpt-oss"], id="moe-gpt-oss", marks=pytest.mark.slow),
    ],
)
def test_graph_breaks_per_block(names: list[str]) -> None:
    results = run_processes(_graph_breaks, 2, names, timeout=600, env=hw.ENV)
    for name in names:  # the same graphs on both ranks
        for engine, value in results[0][name].items():
            assert value["breaks"] == results[1][name][engine]["breaks"], (name, engine)
    table = results[0]
    print("\ngraph breaks of decoder layer 0 (torch._dynamo.explain):")
    for name in names:
        row = {engine: (v["graphs"], v["breaks"]) for engine, v in table[name].items()}
        print(f"  {name}: (graphs, breaks) {row}")
        for engine, value in table[name].items():
            for reason in value["reasons"]:
                print(f"    {engine}: {reason['reason']} @ {reason['stack'][-1:]}")
    for name in names:
        plain, ours, fsdp2 = (table[name][e] for e in ("plain", "ours", "fsdp2"))
        assert fsdp2["breaks"] == plain["breaks"], (name, fsdp2, plain)
        # our hooks are hidden from dynamo (as FSDP2's are): no break of ours, none added
        ours_only = [r for r in ours["reasons"] if any(c in r["stack"][-1] for c in OUR_CODE)]
        assert ours["breaks"] == plain["breaks"] and not ours_only, (name, ours["reasons"])
    if "llama" in table:
        assert table["llama"]["plain"]["breaks"] == 0  # a LLaMA layer is one graph


@pytest.mark.parametrize(
    "backend",
    [
        # AOTAutograd traces forward and backward as one graph each, without code generation:
        # the fast proof that fullgraph=True holds with our engine (CI)
        "aot_eager",
        # inductor's C++ code generation costs minutes per layer shape on 2 cores: `hf_slow`
        pytest.param("inductor", marks=pytest.mark.slow),
    ],
)
def test_llama_fullgraph_layers_compiled_before_fully_shard(backend: str) -> None:
    compiled_kwargs = {"backend": backend, "fullgraph": True}
    eager, compiled = hw.run(
        2,
        {"name": "llama", "engine": "ours"},
        {"name": "llama", "engine": "ours", "compile_kwargs": compiled_kwargs},
        timeout=1500,
    )
    for result in compiled:
        hw.assert_losses_close(result["losses"], eager[0]["losses"], f"llama {backend} vs eager")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe", "gpt-oss"])
def test_moe_inductor_layers_before_fully_shard(name: str) -> None:
    eager, compiled = hw.run(
        2,
        {"name": name, "engine": "ours"},
        {"name": name, "engine": "ours", "compile_kwargs": {"backend": "inductor"}},
        timeout=1500,
    )
    for result in compiled:
        hw.assert_losses_close(result["losses"], eager[0]["losses"], f"{name} inductor vs eager")
