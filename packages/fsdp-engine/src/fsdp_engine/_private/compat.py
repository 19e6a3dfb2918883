"""The one place where the engine touches torch internals (torch 2.13).

[Note: why reuse torch's pieces]
- ``RegisterPostBackwardFunction``: FSDP2's autograd function over a module's forward inputs; its
  backward calls ``ctx.param_group.post_backward()`` once the inputs' gradients are computed,
  i.e. after the module's whole backward. We apply torch's own class (passing our state as the
  "param group") so that tools and tests that instrument FSDP2's post-backward see ours too; if
  torch moves it, an equivalent function of ours is used.
- the composable-API registry: ``replicate()`` skips the parameters of modules registered under
  "fully_shard" there; our modules are registered so that ``replicate(model)`` over
  ``fully_shard``-ed submodules leaves their parameters to us, like FSDP2.
- ``_apply_to_tensors``: the container traversal DDP/FSDP use for forward inputs (lists, dicts,
  namedtuples, dataclasses).
- the autograd engine: whether a backward is running (activation-checkpoint recompute runs
  forwards inside backward), and its final callback (the root's end of backward).
- DTensor: a DTensor over a local tensor from a spec built once (``from_local``'s per-rank
  checks cost a Python step per rank at scale), its local tensor and spec; a DeviceMesh of a
  data-parallel and a tensor-parallel mesh (``_concatenate``).
- ``_unsafe_preserve_version_counter``: refilling memory autograd saved, as FSDP2's copy-out.
- a module's registered parameters (``_parameters``) and a parameter's post-accumulate hooks.

Each is looked up once, at import, against the torch version it was written for
(``SUPPORTED``): another version or a missing or changed name does not fail at import but is
reported by ``compat_status()`` and the tests (``test_engine_compat.py``), which check every
entry is the torch object it stands for.
"""

from __future__ import annotations

import contextlib
import importlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ragged_dtensor import own_storage_view

__all__ = [
    "SUPPORTED",
    "PostBackwardFunction",
    "apply_to_tensors",
    "compat_status",
    "composable_apis",
    "concatenate_meshes",
    "dtensor_from_spec",
    "flatten_mesh",
    "has_backend_for",
    "in_backward",
    "graph_task_id",
    "is_view",
    "local_tensor",
    "mark_fully_sharded",
    "offset_free",
    "post_accumulate_grad_hooks",
    "preserve_version_counter",
    "profiler_enabled",
    "queue_backward_callback",
    "registered_param",
    "set_local_tensor",
    "set_registered_param",
    "set_spec",
    "sharded_parameter",
    "spec_of",
    "starts_at",
]

SUPPORTED = "2.13"  # the torch release every entry below was checked against
_STATUS: dict[str, str] = {
    "torch": torch.__version__ if torch.__version__.startswith(SUPPORTED) else "unsupported"
}


class _OwnPostBackward(torch.autograd.Function):
    """Identity on the forward inputs; its backward runs ``state.post_backward()``."""

    @staticmethod
    def forward(ctx: Any, state: Any, *inputs: torch.Tensor) -> Any:
        ctx.param_group = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.param_group.post_backward()
        return (None, *grads)


def _torch_post_backward() -> Any:
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    except ImportError:  # pragma: no cover - torch moved it
        return None
    fn = getattr(_fsdp_param_group, "RegisterPostBackwardFunction", None)
    if fn is None or not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
        return None  # pragma: no cover
    return fn


_TORCH_POST_BACKWARD = _torch_post_backward()
PostBackwardFunction: Any = _TORCH_POST_BACKWARD or _OwnPostBackward
_STATUS["post_backward_function"] = "torch" if _TORCH_POST_BACKWARD is not None else "own"


def _registry_tools() -> tuple[Any, Any] | None:
    try:  # the module (the package re-exports a function of the same name)
        contract = importlib.import_module("torch.distributed._composable.contract")
    except ImportError:  # pragma: no cover
        return None
    key = getattr(contract, "REGISTRY_KEY", None)
    item = getattr(contract, "RegistryItem", None)
    if not isinstance(key, str) or item is None:
        return None  # pragma: no cover
    return key, item


_REGISTRY = _registry_tools()
_STATUS["composable_registry"] = "marked" if _REGISTRY is not None else "unavailable"


def mark_fully_sharded(module: nn.Module) -> None:
    """Register ``module`` under "fully_shard" in torch's composable-API registry."""
    if _REGISTRY is None:  # pragma: no cover
        return
    key, item = _REGISTRY
    registry = module.__dict__.setdefault(key, OrderedDict())
    registry.setdefault("fully_shard", item())


