"""The worker's LoRA adapters: which adapter each of the `max_loras` device slots holds,
adapters loaded from their files kept in host memory (LRU, `max_cpu_loras`), and each step's
token -> slot map. The scheduler never runs more distinct adapters at once than there are
slots, so a step's adapters always fit; a slot whose adapter no running request uses is
reused, least recently used first."""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from folio.config import LoRAConfig
from folio.lora.request import LoRARequest
from folio.model.families import ArchSpec
from folio.model.lora.adapter_files import read_adapter
from folio.model.lora.projection import (LoRABatch, install_lora, load_into_slot, retie_all,
                                         untie_all)
from folio.model.lora.weights import AdapterWeights, load_adapter_weights

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, spec: ArchSpec, config: LoRAConfig,
                 dtype: torch.dtype, device: torch.device, max_num_tokens: int) -> None:
        self.spec = spec
        self.config = config
        self.dtype = dtype
        self.device = device
        self.batch = LoRABatch(max_num_tokens, device)
        self.targets = install_lora(model, config.max_loras, config.max_lora_rank, dtype,
                                    device, self.batch)
        # lora_int_id -> weights in host memory, least recently used first
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()
        # slot -> lora_int_id (None: empty); lora_int_id -> slot, least recently used first
        self._slot_ids: list[int | None] = [None] * config.max_loras
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        # lora_int_id -> why its load failed: its requests fail at once instead of reading
        # the files again each step, until the engine removes the id (remove_lora)
        self._failed: dict[int, str] = {}
        self.num_loads = 0          # adapters read from their files (tests, logs)

    def before_weights_move(self) -> None:
        """Sleep mode is about to move the model's tensors: riding projections let go of
        their joint [W; A_all] tensors (LoRAProjection.untie)."""
        untie_all(self.targets)

    def after_weights_move(self, model: nn.Module) -> None:
        """The model's tensors are back on the device: joint tensors rebuilt."""
        retie_all(model)

    @property
    def device_adapters(self) -> list[int]:
        return [i for i in self._slot_ids if i is not None]

    @property
    def host_adapters(self) -> list[int]:
        return list(self._host)

    def _weights(self, request: LoRARequest) -> AdapterWeights:
        weights = self._host.get(request.lora_int_id)
        if weights is not None:
            self._host.move_to_end(request.lora_int_id)
            return weights
        failure = self._failed.get(request.lora_int_id)
        if failure is not None:
            raise RuntimeError(failure)
        try:
            files = read_adapter(request.lora_path, self.spec, self.config.max_lora_rank)
            weights = load_adapter_weights(files, self.dtype, pin=self.device.type == "cuda")
        except Exception as exc:
            self._failed[request.lora_int_id] = str(exc)
            raise
        self.num_loads += 1
        logger.info("LoRA adapter %r (id %d) loaded from %s: rank %d, %d projections, %.1f MiB",
                    request.lora_name, request.lora_int_id, files.path, files.rank,
                    len(weights.projections), weights.nbytes / 2**20)
        self._host[request.lora_int_id] = weights
        while len(self._host) > self.config.max_cpu_loras:
            self._host.popitem(last=False)
        return weights

    def _slot(self, request: LoRARequest, needed: set[int]) -> int:
        """The device slot holding `request`'s adapter, loading it into a free slot or into
        the least recently used one no request of this step needs."""
        lora_id = request.lora_int_id
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_id)
            return slot
        weights = self._weights(request)   # first: a failed load leaves the slots as they were
        if None in self._slot_ids:
            slot = self._slot_ids.index(None)
        else:
            victim = next((i for i in self._slot_of if i not in needed), None)
            if victim is None:
                raise RuntimeError(f"a step needs more than max_loras "
                                   f"({self.config.max_loras}) adapters")
            slot = self._slot_of.pop(victim)
        load_into_slot(self.targets, slot, weights)
        self._slot_ids[slot] = lora_id
        self._slot_of[lora_id] = slot
        return slot

    def remove(self, lora_ids: list[int]) -> None:
        """The engine removed these adapters (SchedulerOutput.removed_lora_ids; no request of
        the step uses them): their host copies go, their device slots are free (marked only:
        loading an adapter writes every projection of its slot) and a failed load is
        forgotten, so the id reads its files again if a request brings it back."""
        for lora_id in lora_ids:
            self._host.pop(lora_id, None)
            self._failed.pop(lora_id, None)
            slot = self._slot_of.pop(lora_id, None)
            if slot is not None:
                self._slot_ids[slot] = None

    def set_step(self, requests: list[tuple[str, LoRARequest | None]],
                 counts: list[int]) -> dict[str, str]:
        """The step's requests (id, adapter or None for the base model) and token counts, in
        flat-batch order: load what is missing into slots, and set the token -> slot map.
        Returns the requests whose adapter failed to load (its files changed or vanished
        since the front end checked them), with the reason: they run this step without an
        adapter and the scheduler finishes them with an error; the others go on."""
        needed = {r.lora_int_id for _, r in requests if r is not None}
        slots, failed = [], {}
        for rid, request in requests:
            slot = -1
            if request is not None:
                try:
                    slot = self._slot(request, needed)
                except Exception as exc:  # noqa: BLE001 - any load failure fails the request only
                    failed[rid] = f"LoRA adapter {request.lora_name!r} failed to load: {exc}"
                    logger.error("%s", failed[rid])
            slots.append(slot)
        self.batch.set(np.repeat(np.asarray(slots, dtype=np.int32),
                                 np.asarray(counts, dtype=np.int64)))
        return failed

    def clear(self) -> None:
        """No adapter for any token (warm-up, profiling, graph capture)."""
        self.batch.set(np.zeros(0, dtype=np.int32))
