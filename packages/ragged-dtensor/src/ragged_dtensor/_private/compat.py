"""The DTensor integration: the only module that changes torch's objects (torch 2.13.x).

[Note: nothing at import]
Importing ``ragged_dtensor`` (or a package built on it) changes nothing in torch. The integration
is installed when the first ``RaggedShard`` is constructed (``ensure_installed``, called by the
placement), or explicitly (``install_dtensor_integration``), and
``uninstall_dtensor_integration`` puts back the very objects it found.
Everything below is process-wide while installed, and nothing else in the package assigns to a
torch module, class or instance. (The hooks themselves are in ``compat_redistribute.py``,
``compat_dispatch.py`` and ``compat_distribute.py``; the checks and change records in
``compat_base.py``.)

[Note: what is patched, and why each has no public route]
DTensor in torch 2.13 has no plug-in point for a new placement: redistribution is a hard-coded chain
of is_replicate/is_shard/is_partial checks, and a foreign placement passed through it *silently*
returns wrong data (Replicate -> X keeps the full tensor). So exactly these entry points are
wrapped, each delegating to torch's own function unless a RaggedShard is involved:

1. ``redistribute_local_tensor``, bound by name in the three modules that call it
   (``_redistribute``, ``_dispatch``, ``_api``): ``DTensor.redistribute``, ``full_tensor``,
   autograd backward and the input redistribution of op dispatch. No extension point.
2. the sharding propagator of DTensor's op dispatcher (``propagate_op_sharding_non_cached`` and
   its per-thread cache ``propagate_op_sharding``, instance attributes): ops with a ragged operand
   get the rules of ``ops.py`` or an error. Registering per-op strategies is public-ish, but a
   strategy cannot describe a placement that is not Shard/Replicate/Partial.
3. the Python slow path of op dispatch (``_dispatch_get_local_results_slow_path``, an instance
   attribute of the dispatcher), where torch runs random ops: a random op on a ragged operand
   draws what one device draws (random.py). DTensor's RNG tracker is not pluggable.
4. DTensor's checkpoint protocol (``__create_write_items__``, ``__create_chunk_list__``,
   ``__get_tensor_shard__``): a ragged share is written as the few boxes its flat range covers
   (checkpoint.py). See [Note: why the checkpoint protocol stays on the class].

5. ``distribute_tensor``'s code object ([Note: distribute_tensor's code]): torch's own function
   cuts a RaggedShard share from the (source rank's) full tensor. No extension point: a placement
   that is not Shard/Replicate/Partial raises "unsupported placements".

[Note: a DTensor's data_ptr]
torch builds a DTensor's wrapper with its local tensor's ``storage_offset`` over a null storage,
so a DTensor over a view that starts at an offset reports ``data_ptr() == offset * itemsize``,
and torch's copying code (``Tensor.__deepcopy__``, ``Tensor.__reduce_ex__``, DCP's stager) reads
a non-zero value as "copy this tensor's storage" and fails ("invalid python storage"). Earlier
versions made every DTensor report 0 (``DTensor.data_ptr`` patched process-wide, FSDP2's and
everybody's). Nothing is patched now: a flat-buffer FSDP hands out local tensors over storage of
their own (``own_storage_view``, [Note: views over storage of their own] in views.py), at offset
0, so its DTensors report 0 as FSDP2's do, and every other DTensor behaves as torch makes it.

7. ``torch.distributed._state_dict_utils._distribute_tensors`` (module attribute; its only caller
   looks it up by name): the full-state-dict load with ``broadcast_from_rank0=True`` cuts each
   rank's share there as a box of the full tensor, which a flat share is not (state_dict.py,
   [Note: why torch's state-dict loader needs a hook]). No placement hook is consulted.

``DTensor.from_local`` is *not* patched: ``ragged_dtensor.from_local`` checks a ragged share;
torch's builds the DTensor unchecked when given ``shape=`` and ``stride=``.

[Note: distribute_tensor's code]
``distribute_tensor(full, param.device_mesh, param.placements)`` is how FSDP2 users load full
weights into sharded parameters and how parity checks compare them (torch's own FSDP2 tests do),
and they bind the name at import, long before a RaggedShard exists: rebinding module attributes
would miss them. So the function object keeps its identity and gets a trampoline as its code
object while the integration is installed; the trampoline runs ``ragged_dtensor``'s cut for a
RaggedShard and a private copy of torch's code (made at import, a read) for anything else. The
original code object is put back by ``uninstall_dtensor_integration``.

[Note: why the checkpoint protocol stays on the class]
DTensor hands the three checkpoint methods to its local tensor when the local tensor defines
them (torch's ``LocalShardsWrapper`` does this). That route needs every ragged DTensor's local
tensor to be of our type, and in torch 2.13 it cannot be: op dispatch (C++) wraps each op's
output around a plain ``torch.Tensor``, whatever the type of the inputs' local tensors
(``test_ragged_import_side_effects.py`` pins this), so ``torch.zeros_like(param)`` (optimizer
state), ``param.detach()`` or a redistribution would lose the protocol, and DCP would then write
a flat share as if it were the whole tensor. DCP's planners are public, but a planner is chosen
by each caller of ``dcp.save``/``dcp.load``/``async_save`` (FSDP2 code passes none), so ragged
state dicts would need a different call than FSDP2's. So the three methods are wrapped on the
class, like the hooks above: checked, reversible, delegating to torch for every other DTensor.

[Note: checks]
Before changing anything, ``install_dtensor_integration`` checks the torch version (2.13.x) and
that each target is torch's own function (defined in torch's source file under the expected module
and name, not a wrapper, with the expected parameters) or, for the propagator's cache, torch's own
cache of torch's own method. If any check fails, it raises ``DTensorIntegrationError`` naming the
target and changes nothing. ``uninstall_dtensor_integration`` first checks that our wrappers are
still in place (nobody wrapped them since), else it raises and changes nothing.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed import _state_dict_utils as state_dict_utils
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _api as dtensor_api
from torch.distributed.tensor import _dispatch as dtensor_dispatch
from torch.distributed.tensor import _redistribute as dtensor_redistribute
from torch.distributed.tensor import _sharding_prop as dtensor_sharding_prop

from ragged_dtensor._private import compat_base, handlers
from ragged_dtensor._private import debug as ragged_debug
from ragged_dtensor._private.compat_base import (
    _REFUSING,
    SUPPORTED_TORCH,
    DTensorIntegrationError,
    _Change,
    _check_version,
    _describe,
    _expect_not_on_instance,
    _expect_torch_function,
    _Originals,
)
from ragged_dtensor._private.compat_dispatch import (
    _CHECKPOINT_METHODS,
    _checkpoint_hook,
    _distribute_tensors_hook,
    _propagate_hook,
    _slow_path_hook,
)
from ragged_dtensor._private.compat_distribute import (
    _IMPL_NAME,
    _distribute_changes,
    torch_distribute,
)
from ragged_dtensor._private.compat_redistribute import (
    _redistribute_hook,
    ragged_redistribute_local,
)

__all__ = [
    "SUPPORTED_TORCH",
    "DTensorIntegrationError",
    "dtensor_integration",
    "dtensor_integration_installed",
    "ensure_installed",
    "hooks_installed",
    "install_dtensor_integration",
    "ragged_redistribute_local",
    "torch_distribute",
    "uninstall_dtensor_integration",
]

_REDISTRIBUTE_MODULES = (dtensor_redistribute, dtensor_dispatch, dtensor_api)


def _plan() -> tuple[_Originals, list[Any]]:
    """Check every target (raising before anything is changed) and describe the changes."""
    _check_version()
    changes: list[Any] = []
    redistribute_name = "torch.distributed.tensor._redistribute.redistribute_local_tensor"
    redistribute = _expect_torch_function(
        vars(dtensor_redistribute).get("redistribute_local_tensor"),
        redistribute_name,
        "torch.distributed.tensor._redistribute",
        "redistribute_local_tensor",
        ("local_tensor", "current_spec", "target_spec"),
    )
    for module in _REDISTRIBUTE_MODULES:
        where = f"{module.__name__}.redistribute_local_tensor"
        found = vars(module).get("redistribute_local_tensor")
        if found is not redistribute:
            raise DTensorIntegrationError(
                f"ragged_dtensor: {where} is not torch's {redistribute_name} but "
                f"{_describe(found)}; another library may have replaced it. {_REFUSING}"
            )
        changes.append(
            _Change(module, "redistribute_local_tensor", where, True, found, _redistribute_hook)
        )

    dispatcher = DTensor._op_dispatcher
    propagator = dispatcher.sharding_propagator
    prop_module = "torch.distributed.tensor._sharding_prop"
    where = "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached"
    _expect_not_on_instance(propagator, "propagate_op_sharding_non_cached", where)
    propagate = _expect_torch_function(
        propagator.propagate_op_sharding_non_cached,
        where,
        prop_module,
        "ShardingPropagator.propagate_op_sharding_non_cached",
        ("self", "op_schema"),
    )
    tensor_meta = _expect_torch_function(
        propagator._propagate_tensor_meta_non_cached,
        "DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_non_cached",
        prop_module,
        "ShardingPropagator._propagate_tensor_meta_non_cached",
        ("self", "op_schema"),
    )
    cache = vars(propagator).get("propagate_op_sharding")
    cached = getattr(getattr(cache, "cache", None), "__wrapped__", None)
    if type(cache) is not dtensor_sharding_prop.LocalLRUCache or not (
        isinstance(cached, types.MethodType)
        and cached.__func__ is propagate
        and cached.__self__ is propagator
    ):
        raise DTensorIntegrationError(
            "ragged_dtensor: DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding "
            f"is not torch's LocalLRUCache of its propagate_op_sharding_non_cached but "
            f"{cache!r}. {_REFUSING}"
        )
    changes.append(
        _Change(propagator, "propagate_op_sharding_non_cached", where, False, None, _propagate_hook)
    )
    changes.append(
        _Change(
            propagator,
            "propagate_op_sharding",
            "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding",
            True,
            cache,
            dtensor_sharding_prop.LocalLRUCache(_propagate_hook),
        )
    )

    where = "DTensor._op_dispatcher._dispatch_get_local_results_slow_path"
    _expect_not_on_instance(dispatcher, "_dispatch_get_local_results_slow_path", where)
    slow_path = _expect_torch_function(
        dispatcher._dispatch_get_local_results_slow_path,
        where,
        "torch.distributed.tensor._dispatch",
        "OpDispatcher._dispatch_get_local_results_slow_path",
        ("self", "op_call", "args", "op_info"),
    )
    changes.append(
        _Change(
            dispatcher, "_dispatch_get_local_results_slow_path", where, False, None, _slow_path_hook
        )
    )

    for name, parameters in _CHECKPOINT_METHODS.items():
        original = _expect_torch_function(
            vars(DTensor).get(name),
            f"torch.distributed.tensor.DTensor.{name}",
            "torch.distributed.tensor._api",
            f"DTensor.{name}",
            parameters,
        )
        changes.append(
            _Change(
                DTensor,
                name,
                f"torch.distributed.tensor.DTensor.{name}",
                True,
                original,
                _checkpoint_hook(name, original),
            )
        )
    changes.extend(_distribute_changes())
    where = "torch.distributed._state_dict_utils._distribute_tensors"
    distribute_tensors = _expect_torch_function(
        vars(state_dict_utils).get("_distribute_tensors"),
        where,
        "torch.distributed._state_dict_utils",
        "_distribute_tensors",
        ("local_state_dict", "keys", "device", "pg"),
    )
    changes.append(
        _Change(
            state_dict_utils,
            "_distribute_tensors",
            where,
            True,
            distribute_tensors,
            _distribute_tensors_hook,
        )
    )
    changes.extend(handlers.handler_changes(_REFUSING, DTensorIntegrationError))
    originals = _Originals(
        redistribute=redistribute,
        propagate=types.MethodType(propagate, propagator),
        tensor_meta=types.MethodType(tensor_meta, propagator),
        slow_path=types.MethodType(slow_path, dispatcher),
        distribute_tensors=distribute_tensors,
    )
    return originals, changes


# -- install / uninstall -----------------------------------------------------------------------

_LOCK = threading.RLock()
_CHANGES: list[Any] = []
_INSTALLED = False


def _clear_sharding_caches() -> None:
    """Forget the C++ fast path's cached sharding decisions (this thread's): those made with the
    integration must not answer without it, and the other way round. (The Python cache is the
    propagator's attribute: ours is dropped with the integration, torch's is put back.)"""
    torch._C._clear_DTensor_sharding_propagator_cache()


def install_dtensor_integration() -> None:
    """Install the DTensor integration (idempotent, all or nothing)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        originals, changes = _plan()
        compat_base._ORIGINALS = originals
        applied: list[Any] = []
        try:
            for change in changes:
                change.apply()
                applied.append(change)
            _clear_sharding_caches()
            ragged_debug.enter_from_env()
        except BaseException:
            for change in reversed(applied):
                change.undo()
            compat_base._ORIGINALS = None
            raise
        _CHANGES[:] = changes
        _INSTALLED = True


