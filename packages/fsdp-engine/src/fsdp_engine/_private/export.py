"""Export: a sharded checkpoint of any world size as one full (unsharded) state dict.

[Note: export without a process group]
A checkpoint written by ``save_checkpoint`` holds each parameter as the chunks its ranks owned
(``RaggedShard`` ranges, or FSDP2's dim-0 rows), described in DCP's metadata by the global
shape, dtype and the offset of every chunk. To publish a model (``save_pretrained``, a
``torch.save`` file, an inference server) one process needs the global tensors: it allocates
each selected tensor at its global shape from the metadata and lets DCP's reader copy every
stored chunk into place. No process group and no model are needed, so export runs anywhere
(a login node, a CPU-only machine) after training; it holds the whole selected state in memory,
once.

The keys are DCP's flattened names: a checkpoint saved as ``{"model": model_sd, "optim": ...}``
names parameters ``model.<fqn>``; ``prefix="model."`` selects the model and strips the prefix.
``torch.compile``'s wrapper module adds an ``_orig_mod`` component to the names of the modules it
wraps (``layers.0._orig_mod.mlp.weight``); it is removed, so the names are those of the eager
model whichever way the blocks were compiled.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from fsdp_engine._private.checkpoint import CheckpointError, checkpoint_info

__all__ = ["load_full_state_dict"]

_COMPILE_WRAPPER = "_orig_mod"


def _eager_name(name: str) -> str:
    """The name without ``torch.compile`` wrapper components (see the module note)."""
    return ".".join(part for part in name.split(".") if part != _COMPILE_WRAPPER)


def load_full_state_dict(
    path: str | os.PathLike[str],
    *,
    prefix: str = "",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The full tensors of the committed checkpoint ``path`` whose names start with ``prefix``.

    Not collective: one process reads the chunks every rank wrote (any world size, any
    layout) into plain CPU tensors of the global shape. Names lose ``prefix`` and any
    ``_orig_mod`` component (``torch.compile``'s wrapper). ``dtype`` casts floating-point
    tensors (e.g. ``torch.bfloat16`` for publishing); ``None`` keeps the stored dtype, so the
    values are the trained parameters bit for bit.

    Raises ``IncompleteCheckpointError`` for a directory without the commit marker and
    ``CheckpointError`` when no tensor has the prefix or two names collide after stripping.
    """
    directory = Path(path)
    checkpoint_info(directory)  # IncompleteCheckpointError, naming the path, unless committed
    reader = FileSystemReader(directory)
    metadata = reader.read_metadata()
    selected: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata):
            selected[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if not selected:
        found = sorted(metadata.state_dict_metadata)
        shown = ", ".join(repr(k) for k in found[:5]) + (" ..." if len(found) > 5 else "")
        raise CheckpointError(
            f"load_full_state_dict: no tensor in {str(directory)!r} has a name starting with "
            f"{prefix!r} (names found: {shown})"
        )
    dcp_load(selected, storage_reader=reader, no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in selected.items():
        name = _eager_name(key[len(prefix) :])
        if name in out:
            raise CheckpointError(
                f"load_full_state_dict: {key!r} and another tensor both map to {name!r} in "
                f"{str(directory)!r} after removing the prefix and '{_COMPILE_WRAPPER}' parts"
            )
        cast = dtype is not None and tensor.is_floating_point()
        out[name] = tensor.to(dtype) if cast else tensor
    return out
