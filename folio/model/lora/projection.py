"""Multi-LoRA inside a batch: every projection an adapter may target holds, per device slot,
its adapters' A and B (zero-padded to the engine's max rank), and adds each token's own
adapter's B(A(x)) * scaling to the base output. Which slot each token uses is the step's
`LoRABatch`, shared by all projections and set by the worker before the forward pass.

On CUDA, a projection whose base weight is a plain 16-bit matrix without bias carries every
slot's A rows appended to that weight ("riding" it, `ride_on`): one GEMM against [W; A_all]
gives the base product and each slot's shrink, the A rows streaming with the weight the base
product reads anyway, and one expand launch (folio/model/kernels/lora.py, each token reading
its own slot's columns) adds B's part into the head of that output. Other CUDA projections
(quantized or biased weights) run the Triton kernels in one launch per projection (shrink and
expand fused, up to 4 tokens) or two (tokens in slot order). Either way the kernels read the
batch's static slot buffer, so CUDA graphs capture them; B is stored pre-scaled.
Elsewhere the torch path loops over the step's adapters (at most max_loras), each on its
tokens' rows, and multiplies by the scaling after B as PEFT does, at each projection's own
rank, so float32 results match PEFT's arithmetic."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from folio.model.kernel_config import KernelConfig
from folio.model.lora.adapter_files import PROJECTIONS
from folio.model.lora.weights import AdapterWeights


class LoRABatch:
    """The step's token -> slot map (-1: no adapter). `token_slots` is a device buffer of
    max_tokens entries updated in place (captured CUDA graphs read it); rows past the step's
    tokens hold -1. `token_order`, a second such buffer, lists the tokens grouped by slot (a
    stable sort: each slot's tokens in flat-batch order, the slots ascending, the tokens
    without adapter last), then the rows past the step's tokens in order; so its first T
    entries are a permutation of range(T) for any T >= the step's tokens (a CUDA graph's
    padded batch). The kernels' blocks follow it to read each adapter's weights once per
    block rather than once per token. `groups`: per slot in use, its tokens' rows (a slice
    when they are contiguous, else an index tensor), for the torch path."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.device = device
        pinned = device.type == "cuda"
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.token_order = torch.arange(max_tokens, dtype=torch.int32, device=device)
        self._host = torch.full((max_tokens,), -1, dtype=torch.int32, pin_memory=pinned)
        self._host_order = torch.arange(max_tokens, dtype=torch.int32, pin_memory=pinned)
        self._host_np = self._host.numpy()
        self._host_order_np = self._host_order.numpy()
        # Recorded after each copy out of the pinned buffers: the next step (built while this
        # one may still wait on the stream, under async scheduling) must not rewrite them
        # first.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._num_set = 0
        self._slots = np.zeros(0, dtype=np.int32)
        self._groups: list[tuple[int, slice | torch.Tensor]] | None = []
        # Whether any token of the step has an adapter; projections skip LoRA otherwise,
        # unless `force` (a CUDA graph captured for steps with adapters must hold the
        # kernels whatever the capture's dummy batch holds).
        self.active = False
        self.force = False

    def set(self, slots: np.ndarray) -> None:
        """This step's slots, one per token in flat-batch order."""
        self._slots = np.array(slots, dtype=np.int32)
        n = len(self._slots)
        if self._copied is not None:
            self._copied.synchronize()
        host, order = self._host_np, self._host_order_np
        host[:n] = self._slots
        # As unsigned, -1 sorts after every slot.
        order[:n] = np.argsort(self._slots.view(np.uint32), kind="stable")
        if self._num_set > n:
            host[n:self._num_set] = -1
            order[n:self._num_set] = np.arange(n, self._num_set, dtype=np.int32)
        end = max(n, self._num_set)
        self._num_set = n
        self.token_slots[:end].copy_(self._host[:end], non_blocking=True)
        self.token_order[:end].copy_(self._host_order[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self._groups = None
        self.active = bool((self._slots >= 0).any())

    @property
    def groups(self) -> list[tuple[int, slice | torch.Tensor]]:
        """Built on first use in a step: the CUDA kernels read `token_slots` instead."""
        if self._groups is None:
            slots = self._slots
            groups = []
            for slot in np.unique(slots[slots >= 0]).tolist():
                rows = np.flatnonzero(slots == slot)
                if rows[-1] - rows[0] + 1 == len(rows):
                    groups.append((slot, slice(int(rows[0]), int(rows[-1]) + 1)))
                else:
                    groups.append((slot, torch.from_numpy(rows).to(self.device)))
            self._groups = groups
        return self._groups


@dataclass(frozen=True)
class LoRATarget:
    """Where a checkpoint projection's LoRA goes: the LoRA projection and its slice."""
    projection: "LoRAProjection"
    slice_index: int


class LoRAProjection(nn.Module):
    """The LoRA side of one (possibly merged) projection: `a` [slots, n_slices * max_rank,
    in], `b` [slots, out, max_rank] (each slice's output rows read its own max_rank columns of
    A's output), the scaling and rank of each slot's slices. Empty slices (an adapter that
    leaves q alone, say) hold zeros and rank 0."""

    def __init__(self, in_features: int, slice_sizes: tuple[int, ...], max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device, batch: LoRABatch,
                 kernels: KernelConfig) -> None:
        super().__init__()
        self.slice_sizes = slice_sizes
        self.offsets = tuple(int(o) for o in np.cumsum((0,) + slice_sizes[:-1]))
        self.max_rank = max_rank
        self.batch = batch
        self.kernels = kernels
        n = len(slice_sizes)
        self.register_buffer("a", torch.zeros(max_loras, n * max_rank, in_features,
                                              dtype=dtype, device=device), persistent=False)
        self.register_buffer("b", torch.zeros(max_loras, sum(slice_sizes), max_rank,
                                              dtype=dtype, device=device), persistent=False)
        self.scaling = [[0.0] * n for _ in range(max_loras)]
        self.ranks = [[0] * n for _ in range(max_loras)]
        # CUDA keeps B multiplied by its scaling (the kernels take no scale)
        self.prescaled = device.type == "cuda"
        # [W; A_all] when riding the base weight (ride_on): `a` and the Linear's weight are
        # views of it. None while the weights move (sleep mode) and when not riding.
        self.weight_cat: torch.Tensor | None = None
        self.rides = False

    @property
    def engaged(self) -> bool:
        """Whether this step adds deltas: some token has an adapter, or a CUDA graph for
        adapter steps is being captured."""
        return self.batch.active or self.batch.force

    @torch.no_grad()
    def ride_on(self, linear: nn.Linear) -> None:
        """Make `linear.weight` (out x in) and `a` (slots x R x in) the head and the tail of
        one [out + slots * R, in] tensor, their values kept: the Linear then runs adapter
        steps as one product against the whole (forward_on_weight). The Parameter object
        stays the same; only its data moves into the new tensor."""
        n, k = linear.weight.shape
        slots, r, _ = self.a.shape
        cat = torch.empty(n + slots * r, k, dtype=self.a.dtype, device=self.a.device)
        cat[:n].copy_(linear.weight.data)
        cat[n:].copy_(self.a.reshape(slots * r, k))
        linear.weight.data = cat[:n]
        self.a = cat[n:].view(slots, r, k)
        self.weight_cat = cat
        self.rides = True

    def untie(self) -> None:
        """Before the module's tensors move (sleep mode's _apply copies the weight and `a`
        one by one, so together they take no more room than before): forget the joint
        tensor, so it does not keep the old storage alive."""
        self.weight_cat = None

    def retie(self, linear: nn.Linear) -> None:
        """After the tensors moved back: rebuild the joint tensor if this projection rode."""
        if self.rides and self.weight_cat is None:
            self.ride_on(linear)

    def forward_on_weight(self, x: torch.Tensor, out_cat: torch.Tensor) -> torch.Tensor:
        """The riding Linear's result: out_cat = x @ [W; A_all]^T (the base product, then
        every slot's shrink); adds each token's delta into the head, which it returns (a
        view with out_cat's row stride)."""
        from folio.model.kernels.lora import lora_expand
        n = sum(self.slice_sizes)
        flat = out_cat.view(-1, out_cat.shape[-1])
        t = flat.shape[0]
        out = flat[:, :n]
        lora_expand(flat[:, n:], self.b, self.batch.token_slots[:t], out, self.slice_sizes,
                    self.max_rank, token_order=self.batch.token_order[:t],
                    pdl=self.kernels.pdl_on, u_slot_stride=self.a.shape[1])
        return out_cat[..., :n]

    @torch.no_grad()
    def load_slice(self, slot: int, index: int, a: torch.Tensor | None,
                   b: torch.Tensor | None, scaling: float) -> None:
        """Slot `slot`'s slice `index`: A [r, in], B [size, r], or None to clear it."""
        r0 = index * self.max_rank
        lo, size = self.offsets[index], self.slice_sizes[index]
        self.a[slot, r0:r0 + self.max_rank].zero_()
        self.b[slot, lo:lo + size].zero_()
        if a is None:
            self.scaling[slot][index], self.ranks[slot][index] = 0.0, 0
            return
        rank = a.shape[0]
        self.a[slot, r0:r0 + rank].copy_(a, non_blocking=True)
        if self.prescaled:
            self.b[slot, lo:lo + size, :rank].copy_((b.float() * scaling).to(self.b.dtype))
        else:
            self.b[slot, lo:lo + size, :rank].copy_(b, non_blocking=True)
        self.scaling[slot][index], self.ranks[slot][index] = scaling, rank

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x, [T, out]) plus each token's adapter's delta."""
        if not self.engaged:
            return y   # no adapter in this step: the base model's cost only
        if x.is_cuda and self.kernels.fused_kernels:
            from folio.model.kernels._common import HAS_TRITON
            if HAS_TRITON:
                return self._forward_triton(x, y)
        return self._forward_torch(x, y)

    def _forward_triton(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from folio.model.kernels.lora import (FUSED_MAX_T, lora_expand, lora_shrink,
                                              lora_shrink_expand)
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        t = x2.shape[0]
        slots = self.batch.token_slots[:t]
        # PDL, as the projections around them: each launch overlaps the previous kernel's tail
        pdl = self.kernels.pdl_on
        if t <= FUSED_MAX_T:
            # A few tokens: one launch instead of two (launches, not bytes, are the cost).
            lora_shrink_expand(x2, self.a, self.b, slots, y2, self.slice_sizes, self.max_rank,
                               pdl=pdl)
            return y
        order = self.batch.token_order[:t]
        buf = torch.empty((t, self.a.shape[1]), dtype=torch.float32, device=x.device)
        lora_shrink(x2, self.a, slots, buf, token_order=order, pdl=pdl)
        lora_expand(buf, self.b, slots, y2, self.slice_sizes, self.max_rank, token_order=order,
                    pdl=pdl)
        return y

    def _forward_torch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per adapter of the step: one product with all its slices' A (each output column
        is its own dot product, so the zero-padded rows change no real one), then per slice
        y += scaling * (A x) B^T at the slice's own rank, in one addmm (PEFT's product,
        scaled, then added). Few, larger ops: a decode step calls this 7 times a layer."""
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for slot, rows in self.batch.groups:
            ranks = self.ranks[slot]
            xs = x2[rows]
            used = (max(i for i, r in enumerate(ranks) if r) + 1) * self.max_rank \
                if any(ranks) else 0
            if not used:
                continue
            buf = xs @ self.a[slot, :used].t()
            out = y2[rows] if not isinstance(rows, slice) else None
            for index, rank in enumerate(ranks):
                if rank == 0:
                    continue
                r0 = index * self.max_rank
                lo, hi = self.offsets[index], self.offsets[index] + self.slice_sizes[index]
                alpha = 1.0 if self.prescaled else self.scaling[slot][index]
                target = y2[rows, lo:hi] if out is None else out[:, lo:hi]
                target.addmm_(buf[:, r0:r0 + rank], self.b[slot, lo:hi, :rank].t(), alpha=alpha)
            if out is not None:
                y2[rows] = out
        return y


# The merged projection each checkpoint projection lives in, and its slice there.
_PLACEMENT = {"q": ("self_attn.qkv_proj", 0), "k": ("self_attn.qkv_proj", 1),
              "v": ("self_attn.qkv_proj", 2), "o": ("self_attn.o_proj", 0),
              "gate": ("mlp.gate_up_proj", 0), "up": ("mlp.gate_up_proj", 1),
              "down": ("mlp.down_proj", 0)}


def can_ride(linear: nn.Linear, kernels: KernelConfig) -> bool:
    """Whether `linear`'s adapters may ride its weight (LoRAProjection.ride_on): a plain
    fp16/bf16 CUDA matrix (not a quantized one) without bias, and the Triton kernels on."""
    from folio.model.kernels._common import HAS_TRITON
    weight = linear.weight
    return (HAS_TRITON and kernels.fused_kernels and kernels.lora_on_weight
            and weight.is_cuda and weight.dim() == 2 and weight.numel() > 0
            and weight.dtype in (torch.float16, torch.bfloat16)
            and getattr(linear, "packed", None) is None and linear.bias is None)


def install_lora(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, batch: LoRABatch) -> dict[tuple[int, str], LoRATarget]:
    """Give every q/k/v/o/gate/up/down projection of `model`'s layers a LoRAProjection (the
    Linear calls it after its own product); returns where each (layer, projection) goes."""
    targets: dict[tuple[int, str], LoRATarget] = {}
    kernels = model.kernel_config
    for i, layer in enumerate(model.layers):
        made: dict[str, LoRAProjection] = {}
        for proj in PROJECTIONS:
            path, index = _PLACEMENT[proj]
            if path not in made:
                linear = layer.get_submodule(path)
                sizes = tuple(size for _, size in linear.shard_offsets.values()) \
                    if hasattr(linear, "shard_offsets") else (linear.out_features,)
                linear.lora = LoRAProjection(linear.in_features, sizes, max_loras, max_rank,
                                             dtype, device, batch, kernels)
                if can_ride(linear, kernels):
                    linear.lora.ride_on(linear)
                made[path] = linear.lora
            targets[(i, proj)] = LoRATarget(made[path], index)
    return targets


def untie_all(targets: dict[tuple[int, str], LoRATarget]) -> None:
    """Before the model's tensors move (sleep mode): see LoRAProjection.untie."""
    for target in targets.values():
        target.projection.untie()


def retie_all(model: nn.Module) -> None:
    """After the model's tensors moved back: see LoRAProjection.retie."""
    for module in model.modules():
        lora = getattr(module, "lora", None)
        if isinstance(lora, LoRAProjection):
            lora.retie(module)


def load_into_slot(targets: dict[tuple[int, str], LoRATarget], slot: int,
                   weights: AdapterWeights | None) -> None:
    """Slot `slot` holds `weights` (None: empty) in every projection, the ones the adapter
    leaves alone cleared."""
    for key, target in targets.items():
        w = None if weights is None else weights.projections.get(key)
        if w is None:
            target.projection.load_slice(slot, target.slice_index, None, None, 0.0)
        else:
            target.projection.load_slice(slot, target.slice_index, w.a, w.b, w.scaling)
