"""An adapter's tensors, read from its safetensors file (no pickle) into host memory: per
projection its A [rank, in], B [out, rank] and PEFT's scaling, in the model's dtype."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from folio.model.lora.adapter_files import AdapterFiles


@dataclass
class ProjectionWeights:
    a: torch.Tensor        # [rank, in_features]
    b: torch.Tensor        # [out_features, rank]
    scaling: float


@dataclass
class AdapterWeights:
    files: AdapterFiles
    # (layer, projection) -> its weights; projections the adapter leaves alone are absent.
    projections: dict[tuple[int, str], ProjectionWeights]

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.projections.values())


def load_adapter_weights(files: AdapterFiles, dtype: torch.dtype,
                         pin: bool = False) -> AdapterWeights:
    """The tensors `files` (already checked: adapter_files.read_adapter) names, cast to
    `dtype`; pinned host memory when `pin`, for asynchronous copies into a device slot."""
    projections = {}
    with safe_open(files.weights_path, framework="pt", device="cpu") as f:
        for module in files.modules:
            a = f.get_tensor(module.a_name).to(dtype).contiguous()
            b = f.get_tensor(module.b_name).to(dtype).contiguous()
            if pin:
                a, b = a.pin_memory(), b.pin_memory()
            projections[(module.layer, module.projection)] = ProjectionWeights(
                a, b, module.scaling)
    return AdapterWeights(files, projections)
