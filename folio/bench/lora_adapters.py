"""`--lora N` of `folio bench latency` / `throughput`: N random LoRA adapters in PEFT's file
layout for the model being measured (rank `--lora-rank` on every q/k/v/o/gate/up/down
projection, written where the engine reads adapters from), and the requests spread over
them round-robin. The adapters are random: the benchmark measures the cost of applying
them, which does not depend on their values."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from folio.lora.request import LoRARequest



def add_lora_bench_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA")
    group.add_argument("--lora", type=int, default=0, metavar="N",
                       help="run the requests on N random LoRA adapters (round-robin; "
                            "implies --enable-lora, --max-loras N unless given larger)")
    group.add_argument("--lora-rank", type=int, default=16,
                       help="rank of --lora's adapters (every q/k/v/o/gate/up/down projection)")


def lora_engine_kwargs(args: argparse.Namespace, kwargs: dict[str, Any]) -> None:
    """LLM(...) arguments for --lora: LoRA on, slots for every adapter, their rank allowed."""
    if not args.lora:
        return
    if args.lora < 0 or args.lora_rank < 1:
        raise ValueError("--lora and --lora-rank must be positive")
    config = dict(kwargs.get("lora_config") or {})
    config["max_loras"] = max(config.get("max_loras", 1), args.lora)
    config["max_cpu_loras"] = max(config.get("max_cpu_loras") or 0, config["max_loras"])
    config["max_lora_rank"] = max(config.get("max_lora_rank", 16), args.lora_rank)
    kwargs["lora_config"] = config


def write_random_adapters(hf_config: Any, num: int, rank: int, out_dir: str | None = None,
                          seed: int = 0) -> list[LoRARequest]:
    """`num` adapters for the model of `hf_config`, in `out_dir` (a new temporary directory
    by default), as LoRARequests with ids 1..num."""
    import torch
    from safetensors.torch import save_file

    from folio.model.families import arch_spec_from_hf_config
    from folio.model.lora.adapter_files import BLOCK_OF, PROJECTIONS, projection_shapes

    spec = arch_spec_from_hf_config(hf_config)
    shapes = projection_shapes(spec)
    out_dir = out_dir or tempfile.mkdtemp(prefix="folio-bench-lora-")
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for n in range(num):
        path = os.path.join(out_dir, f"adapter{n}")
        os.makedirs(path, exist_ok=True)
        tensors = {}
        for layer in range(spec.num_layers):
            for proj in PROJECTIONS:
                in_f, out_f = shapes[proj]
                prefix = f"base_model.model.model.layers.{layer}.{BLOCK_OF[proj]}.{proj}_proj"
                tensors[f"{prefix}.lora_A.weight"] = (
                    torch.randn(rank, in_f, generator=gen) / in_f ** 0.5).to(torch.bfloat16)
                tensors[f"{prefix}.lora_B.weight"] = (
                    torch.randn(out_f, rank, generator=gen) * 0.01).to(torch.bfloat16)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": [f"{p}_proj" for p in PROJECTIONS], "bias": "none",
                       "task_type": "CAUSAL_LM"}, f)
        requests.append(LoRARequest(f"bench-lora-{n}", n + 1, path))
    return requests


def spread(requests: list[LoRARequest], count: int) -> list[LoRARequest] | None:
    """One adapter per request of a batch of `count`, round-robin (None without adapters)."""
    if not requests:
        return None
    return [requests[i % len(requests)] for i in range(count)]
