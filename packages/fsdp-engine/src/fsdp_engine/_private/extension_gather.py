"""FSDP2's all-gather extension: parameters whose local tensor defines ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` are gathered through them.

[Note: all-gather extensions]
FSDP2's protocol (torch 2.13, ``_fsdp_param.py``), followed call for call:

- ``inputs, metadata = local.fsdp_pre_all_gather(mesh, outer_size, outer_stride, module,
  mp_policy)`` (or the older ``fsdp_pre_all_gather(mesh)``: chosen by the method's number of
  parameters, 1 or 5, else FSDP2's AssertionError), called on the sharded parameter's local
  tensor at every all-gather. ``mesh`` is the shard mesh (HSDP: the shard axis' 1-D mesh),
  ``outer_size``/``outer_stride`` the full parameter's size and contiguous stride, ``module``
  the module registering the parameter, ``mp_policy`` torch's ``MixedPrecisionPolicy``.
- The pre-hooks and the packing run on the all-gather stream after ``ready`` (the event of the
  shards' last write; default the caller's stream now), as FSDP2 runs them on its copy-in
  stream: they overlap the compute queued before them.
- Every input travels in the group's one all-gather, next to the other parameters' chunks:
  each rank's section packs every input's bytes (any dtypes, each at an offset that is a
  multiple of its element size: FSDP2's bytes, no more, as FSDP2 packs them back to back), one
  all-gather of bytes moves all sections, and each input's gathered copy is cut out into its
  *all-gather output* (``m`` times its numel, rank-major), a tensor made once and refilled in
  place on later gathers (its memory freed at reshard), viewed as ``(-1, *size[1:])``.
  Every rank's inputs must have the same sizes (FSDP2's rule: its all-gather outputs are
  ``m`` copies of the local sizes); they are compared across ranks when first seen or when
  they change (one small collective), so a rank whose sizes differ raises on every rank, naming
  the parameter. An unevenly sharded parameter must return inputs of the padded chunk's size
  (FSDP2's AssertionError otherwise).
- The first all-gather calls ``local.fsdp_post_all_gather(outputs, metadata, param_dtype)`` and
  the unsharded parameter is what it returns (``as_strided`` to the full size, as FSDP2 does),
  made a parameter once; its second return value are the tensors freed at every reshard and
  re-allocated before each later all-gather, which calls ``fsdp_post_all_gather(outputs,
  metadata, param_dtype, out=unsharded_parameter)`` to refill it in place (so autograd's saved
  references stay valid). ``param_dtype`` is the policy's, or the parameter's dtype.
- The methods are looked up on the local tensor at every all-gather, so hooks patched onto the
  class or onto the local tensor object itself after ``fully_shard`` (before or between
  iterations) are used, and a parameter whose class has neither is gathered as plain values
  (a subclass with its own storage: its padded chunk, FSDP2's all-gather input). Defining only
  one of the two raises FSDP2's AssertionError.

Plain parameters of the same group (a call holding subclass parameters: [Note: subclass
parameters] in subclass.py) travel in the same all-gather as their padded chunks in the compute
dtype and are copied out into their own storage, FSDP2's copy-out. The cost against a planned
group: one copy out of the gathered bytes per parameter (FSDP2 pays it too), and FSDP2's
``Shard(0)`` layout for every parameter of such a call (see ``fully_shard``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import (
    AllGatherComm,
    DBuffer,
    Handle,
    LayoutMismatchError,
    contiguous_layout,
    on_all_gather_stream,
)
from fsdp_engine._private import compat
from fsdp_engine._private import gather as gather_module
from fsdp_engine._private.api import MixedPrecisionPolicy
from fsdp_engine._private.extension_hooks import (
    Hooked,
    alloc,
    extension_hooks,
    free,
    pre_all_gather,
    round_up,
    torch_policy,
)
from fsdp_engine._private.gather import Gather, choose_gather
from fsdp_engine._private.param import FSDPParam
from fsdp_engine._private.quantized_gather import QuantizedGather
from fsdp_engine._private.storage import ShardStorage
from ragged_dtensor import check_ranks_agree

__all__ = ["ExtensionGather", "extension_hooks", "gather_for_params"]


class ExtensionGather(Gather):
    """One packed all-gather of a placed group's plain chunks and extension inputs (module
    Note). ``unsharded_of(i)``: parameter ``i``'s unsharded parameter if made (for ``out=``);
    ``forget(i)``: its unsharded tensor changed (hooks patched in or out, new sizes)."""

    def __init__(
        self,
        storage: ShardStorage,
        gather_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        *,
        params: Sequence[FSDPParam],
        mp_policy: MixedPrecisionPolicy,
        comm: AllGatherComm | None,
        unsharded_of: Callable[[int], nn.Parameter | None],
        forget: Callable[[int], None],
    ) -> None:
        super().__init__(storage, gather_dtype, compute_dtype)
        placed = storage.placed
        if placed is None or storage.bitcast:
            raise NotImplementedError(
                f"fully_shard: the all-gather extension needs FSDP2's layout of a floating "
                f"group; group {list(storage.names)} is not one"
            )
        self.placed = placed
        self.params = params
        self.policy = torch_policy(mp_policy)
        self.comm = comm
        self.unsharded_of = unsharded_of
        self.forget = forget
        mesh = storage.mesh
        names = mesh.mesh_dim_names
        self.shard_mesh: DeviceMesh = mesh if mesh.ndim == 1 or names is None else mesh[names[-1]]
        device = storage.device
        self._full = [torch.empty(s, dtype=compute_dtype, device=device) for s in storage.shapes]
        for full in self._full:
            free(full)
        for param in params:  # FSDP2 checks at fully_shard (and again at every gather here)
            extension_hooks(compat.local_tensor(param.dtensor))
        self._hooked: dict[int, Hooked] = {}
        self._key: tuple[Any, ...] | None = None
        self._offsets: list[list[int]] = []
        self._section = 0
        self._bytes: DBuffer | None = None
        self._pending: list[tuple[int, bool]] = []  # (index, hooked) of the gather in flight
        self._last_kinds: list[tuple[int, bool]] = []  # of the last gather issued
        self._given: dict[int, torch.Tensor] = {}  # what views() handed out

    # -- the gather ---------------------------------------------------------------------------
    def _inputs(self) -> tuple[list[list[torch.Tensor]], list[bool]]:
        """Every parameter's all-gather inputs (flat) and whether they came from its hooks."""
        storage, placed = self.storage, self.placed
        shard = self.buffer.shard.view(storage.dtype)
        inputs: list[list[torch.Tensor]] = []
        hooked: list[bool] = []
        for i, param in enumerate(self.params):
            local = compat.local_tensor(param.dtensor)
            if not extension_hooks(local):
                own = param.padded_own
                if own is not None:  # FSDP2's input: the subclass's padded chunk, cast
                    chunk = own.reshape(-1)
                else:
                    off = placed.offsets[i]
                    chunk = shard[off : off + placed.chunks[i]]
                inputs.append([chunk.to(self.compute_dtype)])
                hooked.append(False)
                continue
            state = self._hooked.setdefault(i, Hooked())
            outs, state.metadata = self._pre_all_gather(i, param, local)
            state_sizes = [t.size() for t in outs]
            if state.sizes and state_sizes != state.sizes:
                state.outputs = []  # new sizes: new outputs (and a new unsharded tensor)
                state.unsharded = None
            state.sizes = state_sizes
            inputs.append([t.reshape(-1) for t in outs])
            hooked.append(True)
        return inputs, hooked

    def _pre_all_gather(
        self, i: int, param: FSDPParam, local: torch.Tensor
    ) -> tuple[Sequence[torch.Tensor], Any]:
        padded = self._padded_size(i)
        # every rank knows whether some rank's chunk is short (FSDP2: only the short ranks do)
        uneven = torch.Size(self.placed.local_shape(i, self.storage.world - 1)) != padded
        return pre_all_gather(
            local,
            self.shard_mesh,
            torch.Size(self.storage.shapes[i]),
            param.ref.owner,
            self.policy,
            padded=padded if uneven else None,
            world=self.storage.world,
        )

    def _padded_size(self, i: int) -> torch.Size:
        """Rank 0's chunk: the padded chunk of every rank (FSDP2's ``padded_sharded_size``)."""
        return torch.Size(self.placed.local_shape(i, 0))

    def _layout(self, inputs: list[list[torch.Tensor]], hooked: list[bool]) -> None:
        """The byte offsets of every input in a section; compared across ranks when new."""
        key = tuple(
            (h, tuple((t.dtype, t.numel()) for t in ts))
            for ts, h in zip(inputs, hooked, strict=True)
        )
        if key == self._key:
            return
        record = {}
        offsets: list[list[int]] = []
        cursor = 0
        widest = 1
        for param, ts, h in zip(self.params, inputs, hooked, strict=True):
            kind = "fsdp_pre_all_gather inputs" if h else "chunk"
            record[f"all-gather {kind} of {param.fqn!r} (dtype, numel)"] = repr(
                [(str(t.dtype), t.numel()) for t in ts]
            )
            mine = []
            for t in ts:  # at a multiple of its element size: viewable as its dtype
                cursor = round_up(cursor, t.element_size())
                mine.append(cursor)
                cursor += t.numel() * t.element_size()
                widest = max(widest, t.element_size())
            offsets.append(mine)
        check_ranks_agree(
            self.storage.mesh,
            record,
            what="fully_shard: ranks' all-gather inputs differ (every rank must give the same "
            "sizes: FSDP2's rule)",
            error=LayoutMismatchError,
        )
        # every rank's section starts at a multiple of the widest element size
        self._section = max(widest, round_up(cursor, widest))
        self._offsets = offsets
        self._key = key
        world = self.storage.world
        total = self._section * world
        self._bytes = DBuffer(
            contiguous_layout([total], world, align=1),
            [(total,)],
            self.storage.mesh,
            dtype=torch.uint8,
            names=[f"all-gather inputs of {list(self.storage.names)}"],
            shard_axis=self.storage.shard_axis,
            check=False,
            device=self.storage.device,
            zero=False,
        )
        free(self._bytes.shard)

    def issue(self, *, ready: torch.Event | None, async_op: bool) -> Handle | None:
        device = self.storage.device
        # [Note: all-gather extensions]: the hooks and the packing run on the all-gather stream
        # once the shards' last write (``ready``) has passed, as FSDP2's copy-in stream does, so
        # they overlap the compute before them; their temporaries belong to that stream
        with on_all_gather_stream(device, ready), torch.no_grad():
            inputs, hooked = self._inputs()
            self._layout(inputs, hooked)
            packed = self._bytes
            assert packed is not None
            alloc(packed.shard)
            send = packed.shard
            for ts, offs in zip(inputs, self._offsets, strict=True):
                for t, off in zip(ts, offs, strict=True):
                    nbytes = t.numel() * t.element_size()
                    send[off : off + nbytes].copy_(t.contiguous().view(torch.uint8))
            del inputs  # the hooks' temporaries go back to the all-gather stream's pool
            packed_at = gather_module.event_now(device)  # on the all-gather stream
        self._pending = self._last_kinds = list(enumerate(hooked))
        return packed.unshard(async_op=async_op, ready=packed_at, comm=self.comm)

    def complete(self) -> None:
        packed = self._bytes
        assert packed is not None
        world, section = self.storage.world, self._section
        recv = packed.unsharded_flat().view(world, section)
        with torch.no_grad():
            for i, hooked in self._pending:
                offs = self._offsets[i]
                if not hooked:
                    full = self._full[i]
                    alloc(full)
                    chunk = self.placed.chunks[i] * full.element_size()
                    src = recv[:, offs[0] : offs[0] + chunk].view(self.compute_dtype)
                    with compat.preserve_version_counter(full):
                        self.placed.copy_out_rows(src, i, full)
                    continue
                state = self._hooked[i]
                if not state.outputs:
                    assert self._key is not None
                    dtypes = [dtype for dtype, _ in self._key[i][1]]
                    state.outputs = [
                        torch.empty(size.numel() * world, dtype=dtype, device=recv.device)
                        for size, dtype in zip(state.sizes, dtypes, strict=True)
                    ]
                for out, off in zip(state.outputs, offs, strict=True):
                    alloc(out)
                    nbytes = out.numel() * out.element_size() // world
                    with compat.preserve_version_counter(out):
                        out.view(torch.uint8).view(world, nbytes).copy_(recv[:, off : off + nbytes])
        packed.reshard()
        free(packed.shard)
        for i, hooked in self._pending:
            if hooked:
                self._post_all_gather(i)
            given = self._given.get(i)
            if given is not None and given is not self._view(i):
                self.forget(i)  # another unsharded tensor: the group makes its parameter again
        self._pending = []

    def _post_all_gather(self, i: int) -> None:
        state = self._hooked[i]
        local = compat.local_tensor(self.params[i].dtensor)
        if not extension_hooks(local):  # the hooks went since the pre-hook: nothing rebuilds it
            raise RuntimeError(
                f"fully_shard: the all-gather extension of parameter {self.params[i].fqn!r} "
                "lost its fsdp_post_all_gather between the pre- and the post-all-gather"
            )
        post = local.fsdp_post_all_gather  # type: ignore[attr-defined]
        outputs = tuple(t.view(-1, *s[1:]) for t, s in zip(state.outputs, state.sizes, strict=True))
        param = self.unsharded_of(i)
        if (
            state.unsharded is not None
            and param is not None
            and self._given.get(i) is state.unsharded
        ):
            for tensor in state.inner:
                alloc(tensor)
            post(outputs, state.metadata, self.compute_dtype, out=param)
            return
        tensor, inner = post(outputs, state.metadata, self.compute_dtype)
        shape = torch.Size(self.storage.shapes[i])
        stride = torch.empty(shape, device="meta").stride()
        state.unsharded = torch.as_strided(tensor, shape, stride, storage_offset=0)
        state.inner = list(inner)

    # -- what the group reads -----------------------------------------------------------------
    def _view(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s unsharded tensor after the last gather: the post-hook's, or the
        plain copy-out storage."""
        state = self._hooked.get(i)
        last = dict(self._last_kinds).get(i, False)
        if last and state is not None and state.unsharded is not None:
            return state.unsharded
        return self._full[i]

    def views(self) -> Sequence[torch.Tensor]:
        out = [self._view(i) for i in range(len(self._full))]
        self._given = dict(enumerate(out))
        return out

    def flat(self) -> torch.Tensor:
        raise NotImplementedError(
            "fully_shard: reshard_after_forward as an int with all-gather extension parameters "
            "is not supported (FSDP2 does not support it either)"
        )

    def release(self) -> None:
        if self._bytes is not None:
            self._bytes.reshard()
        for full in self._full:
            free(full)
        for state in self._hooked.values():
            for tensor in (*state.outputs, *state.inner):
                free(tensor)


def gather_for_params(
    storage: ShardStorage,
    params: Sequence[FSDPParam],
    *,
    gather_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    quantized: QuantizedGather | None,
    comm: AllGatherComm | None,
    keep_gathered: bool,
    mp_policy: MixedPrecisionPolicy,
) -> Gather:
    """A group's all-gather strategy: through the extension hooks when it holds subclass
    parameters ([Note: all-gather extensions]), else ``choose_gather``'s (``keep_gathered``: a
    part is kept after forward, ``reshard_after_forward=k``)."""
    if not any(p.wrap is not None for p in params):
        return choose_gather(
            storage,
            gather_dtype=gather_dtype,
            compute_dtype=compute_dtype,
            quantized=quantized,
            comm=comm,
            keep_gathered=keep_gathered,
        )
    if keep_gathered:
        raise NotImplementedError(
            f"fully_shard: reshard_after_forward as an int with tensor-subclass "
            f"parameters {[p.fqn for p in params if p.wrap is not None]} is not "
            "supported (FSDP2 does not reshard extension parameters to a smaller mesh "
            "either)"
        )
    return ExtensionGather(
        storage,
        gather_dtype,
        compute_dtype,
        params=params,
        mp_policy=mp_policy,
        comm=comm,
        unsharded_of=lambda i: params[i].unsharded(compute_dtype),
        forget=lambda i: params[i].forget_unsharded(),
    )