def composable_apis(module: nn.Module) -> tuple[str, ...]:
    """The composable APIs applied to ``module`` by name, as torch's registry records them
    ("fully_shard" for torch's FSDP2 and for ours, "replicate", ...)."""
    if _REGISTRY is None:  # pragma: no cover
        return ()
    registry = module.__dict__.get(_REGISTRY[0])
    return tuple(registry) if isinstance(registry, dict) else ()


def _torch_apply_to_tensors() -> Any:
    try:
        from torch.distributed.utils import _apply_to_tensors
    except ImportError:  # pragma: no cover
        return None
    return _apply_to_tensors


_APPLY = _torch_apply_to_tensors()
_STATUS["apply_to_tensors"] = "torch" if _APPLY is not None else "pytree"


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], container: Any) -> Any:
    """``fn`` on every tensor of a nested container (dataclasses included), rebuilt."""
    if _APPLY is not None:
        return _APPLY(fn, container)
    from torch.utils._pytree import tree_map  # pragma: no cover

    return tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, container)


# -- the autograd engine ----------------------------------------------------------------------
_GRAPH_TASK_ID: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)
_STATUS["graph_task_id"] = "torch" if _GRAPH_TASK_ID is not None else "unavailable"


def profiler_enabled() -> bool:
    """Whether a profiler (``torch.profiler.profile`` or the autograd profiler) is recording:
    only then does a ``record_function`` range end up anywhere."""
    return bool(torch._C._autograd._profiler_enabled())


def in_backward() -> bool:
    """True while autograd runs a backward pass (on this thread)."""
    return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1


