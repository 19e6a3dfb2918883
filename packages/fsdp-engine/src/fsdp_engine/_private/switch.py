"""The switch: torch's FSDP2 names resolve to fsdp_engine's, reversibly, for code that imports
FSDP2 itself (accelerate, Lightning, transformers' Trainer, torchtitan).

[Note: the switch]
What changes. Each FSDP2 name of ``torch.distributed.fsdp._fully_shard.__all__`` that
fsdp_engine also exports with an object of its own (``fully_shard``, ``FSDPModule``,
``UnshardHandle``, ``register_fsdp_forward_method``, ``share_comm_ctx``,
``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``; not
``DataParallelMeshDims``, which fsdp_engine re-exports as torch's very class) is rebound
to ours in torch's four namespaces that user code imports FSDP2 from:
``torch.distributed.fsdp``, ``torch.distributed.fsdp._fully_shard`` and the older
``torch.distributed._composable.fsdp`` and ``..._composable.fsdp.fully_shard`` (Lightning and
torchtitan import ``FSDPModule`` from there). A name a namespace does not define is not added;
a name fsdp_engine does not export keeps torch's object.

What never changes: FSDP2's implementation modules (``_fully_shard._fully_shard``,
``_fsdp_api``, ``_fsdp_state``, ...). Their functions read their own module globals, so
rebinding there would turn torch's own ``fully_shard`` into a hybrid. torch's FSDP2 stays whole
and reachable (``torch.distributed.fsdp._fully_shard._fully_shard.fully_shard``), and torch's
modules that use FSDP2 for themselves are left as they are; ``replicate_with_fsdp``, whose
``ReplicateModule`` subclasses ``FSDPModule`` when it is imported, is imported before the switch
so that it subclasses torch's.

Names bound at import. ``from torch.distributed.fsdp import fully_shard`` copies the object
into the importing module. Switching on rebinds, in every loaded module outside torch and
fsdp_engine, each global that is one of torch's FSDP2 objects (whatever its name: an alias
too) to ours, and removal puts torch's back: a trainer module imported before the switch
(torchtitan's ``fsdp.py``, a Lightning ``configure_model`` module) runs our engine like one
imported after it. A module imported while the switch is on binds ours itself. ``modules=``
imports the named modules first (and rebinds them the same way). What the switch cannot reach
(torch's objects kept inside a container, a class attribute, or read from FSDP2's
implementation module, the way to reach torch's FSDP2 on purpose while the switch is on) is
caught when a model is run: one model sharded by both engines is refused at lazy init, naming
the modules of each (``one_engine.py``). A global that cannot be rebound is refused
(``TorchFSDPSwitchError``, nothing changed).

``FSDPModule``. Our class subclasses torch's, so ``isinstance(m, <torch's FSDPModule>)`` holds
for our modules with or without the switch; the switch rebinds the name too, so that
``FSDPModule`` imported from torch's namespaces is ours, like ``fully_shard``. While it is on, a
module sharded by torch's own FSDP2 (reached through its implementation module) is not an
instance of the switched name.

Removal puts back exactly the objects that were there (identity), in torch's namespaces and in
the named modules, and refuses (``TorchFSDPSwitchError``, nothing changed) if one of the
bindings no longer holds ours (someone else rebound it since). A torch module first imported
while the switch was on (say ``torch.distributed.pipelining``) got ours at its import; it gets
torch's back too, since torch's own code always means torch's FSDP2. A module outside torch
imported while the switch was on keeps ours: it cannot be told from a module that imported
fsdp_engine's names on purpose. Name it to have it restored.

Holders. ``use_as_torch_fsdp`` holds the switch until ``restore_torch_fsdp``. Each
``as_torch_fsdp`` block is a holder of its own, owned by its thread: the switch (and each module
it named) stays on while any holder holds it, so blocks nest and the ranks of a threaded
process group may each enter one. ``restore_torch_fsdp`` ends the explicit holder and the
calling thread's blocks; while a block of another (live) thread holds the switch it refuses
(``TorchFSDPSwitchError``, nothing changed): no thread can end another thread's block.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

__all__ = [
    "TORCH_NAMESPACES",
    "TorchFSDPSwitchError",
    "as_torch_fsdp",
    "restore_torch_fsdp",
    "switched_names",
    "use_as_torch_fsdp",
    "used_as_torch_fsdp",
]

# Where user code imports FSDP2's names from (torch 2.13), in import order.
TORCH_NAMESPACES = (
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.distributed._composable.fsdp",
)
# torch modules that define classes on FSDP2's names when imported: imported before the switch
_IMPORT_FIRST = ("torch.distributed._composable.replicate_with_fsdp",)
# FSDP2's implementation modules: where torch's own objects are read from (never rebound)
_TORCH_IMPLEMENTATION = (
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed.fsdp._fully_shard._fsdp_api",
)


class TorchFSDPSwitchError(RuntimeError):
    """The switch cannot be applied or removed as asked (nothing was changed)."""


@dataclasses.dataclass(eq=False)
class _Binding:
    """One rebound global: ``module.name`` held ``original`` (torch's) and now holds
    ``replacement`` (ours) for as long as some holder holds it."""

    module: ModuleType
    name: str
    original: object
    replacement: object
    holders: set[object] = dataclasses.field(default_factory=set)
    # rebound because it held torch's object when the switch went on (not named): held, like
    # torch's namespaces, by every holder of the switch
    found: bool = False

    @property
    def where(self) -> str:
        return f"{self.module.__name__}.{self.name}"


_EXPLICIT = "use_as_torch_fsdp"  # the holder of use_as_torch_fsdp() (a context has its own)


@dataclasses.dataclass(eq=False)
class _Block:
    """The holder of one ``as_torch_fsdp`` block, owned by the thread that entered it."""

    thread: threading.Thread = dataclasses.field(default_factory=threading.current_thread)


_lock = threading.RLock()
_bindings: dict[tuple[int, str], _Binding] = {}


def switched_names() -> dict[str, tuple[object, object]]:
    """FSDP2 name -> (torch's object, ours): the names of torch's FSDP2 ``__all__`` that
    fsdp_engine exports with an object of its own (a name it re-exports as torch's very
    object, ``DataParallelMeshDims``, has nothing to switch)."""
    import fsdp_engine

    torch_all = importlib.import_module("torch.distributed.fsdp._fully_shard").__all__
    sources = [vars(importlib.import_module(name)) for name in _TORCH_IMPLEMENTATION]
    table: dict[str, tuple[object, object]] = {}
    for name in torch_all:
        if name not in fsdp_engine.__all__:
            continue
        theirs = next((source[name] for source in sources if name in source), None)
        if theirs is None:  # pragma: no cover - torch's layout changed (pinned by a test)
            raise TorchFSDPSwitchError(
                f"torch's FSDP2 object {name!r} was not found in {_TORCH_IMPLEMENTATION}; "
                f"this switch supports torch 2.13's layout"
            )
        ours = getattr(fsdp_engine, name)
        if ours is not theirs:
            table[name] = (theirs, ours)
    return table


def used_as_torch_fsdp() -> bool:
    """Whether torch's FSDP2 names resolve to fsdp_engine's now."""
    with _lock:
        return any(b.module.__name__ in TORCH_NAMESPACES for b in _bindings.values())


def use_as_torch_fsdp(modules: Iterable[ModuleType | str] = ()) -> None:
    """Make ``torch.distributed.fsdp.fully_shard``, ``FSDPModule``, the policies and the rest
    of FSDP2's names resolve to fsdp_engine's until ``restore_torch_fsdp()`` ([Note: the
    switch]).

    ``modules``: modules (or their dotted names, imported now if needed) that bound torch's
    FSDP2 objects at their import; each global of theirs that is one of torch's FSDP2 objects
    is rebound to ours too. Calling again while on adds the modules it names.
    """
    _apply(_EXPLICIT, modules)


def restore_torch_fsdp() -> None:
    """Put torch's FSDP2 back: end ``use_as_torch_fsdp()`` and the calling thread's
    ``as_torch_fsdp`` blocks; every binding the switch made holds torch's very object again.
    Does nothing when the switch is off. Raises ``TorchFSDPSwitchError`` and changes nothing if
    one of the bindings no longer holds ours, or while an ``as_torch_fsdp`` block of another
    live thread holds the switch (no thread ends another's block)."""
    with _lock:
        me = threading.current_thread()
        others = {
            h.thread.name
            for b in _bindings.values()
            for h in b.holders
            if isinstance(h, _Block) and h.thread is not me and h.thread.is_alive()
        }
        if others:
            raise TorchFSDPSwitchError(
                "restore_torch_fsdp: as_torch_fsdp blocks of other threads "
                f"({', '.join(sorted(others))}) still hold the switch; it stays on until they "
                "leave their blocks (nothing was changed)"
            )
        _release(list(_bindings.values()), None)


@contextmanager
def as_torch_fsdp(modules: Iterable[ModuleType | str] = ()) -> Iterator[None]:
    """``with as_torch_fsdp(): ...``: the switch on inside the block ([Note: the switch]).

    On exit, what this block switched on is switched off again, unless another holder (an
    outer block, another thread's block, ``use_as_torch_fsdp()``) still holds it."""
    holder = _Block()
    _apply(holder, modules)
    try:
        yield
    finally:
        with _lock:
            _release([b for b in _bindings.values() if holder in b.holders], holder)


# -- applying ------------------------------------------------------------------------------------


def _resolve(module: ModuleType | str) -> ModuleType:
    if isinstance(module, ModuleType):
        return module
    if isinstance(module, str):
        return importlib.import_module(module)
    raise TypeError(
        f"use_as_torch_fsdp: modules must hold modules or dotted module names, "
        f"got {type(module).__name__}"
    )


def _planned(
    module: ModuleType, names: Iterable[str], table: dict[str, tuple[object, object]]
) -> list[_Binding]:
    """The bindings that switch ``module``'s ``names`` from torch's object to ours."""
    by_original = {id(theirs): ours for theirs, ours in table.values()}
    namespace = vars(module)
    plan = []
    for name in names:
        value = namespace.get(name)
        if id(value) in by_original:
            plan.append(_Binding(module, name, value, by_original[id(value)]))
    return plan


def _loaded_holders(table: dict[str, tuple[object, object]]) -> list[_Binding]:
    """[Note: the switch], names bound at import: every global of a loaded module outside
    torch and fsdp_engine that is one of torch's FSDP2 objects."""
    found: list[_Binding] = []
    for mod_name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType) or mod_name == "torch":
            continue
        if mod_name.startswith(("torch.", "fsdp_engine.")) or mod_name == "fsdp_engine":
            continue
        try:
            names = list(vars(module))
        except TypeError:  # pragma: no cover - a module object without a __dict__
            continue
        for binding in _planned(module, names, table):
            binding.found = True
            found.append(binding)
    return found


def _apply(holder: object, modules: Iterable[ModuleType | str]) -> None:
    # the named modules are imported before anything changes: they bind torch's objects
    named = [_resolve(m) for m in modules]
    with _lock:
        table = switched_names()
        plan: list[_Binding] = []
        if not used_as_torch_fsdp():
            for extra in _IMPORT_FIRST:
                importlib.import_module(extra)
            for space in (importlib.import_module(n) for n in TORCH_NAMESPACES):
                for name in table:
                    if name not in vars(space):
                        continue
                    theirs, ours = table[name]
                    if vars(space)[name] is not theirs:
                        raise TorchFSDPSwitchError(
                            f"{space.__name__}.{name} is not torch's FSDP2 object but "
                            f"{vars(space)[name]!r}: something else replaced it; refusing to "
                            "switch over it (nothing was changed)"
                        )
                    plan.append(_Binding(space, name, theirs, ours))
            plan.extend(_loaded_holders(table))
        ours_ids = {id(ours) for _, ours in table.values()}
        for module in named:
            if module.__name__ == "torch" or module.__name__.startswith("torch."):
                raise ValueError(
                    f"use_as_torch_fsdp: {module.__name__} is one of torch's modules; the switch "
                    "rebinds torch's public FSDP2 namespaces itself and never FSDP2's own modules"
                )
            found = _planned(module, list(vars(module)), table)
            holds_ours = any(id(v) in ours_ids for v in vars(module).values())
            if not found and not holds_ours and not any(b.module is module for b in plan):
                raise ValueError(
                    f"use_as_torch_fsdp: module {module.__name__} holds none of torch's FSDP2 "
                    f"objects ({', '.join(table)}); only a module that bound them at its import "
                    "needs naming"
                )
            planned_keys = {(id(b.module), b.name) for b in plan}
            plan.extend(b for b in found if (id(b.module), b.name) not in planned_keys)
        _bind(plan)
        # this holder holds torch's namespaces, the modules found holding torch's objects, and
        # each module it named (switched by it now or by another holder before)
        for binding in _bindings.values():
            if (
                binding.module.__name__ in TORCH_NAMESPACES
                or binding.found
                or binding.module in named
            ):
                binding.holders.add(holder)


def _bind(plan: list[_Binding]) -> None:
    """Rebind every global of ``plan`` to ours, or none: a global that refuses (a module
    object that forbids setting it) is named and everything done is undone."""
    done: list[_Binding] = []
    try:
        for binding in plan:
            setattr(binding.module, binding.name, binding.replacement)
            done.append(binding)
    except Exception as exc:
        for binding in reversed(done):
            setattr(binding.module, binding.name, binding.original)
        where = plan[len(done)].where
        raise TorchFSDPSwitchError(
            f"cannot switch {where} to fsdp_engine's object ({exc}); it holds torch's FSDP2 "
            "object and would keep running torch's FSDP2 (nothing was changed)"
        ) from exc
    for binding in plan:
        _bindings[(id(binding.module), binding.name)] = binding


# -- removing ------------------------------------------------------------------------------------


def _release(bindings: list[_Binding], holder: object | None) -> None:
    """Drop ``holder`` (every holder when None) from ``bindings``; restore those left with
    none, after checking that each still holds ours."""
    going = [b for b in bindings if holder is None or b.holders == {holder}]
    moved = [b for b in going if vars(b.module).get(b.name) is not b.replacement]
    if moved:
        raise TorchFSDPSwitchError(
            "cannot restore torch's FSDP2: "
            + "; ".join(f"{b.where} no longer holds fsdp_engine's object" for b in moved)
            + " (something rebound it since the switch); nothing was changed"
        )
    turning_off = any(b.module.__name__ in TORCH_NAMESPACES for b in going)
    for binding in bindings:
        if holder is None:
            binding.holders.clear()
        else:
            binding.holders.discard(holder)
    for binding in going:
        setattr(binding.module, binding.name, binding.original)
        del _bindings[(id(binding.module), binding.name)]
    if turning_off:
        _restore_torch_importers()


def _restore_torch_importers() -> None:
    """torch modules first imported while the switch was on bound ours: torch's back."""
    back: dict[int, tuple[object, object]] = {
        id(ours): (ours, theirs) for theirs, ours in switched_names().values()
    }
    for mod_name, module in list(sys.modules.items()):
        if not (mod_name == "torch" or mod_name.startswith("torch.")):
            continue
        namespace: dict[str, Any] = vars(module)
        for name, value in list(namespace.items()):
            entry = back.get(id(value))
            if entry is not None and entry[0] is value:
                setattr(module, name, entry[1])
