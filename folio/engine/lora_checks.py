"""The front end's checks of a request's LoRA adapter, before the engine core sees it: LoRA
is on, the LoRARequest is well formed, its id names one adapter only, and its directory is a
PEFT adapter that fits the model and --max-lora-rank (read once, then remembered)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from folio.config import LoRAConfig
from folio.lora.request import LoRARequest
from folio.model.families import ArchSpec, arch_spec_from_hf_config
from folio.model.lora.adapter_files import AdapterFiles, read_adapter

# Checked adapters remembered (each is a few hundred bytes of names and shapes).
_MAX_REMEMBERED = 1024


class LoRAChecker:
    def __init__(self, config: LoRAConfig | None, hf_config: Any) -> None:
        self.config = config
        self._hf_config = hf_config
        self._spec: ArchSpec | None = None   # the model's shapes, read on the first check
        self._checked: OrderedDict[int, tuple[LoRARequest, AdapterFiles]] = OrderedDict()

    def check(self, lora_request: Any) -> AdapterFiles:
        """The adapter's files, or a ValueError naming the problem."""
        if self.config is None:
            raise ValueError("lora_request: LoRA adapters are not enabled (start the engine "
                             "with enable_lora=True / --enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        known = self._checked.get(lora_request.lora_int_id)
        if known is not None:
            seen, files = known
            if (seen.lora_name, seen.lora_path) != (lora_request.lora_name,
                                                    lora_request.lora_path):
                raise ValueError(
                    f"lora_int_id {lora_request.lora_int_id} already names adapter "
                    f"{seen.lora_name!r} ({seen.lora_path}); each adapter needs its own id")
            self._checked.move_to_end(lora_request.lora_int_id)
            return files
        if self._spec is None:
            self._spec = arch_spec_from_hf_config(self._hf_config)
        files = read_adapter(lora_request.lora_path, self._spec, self.config.max_lora_rank)
        self._checked[lora_request.lora_int_id] = (lora_request, files)
        while len(self._checked) > _MAX_REMEMBERED:
            self._checked.popitem(last=False)
        return files

    def forget(self, lora_int_id: int) -> None:
        """Drop an unloaded adapter's record (its id may then name another adapter)."""
        self._checked.pop(lora_int_id, None)