def graph_task_id() -> int:
    """The id of the backward pass running on this thread (-1 outside one); a reentrant
    checkpoint's backward runs a graph task of its own."""
    return _GRAPH_TASK_ID() if _GRAPH_TASK_ID is not None else -1


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass has finished (FSDP2's final callback)."""
    Variable._execution_engine.queue_callback(callback)


# -- DTensor and DeviceMesh internals ---------------------------------------------------------
def dtensor_from_spec(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor over ``local``'s elements (no copy) with ``spec``, as DTensor's own no-autograd
    constructors build it (no per-rank check), its local tensor over storage of its own at
    offset 0 ([Note: DTensors over views])."""
    local = own_storage_view(local)
    if local.storage_offset() == 0:
        return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]
    # meta (no data): the wrapper alone is built at offset 0
    anchor = local.detach().as_strided(local.size(), local.stride(), 0)
    value = DTensor(anchor, spec, requires_grad=False)  # type: ignore[no-untyped-call]
    value._local_tensor = local
    return value


def sharded_parameter(value: DTensor, requires_grad: bool) -> nn.Parameter:
    """``nn.Parameter(value, requires_grad)`` with its wrapper at storage offset 0 ([Note:
    DTensors over views]): ``nn.Parameter`` of a tensor subclass is ``value.detach()`` marked
    ``_is_param``, and the detach takes the local view's offset again."""
    param = nn.Parameter(offset_free(value), requires_grad)
    if param.storage_offset() == 0:
        return param
    assert isinstance(param, DTensor)
    rebuilt = offset_free(param)
    rebuilt._is_param = True  # nn.Parameter's mark on subclasses
    assert isinstance(rebuilt, nn.Parameter)
    return rebuilt


def offset_free(value: DTensor) -> DTensor:
    """[Note: DTensors over views]
    Our sharded parameters and gradients view one flat storage per group. torch saves and
    copies a view through its whole storage (``torch.save`` of one 4 KiB parameter wrote the
    rank's whole group shard), and a DTensor's wrapper takes its local tensor's storage offset
    over a null storage, reporting a non-zero ``data_ptr()`` that torch's serialization and
    copies read as "a tensor with storage" ("invalid python storage"). So every DTensor we
    make has a local tensor over storage of its own elements (``ragged_dtensor.
    own_storage_view``: the same memory, no copy), at offset 0: saves, pickles and copies of
    it, of its ``to_local()``, its ``detach()`` or a ``state_dict()`` entry see only its own
    elements, as FSDP2's parameters (each owns its padded storage), and its wrapper reports
    ``data_ptr() == 0``, as FSDP2's. Nothing of torch is changed for it. Where a local
    tensor has no data (meta), the wrapper alone is rebuilt at offset 0."""
    local = value._local_tensor
    own = own_storage_view(local)
    if own is local and value.storage_offset() == 0:
        return value
    rebuilt = dtensor_from_spec(own, value._spec)
    rebuilt.requires_grad_(value.requires_grad)
    return rebuilt


def starts_at(tensor: torch.Tensor, local: torch.Tensor) -> bool:
    """Whether ``tensor``'s data starts where ``local``'s does, in the same memory (either may
    be a view of the flat storage or a local tensor over storage of its own: [Note: DTensors
    over views])."""
    if tensor.device != local.device:
        return False
    if tensor.numel() and local.numel():
        return bool(tensor.data_ptr() == local.data_ptr())
    # nothing to alias: an empty local tensor is over an empty storage of its own
    return tensor.numel() == local.numel() == 0


def local_tensor(value: DTensor) -> torch.Tensor:
    """A DTensor's local tensor without autograd (``to_local`` records a graph node)."""
    return value._local_tensor


def set_local_tensor(value: DTensor, local: torch.Tensor) -> None:
    value._local_tensor = local


def spec_of(value: DTensor) -> DTensorSpec:
    return value._spec


def set_spec(value: DTensor, spec: DTensorSpec) -> None:
    value._spec = spec


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose axes are those of ``meshes``, slices of one parent mesh (e.g. the
    data-parallel and the tensor-parallel slices of a 2-D mesh)."""
    return DeviceMesh._concatenate(meshes)


_STATUS["concatenate_meshes"] = "torch" if hasattr(DeviceMesh, "_concatenate") else "missing"


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over every rank of ``mesh`` (a slice of several named dims), named ``name``
    (FSDP2 flattens several data-parallel dims of ``dp_mesh_dims`` this way)."""
    flat: DeviceMesh = mesh._flatten(name)
    return flat


_STATUS["flatten_mesh"] = "torch" if hasattr(DeviceMesh, "_flatten") else "missing"


# -- autograd's version counters --------------------------------------------------------------
def _torch_preserve() -> Any:
    try:
        from torch.autograd.grad_mode import _unsafe_preserve_version_counter
    except ImportError:  # pragma: no cover
        return None
    return _unsafe_preserve_version_counter


_PRESERVE = _torch_preserve()
_STATUS["preserve_version_counter"] = "torch" if _PRESERVE is not None else "missing"


def preserve_version_counter(tensor: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """Writes in the body do not move ``tensor``'s version counter (a refill of the same
    values that autograd saved; FSDP2's copy-out does the same)."""
    if _PRESERVE is None:  # pragma: no cover
        return contextlib.nullcontext()
    manager: contextlib.AbstractContextManager[Any] = _PRESERVE(tensor)
    return manager


# -- modules and parameters -------------------------------------------------------------------
def registered_param(module: nn.Module, attr: str) -> Any:
    """What ``module`` registers as parameter ``attr`` (None if nothing), without the
    ``__getattr__`` lookup."""
    return module._parameters.get(attr)


def set_registered_param(module: nn.Module, attr: str, param: nn.Parameter) -> None:
    """Register ``param`` as ``module.<attr>`` in place of what is there (FSDP2 swaps the
    sharded and unsharded parameters this way: no ``__setattr__`` checks)."""
    module._parameters[attr] = param


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor (autograd's ``_base``)."""
    return tensor._base is not None


def post_accumulate_grad_hooks(param: torch.Tensor) -> tuple[Callable[[torch.Tensor], Any], ...]:
    """The hooks ``param.register_post_accumulate_grad_hook`` registered, in order."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return tuple(hooks.values()) if hooks else ()


@contextlib.contextmanager
def no_grad_and_preserved(tensor: torch.Tensor) -> Iterator[None]:
    """``torch.no_grad`` with ``tensor``'s version counter preserved."""
    with torch.no_grad(), preserve_version_counter(tensor):
        yield


def has_backend_for(group: Any, device: torch.device) -> bool:
    """Whether ``group`` has a backend serving tensors of ``device`` (a capability check: a
    compound backend such as ``"cpu:gloo,cuda:nccl"`` serves both)."""
    try:
        group._get_backend(device)
    except (RuntimeError, ValueError, AttributeError):
        return False
    return True


def compat_status() -> dict[str, str]:
    from fsdp_engine._private.compat_fsdp2 import STATUS as FSDP2_STATUS

    return {**_STATUS, **FSDP2_STATUS}
