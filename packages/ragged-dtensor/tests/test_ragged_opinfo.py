"""torch's OpInfo database runs on RaggedShard as on Shard(0): never wrong, never a crash.

Every entry's first samples run with every tensor operand distributed over dim 0, as the
``Shard(0)`` control and as ``RaggedShard`` (even rows, and rank 0 holding nothing); see
``ragged_opinfo.py`` for the outcomes and the tolerance. In CI: the common training list and a
fixed spread of other entries, two samples each, on 2 ranks. The whole database (five samples,
2 and 3 ranks) runs in the slow session; its table is in the package README
(``python packages/ragged-dtensor/tests/ragged_opinfo.py --world 2`` prints it).
"""

from __future__ import annotations

import pytest
import ragged_opinfo as opinfo

pytestmark = pytest.mark.numerics

RAGGED = ("ragged", "ragged_empty")
# The named gap of the "never a crash" target: entries that crash on RaggedShard, each crashing
# the same way on the Shard(0) control (checked), with why.
KNOWN_CRASHES = {
    "tensor_split": "split points given as a tensor of indices: DTensor's own rule reads the "
    "index tensor's data, which Shard(0) cannot give either",
}


def _entries(sample: bool) -> list[object]:
    entries = opinfo.opinfo_entries()
    if sample:
        return opinfo.deterministic_sample(entries, 8, opinfo.COMMON_TRAINING)
    return entries


def _check(table: dict[str, dict[str, tuple[str, str]]], kinds: tuple[str, ...] = RAGGED) -> None:
    bad = {
        name: {k: row[k] for k in kinds if k in row and row[k][0] in ("wrong", "crash")}
        for name, row in table.items()
    }
    bad = {name: kinds for name, kinds in bad.items() if kinds}
    for name in list(bad):
        base = name.rsplit(".", 1)[0]
        crashes = all(outcome[0] == "crash" for outcome in bad[name].values())
        if base in KNOWN_CRASHES and crashes and table[name].get("shard0", ("",))[0] == "crash":
            del bad[name]
    assert not bad, "\n".join(f"{n}: {k}" for n, k in sorted(bad.items()))
    counts = opinfo.summarize(table)
    control = counts["shard0"]["pass"] + counts["shard0"]["partial"]
    for kind in kinds:
        assert counts[kind]["pass"] + counts[kind]["partial"] >= control, counts
    names = set(opinfo.COMMON_TRAINING)
    failing = [
        (name, kind, row[kind])
        for name, row in table.items()
        if not name.endswith("_") and (name in names or name.rsplit(".", 1)[0] in names)
        for kind in kinds
        if kind in row and row[kind][0] != "pass"
    ]
    assert not failing, failing


def test_a_sample_of_the_opinfo_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """The common training list (forward, backward and optimizer ops) passes on RaggedShard
    with rank 0 holding nothing (the stricter layout; even units run in the slow session);
    no sampled entry is wrong or crashes; pass + partial at least Shard(0)'s."""
    monkeypatch.setattr(opinfo, "MAX_SAMPLES", 2)
    entries = _entries(sample=True)
    assert len(entries) >= len(opinfo.COMMON_TRAINING) - 5  # the names exist in op_db
    kinds = ("shard0", "ragged_empty")
    _check(opinfo.run_entries(entries, 2, kinds=kinds, inplace=False), kinds[1:])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_the_whole_opinfo_database(world: int) -> None:
    """Every entry with a usable float32 CPU sample, in place too: the same checks."""
    _check(opinfo.run_entries(_entries(sample=False), world))
