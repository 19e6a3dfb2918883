"""What the example scripts share (``demo.py``, ``hf_train.py``): a collective tally at the
dispatcher, the tensors a run keeps alive (for the live-memory tally), and argparse validators
that end a bad value with one line and exit status 2."""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CollectiveTally",
    "OneLineErrorParser",
    "mib",
    "non_negative_int",
    "persistent_tensors",
    "positive_float",
    "positive_int",
]


class CollectiveTally(TorchDispatchMode):
    """Counts collectives at the dispatcher (``c10d`` / ``_c10d_functional`` ops), whoever issues
    them, and the bytes of their input tensors. Barriers and waits are not counted."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower to plain-tensor collectives first
        if isinstance(func, torch._ops.OpOverload) and func.namespace in (
            "c10d",
            "_c10d_functional",
        ):
            name = func.__name__.split(".")[0]
            if "barrier" not in name and "wait" not in name and "monitored" not in name:
                self.calls[name] = self.calls.get(name, 0) + 1
                self.bytes[name] = self.bytes.get(name, 0) + _input_bytes(name, args)
        return func(*args, **kwargs)

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def _input_bytes(name: str, args: Any) -> int:
    """Bytes this rank contributes: the input tensor(s) of the collective."""

    # c10d ops take (outputs, inputs, ...) for gathers/scatters, (tensors, ...) for the rest
    def size(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, list | tuple):
            return sum(size(v) for v in value)
        return 0

    if not args:
        return 0
    gather_like = ("allgather", "all_gather", "reduce_scatter", "alltoall")
    if len(args) > 1 and any(k in name for k in gather_like):
        return size(args[1])  # (outputs, inputs, ...): what this rank puts in
    return size(args[0])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def persistent_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(_local(p))
        if p.grad is not None:
            out.append(_local(p.grad))
    for state in opt.state.values():
        out.extend(_local(v) for v in state.values() if isinstance(v, torch.Tensor))
    # ours: the parameters' local tensors view their group's shard storage, which the tally
    # counts whole; gradient storage lives only while a .grad views it (both above)
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


# -- command lines ---------------------------------------------------------------------------


def positive_int(text: str) -> int:
    value = _parse_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _parse_int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not the whole usage block
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")
