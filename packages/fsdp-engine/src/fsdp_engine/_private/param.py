"""One managed parameter (FSDP2's ``FSDPParam``): where it is registered, its sharded DTensor
over the group's storage, its unsharded parameters, and the adoption of values assigned to it.

[Note: registered parameters]
A managed parameter is registered (``module._parameters``) as its sharded DTensor while the
group is sharded and as an unsharded ``nn.Parameter`` (a view of the gathered storage, one per
compute dtype, made once) between unshard and reshard, under every name that registers it (tied
weights keep one object). A value a user assigns while sharded (``model.w = nn.Parameter(...)``,
``load_state_dict(assign=True)``, ``to_empty``) is adopted into the group's storage at the next
unshard or state-dict hook (FSDP2's ``reset_sharded_param``).

[Note: the recorded block policy]
A call's ``block_policy`` keeps some blocks whole; an optimizer that quantizes in blocks
(optim-blockwise's ``AdamW8bit``) must use the same ones, or shard boundaries cut its blocks and
its state loads only into the layout it was saved from. The optimizer gets nothing from the
engine but the parameters, so the policy travels on them: every sharded parameter of a planned
group carries ``param.block_policy`` (the policy as given, before the engine combines it with a
tensor-parallel row constraint or quantization tiles), kept on any object that later takes its
place (adoption, ``_apply``). optim-blockwise owns the attribute's meaning (its policy module's
agreement note); the engine satisfies it structurally. ``Shard(d)``-placed parameters carry none
(no block policy applies to them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_engine._private import compat
from fsdp_engine._private.in_place_guard import unsharded_parameter
from fsdp_engine._private.subclass import SubclassWrap, fsdp2_chunk, fsdp2_repad, plain_values
from fsdp_engine._private.tp_params import TPSpec, tp_spec
from ragged_dtensor import own_storage_view

if TYPE_CHECKING:
    from fsdp_engine._private.storage import ShardStorage

__all__ = [
    "FSDPParam",
    "adopt_registered",
    "ParamRef",
    "TPSpec",
    "applied_values",
    "check_applied_device",
    "tp_spec",
]


@attrs.frozen
class ParamRef:
    """Where a managed parameter is registered: ``owner.<attr>``, named ``fqn``.

    ``aliases`` are further ``(module, attr)`` places registering the same parameter object (tied
    weights, e.g. an output head sharing the embedding): they get the same sharded and unsharded
    parameters, so the tie is kept.
    """

    owner: nn.Module
    attr: str
    fqn: str
    aliases: tuple[tuple[nn.Module, str], ...] = ()

    def register(self, param: nn.Parameter) -> None:
        compat.set_registered_param(self.owner, self.attr, param)
        for module, attr in self.aliases:
            compat.set_registered_param(module, attr, param)

    def registered(self) -> Any:
        return compat.registered_param(self.owner, self.attr)


class FSDPParam:
    """One managed parameter ([Note: registered parameters])."""

    def __init__(
        self,
        ref: ParamRef,
        index: int,
        storage: ShardStorage,
        *,
        meta: bool,
        requires_grad: bool,
        wrap: SubclassWrap | None = None,
        value: torch.Tensor | None = None,
    ) -> None:
        self.ref = ref
        self.index = index
        self.storage = storage
        # [Note: subclass parameters]: the local tensor is the user's subclass over our storage
        self.wrap = wrap
        # [Note: subclasses with a storage of their own]: FSDP2's padded chunk and local tensor
        self.own: tuple[torch.Tensor, torch.Tensor] | None = None
        if wrap is not None and wrap.owns_storage:
            assert value is not None, "a subclass with its own storage needs its value"
            self.own = fsdp2_chunk(value, storage.rank, storage.world, storage.device)
        local = storage.local_or_meta(index, meta)
        self.sharded = compat.sharded_parameter(self._dtensor(local), requires_grad)
        self._unsharded: dict[torch.dtype, nn.Parameter] = {}
        self.block_policy: object = None  # the call's, recorded on the sharded parameter

    def record_block_policy(self, policy: object) -> None:
        """[Note: the recorded block policy]: ``param.block_policy`` on the sharded parameter
        (and on every parameter object that later takes its place) is the policy the call was
        given, so an optimizer whose blocks must agree with it can check at construction
        (optim-blockwise's AdamW8bit reads it)."""
        self.block_policy = policy
        if policy is not None:
            setattr(self.sharded, "block_policy", policy)  # noqa: B010 - not an nn.Parameter field

    def _local(self, plain: torch.Tensor) -> torch.Tensor:
        """The local tensor over ``plain`` (our storage), over storage of its own ([Note:
        DTensors over views] in compat): the subclass wrapped around it (or the subclass's own
        local tensor when it keeps its own storage)."""
        if self.own is not None:
            return self.own[1]
        plain = own_storage_view(plain)
        return plain if self.wrap is None else self.wrap.wrap(plain)

    @property
    def padded_own(self) -> torch.Tensor | None:
        """[Note: subclasses with a storage of their own]: FSDP2's padded chunk (its
        all-gather input without hooks), or None for a parameter held in our storage."""
        return None if self.own is None else self.own[0]

    def _take_own(self, local: torch.Tensor) -> torch.Tensor:
        """A subclass local tensor given in our place (FSDP2's ``reset_sharded_param``)."""
        rows = self.storage.placed.local_shape(self.index, 0)[0] if self.storage.placed else 0
        self.own = fsdp2_repad(local, rows)
        return self.own[1]

    def _dtensor(self, plain: torch.Tensor) -> DTensor:
        """The sharded DTensor over ``plain`` (its local tensor the subclass, if any)."""
        dtensor = self.storage.dtensor(self.index, plain)
        if self.wrap is None:
            return dtensor
        local = plain.view(self.storage.local_shape(self.index))
        return compat.dtensor_from_spec(self._local(local), compat.spec_of(dtensor))

    @property
    def fqn(self) -> str:
        return self.ref.fqn

    @property
    def dtensor(self) -> DTensor:
        """The sharded parameter as the DTensor it is (``nn.Parameter`` to the type checker)."""
        param = self.sharded
        assert isinstance(param, DTensor)
        return param

    @property
    def is_meta(self) -> bool:
        return compat.local_tensor(self.dtensor).is_meta

    # -- unsharded parameters -----------------------------------------------------------------
    def unsharded(self, dtype: torch.dtype) -> nn.Parameter | None:
        return self._unsharded.get(dtype)

    def make_unsharded(
        self, dtype: torch.dtype, view: torch.Tensor, guarded: bool = False
    ) -> nn.Parameter:
        """The unsharded parameter of compute dtype ``dtype`` over ``view`` (made once), with
        a version counter of its own; ``guarded``: its gradient may overwrite it ([Note:
        reading an overwritten weight])."""
        param = unsharded_parameter(
            self.storage.unsharded_view(self.index, view), self.sharded.requires_grad, guarded
        )
        self._unsharded[dtype] = param
        return param

    def forget_unsharded(self) -> None:
        """The views changed (a new storage, a new dtype): make them again when next needed."""
        self._unsharded = {}

    def register_sharded(self) -> None:
        self.ref.register(self.sharded)

    def register_unsharded(self, dtype: torch.dtype) -> nn.Parameter:
        param = self._unsharded[dtype]
        if param.requires_grad != self.sharded.requires_grad:  # frozen/unfrozen since then
            param.requires_grad_(self.sharded.requires_grad)
        self.ref.register(param)
        return param

    def is_ours(self, value: object) -> bool:
        return value is self.sharded or any(value is p for p in self._unsharded.values())

    # -- adoption -----------------------------------------------------------------------------
    def adopt(self, value: torch.Tensor) -> None:
        """Take over ``value``, registered in our place while sharded ([Note: registered
        parameters]). A DTensor with our placements keeps its object (its local tensor becomes a
        view of our storage); any other value is read as the full tensor (a DTensor in another
        layout is redistributed, a collective: every rank adopts at the same call)."""
        fqn, storage, i = self.fqn, self.storage, self.index
        if tuple(value.shape) != tuple(self.sharded.shape):
            raise ValueError(
                f"parameter {fqn!r}: the assigned value has shape {tuple(value.shape)}, "
                f"fully_shard manages it with shape {tuple(self.sharded.shape)}"
            )
        same_layout = isinstance(value, DTensor) and tuple(value.placements) == tuple(
            self.dtensor.placements
        )
        if self.own is not None:
            self._adopt_own(value, same_layout)
            return
        if same_layout:
            assert isinstance(value, DTensor)
            local = plain_values(compat.local_tensor(value))
        elif isinstance(value, DTensor):
            local = storage.part_of_full(i, plain_values(value.full_tensor()))
        else:
            local = storage.part_of_full(i, plain_values(value))
        if local.dtype != storage.dtype:
            raise TypeError(
                f"parameter {fqn!r}: the assigned value is {local.dtype}, the group holds "
                f"{storage.dtype}; convert the module with .to({local.dtype}) instead"
            )
        if local.is_meta:
            new_local = storage.local_or_meta(i, True)
        else:
            storage.materialize()  # before taking our view: materializing replaces the buffer
            new_local = storage.local(i)
            with torch.no_grad():
                new_local.copy_(local.detach().reshape(new_local.shape))
        if same_layout and isinstance(value, nn.Parameter):
            assert isinstance(value, DTensor)
            compat.set_local_tensor(value, self._local(new_local))
            param: nn.Parameter = value
        else:
            param = compat.sharded_parameter(self._dtensor(new_local), value.requires_grad)
        self.sharded = param
        self.record_block_policy(self.block_policy)
        self.register_sharded()
        self.forget_unsharded()

    def _adopt_own(self, value: torch.Tensor, same_layout: bool) -> None:
        """``adopt`` for a subclass with its own storage: its local tensor (re-padded), or
        FSDP2's chunk of the full value."""
        storage = self.storage
        if not value.is_meta:
            storage.materialize()  # the group's slot (layout and gradients) becomes real
        if same_layout and isinstance(value, nn.Parameter):
            assert isinstance(value, DTensor)
            compat.set_local_tensor(value, self._take_own(compat.local_tensor(value)))
            param: nn.Parameter = value
        else:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            self.own = fsdp2_chunk(full, storage.rank, storage.world, storage.device)
            local = storage.local(self.index)
            param = compat.sharded_parameter(self._dtensor(local), value.requires_grad)
        self.sharded = param
        self.record_block_policy(self.block_policy)
        self.register_sharded()
        self.forget_unsharded()

    def adopt_applied(self, current: DTensor, *, copy: bool = True) -> None:
        """After ``nn.Module._apply`` (``.to``, ``.float()``, ``to_empty``): ``current`` (the
        registered DTensor, in the group's new dtype) gets a view of our storage as its local
        tensor, holding the converted values (``_apply`` either swapped the parameter, so its
        local tensor holds them, or set ``param.data``, so only the wrapper changed).
        ``copy=False`` (``to_empty``): the values are undefined, nothing is copied."""
        storage, i = self.storage, self.index
        if self.own is not None:  # the subclass converted itself: its new local is the truth
            if current.device.type != "meta":
                storage.materialize()
            compat.set_local_tensor(current, self._take_own(compat.local_tensor(current)))
            assert isinstance(current, nn.Parameter)
            self.sharded = current
            self.record_block_policy(self.block_policy)
            self.register_sharded()
            self.forget_unsharded()
            return
        local = plain_values(compat.local_tensor(current))
        if current.device.type == "meta":
            new_local = storage.local_or_meta(i, True)
        else:
            storage.materialize()  # before taking our view: materializing replaces the buffer
            new_local = storage.local(i)
            if copy and not local.is_meta and not _starts_at(local, new_local):
                with torch.no_grad():
                    new_local.copy_(local.reshape(new_local.shape))
        compat.set_local_tensor(current, self._local(new_local))
        meta = compat.spec_of(current).tensor_meta
        if meta is None or meta.dtype != new_local.dtype:
            compat.set_spec(current, compat.spec_of(storage.dtensor(i, new_local)))
        assert isinstance(current, nn.Parameter)
        self.sharded = current
        self.record_block_policy(self.block_policy)
        self.register_sharded()
        self.forget_unsharded()


def _starts_at(tensor: torch.Tensor, local: torch.Tensor) -> bool:
    return compat.starts_at(tensor, local)


def applied_values(params: Sequence[FSDPParam]) -> list[DTensor]:
    """What ``nn.Module._apply`` left registered for ``params``: DTensors, or an error naming
    the first parameter that is no longer one."""
    currents = []
    for param in params:
        current = param.ref.registered()
        if not isinstance(current, DTensor):
            raise TypeError(f"parameter {param.fqn!r} is no longer a DTensor after _apply")
        currents.append(current)
    return currents


def check_applied_device(
    params: Sequence[FSDPParam], currents: Sequence[DTensor], device: torch.device
) -> None:
    """``_apply`` may change dtypes, not the device the group's mesh lives on."""
    for param, current in zip(params, currents, strict=True):
        if current.device.type != "meta" and current.device != device:
            raise ValueError(
                f"parameter {param.fqn!r} was moved to {current.device}, but fully_shard's "
                f"mesh lives on {device}; move the module before fully_shard"
            )


def adopt_registered(params: Sequence[FSDPParam]) -> bool:
    """Take over the parameters the user registered in place of ours (FSDP2's
    ``reset_sharded_param``); whether any was."""
    adopted = False
    for param in params:
        current = param.ref.registered()
        if param.is_ours(current):
            continue
        if not isinstance(current, torch.Tensor):
            raise ValueError(
                f"parameter {param.fqn!r} managed by fully_shard was replaced by "
                f"{type(current).__name__}; assign a tensor parameter"
            )
        param.adopt(current)
        adopted = True
    return adopted