def ensure_installed() -> None:
    """Install the integration unless it is installed (the placement calls this)."""
    if not _INSTALLED:
        install_dtensor_integration()


def uninstall_dtensor_integration() -> None:
    """Remove the integration: torch's own objects are put back (no-op when not installed).

    Ragged DTensors must not be used while it is removed (constructing a RaggedShard installs
    it again).
    """
    global _INSTALLED
    with _LOCK:
        if not _INSTALLED:
            return
        replaced = [c.where for c in _CHANGES if not c.still_ours()]
        if replaced:
            raise DTensorIntegrationError(
                f"ragged_dtensor: cannot remove the DTensor integration: {', '.join(replaced)} "
                f"no longer hold ragged_dtensor's wrappers (another library replaced them after "
                f"the install); nothing was changed"
            )
        try:
            ragged_debug.exit_env_checks()
        except RuntimeError as exc:
            raise DTensorIntegrationError(
                f"ragged_dtensor: cannot remove the DTensor integration ({exc}); nothing was "
                f"changed"
            ) from None
        for change in reversed(_CHANGES):
            change.undo()
        _clear_sharding_caches()
        _CHANGES.clear()
        compat_base._ORIGINALS = None
        _INSTALLED = False


def dtensor_integration_installed() -> bool:
    """Whether the DTensor integration is installed now."""
    return _INSTALLED


@contextlib.contextmanager
def dtensor_integration() -> Iterator[None]:
    """Install the integration for a block; on exit, remove it unless it was installed before."""
    was = _INSTALLED
    install_dtensor_integration()
    try:
        yield
    finally:
        if not was:
            uninstall_dtensor_integration()


def hooks_installed() -> dict[str, bool]:
    """Which parts of the integration are in place now (every key False when not installed)."""
    parts = {
        "redistribute": ("redistribute_local_tensor",),
        "propagator": ("propagate_op_sharding_non_cached", "propagate_op_sharding"),
        "random": ("_dispatch_get_local_results_slow_path",),
        "checkpoint": tuple(_CHECKPOINT_METHODS),
        "distribute_tensor": (_IMPL_NAME,),
        "state_dict": ("_distribute_tensors",),
        "custom_handlers": tuple(f"custom_op_handler:{op}" for op in handlers.HANDLED),
    }
    with _LOCK:
        names = {c.name for c in _CHANGES if c.still_ours()}
    return {part: all(n in names for n in members) for part, members in parts.items()}
