"""Memory-bandwidth and compute roofs for decode and prefill.

The accounting follows the project's reference script (shared/tools/roofline.py): every decode
step reads *all* stored parameters once (a tied embedding/lm_head counts once, an untied pair
counts twice; the embedding table is counted whole even though a step only gathers a few rows,
which matches the reference -- and is not small at large vocabularies: Llama-3-8B's 1.05 GB
table is 6.5 % of its bf16 bytes and 11.5 % of its FP8 ones, so the floor is that much above
a step's true minimum and a share of it reads that much higher), plus the K and V of
every cached token of every running sequence. Bandwidth and
FLOP/s are measured on the device at hand rather than taken from a datasheet, because the
copy bandwidth achievable by kernels is what bounds decode, not the marketing number.

Kept free of folio imports (torch only, lazily) so it can be used from any benchmark process.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Mapping

__all__ = ["count_params", "decode_bytes_per_step", "kv_bytes_per_token", "load_config",
           "best_copy_bandwidth", "copy_bandwidth_before_engine", "last_level_cache_bytes",
           "matmul_peak_flops", "measure_copy_bandwidth", "offline_floor", "prefill_flops",
           "projection_params", "roofline_line", "weight_bytes"]


def load_config(model_dir_or_config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A plain dict of HF config fields, from a model directory, a config.json path or a dict."""
    if isinstance(model_dir_or_config, Mapping):
        return dict(model_dir_or_config)
    path = os.fspath(model_dir_or_config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _head_dim(cfg: Mapping[str, Any]) -> int:
    # Qwen3 and Mistral set head_dim explicitly (and it may differ from hidden/heads).
    head_dim = cfg.get("head_dim")
    return int(head_dim) if head_dim else cfg["hidden_size"] // cfg["num_attention_heads"]


def _num_kv_heads(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])


def _moe(cfg: Mapping[str, Any]) -> tuple[int, int, int, int, int] | None:
    """(experts, per token, expert intermediate, shared-expert intermediate, sparse layers)
    of a mixture-of-experts config (Mixtral, Qwen-MoE, DeepSeek; their sparse-layer rules),
    None for a dense one."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") \
        or cfg.get("n_routed_experts")
    if not experts:
        return None
    layers = int(cfg["num_hidden_layers"])
    inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) + \
        int(cfg.get("n_shared_experts") or 0) * inter
    if "first_k_dense_replace" in cfg:
        sparse = layers - int(cfg["first_k_dense_replace"] or 0)
    else:
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return int(experts), int(cfg["num_experts_per_tok"]), inter, shared, sparse


def _experts_read(experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a step of `batch` tokens reads, expected under uniform routing."""
    return experts * (1 - (1 - top_k / experts) ** max(batch, 1))


def _attention_params(cfg: Mapping[str, Any]) -> int:
    """One layer's attention weights: q/k/v/o heads, or DeepSeek's latent projections."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if cfg.get("kv_lora_rank"):
        nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
        kv_lora, v = int(cfg["kv_lora_rank"]), int(cfg["v_head_dim"])
        q_lora = cfg.get("q_lora_rank")
        q = hidden * heads * (nope + rope) if not q_lora else \
            hidden * q_lora + q_lora + q_lora * heads * (nope + rope)
        return q + hidden * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v) \
            + heads * v * hidden
    q_out, kv_out = heads * _head_dim(cfg), _num_kv_heads(cfg) * _head_dim(cfg)
    return 2 * hidden * q_out + 2 * hidden * kv_out


def count_params(cfg: Mapping[str, Any], active_batch: int | None = None) -> int:
    """Stored parameters of a decoder (Llama-family: llama, mistral, qwen2, qwen3; the
    mixtures of experts and DeepSeek's latent attention) from its config. `active_batch`: of
    a mixture of experts, count only the experts a step of that many tokens is expected to
    read (what bounds decode) instead of all of them.

    Analytic rather than read from the checkpoint so it works on a bare config (the random
    `--config` shapes) and gives hand-checkable numbers; the test cross-checks it against a
    real checkpoint's tensor sizes."""
    hidden = int(cfg["hidden_size"])
    inter = int(cfg["intermediate_size"])
    vocab = int(cfg["vocab_size"])
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = _num_kv_heads(cfg)
    head_dim = _head_dim(cfg)
    model_type = cfg.get("model_type", "llama")

    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attn = _attention_params(cfg)
    if model_type in ("qwen2", "qwen2_moe"):
        attn += q_out + 2 * kv_out                   # q/k/v biases, no o_proj bias
    elif cfg.get("attention_bias"):
        attn += q_out + 2 * kv_out + hidden          # llama-style: all four projections
    if model_type in ("qwen3", "qwen3_moe"):
        attn += 2 * head_dim                         # per-head q_norm and k_norm gains
    mlp = 3 * hidden * inter
    if cfg.get("mlp_bias"):
        mlp += 2 * inter + hidden
    norms = 2 * hidden                               # input and post-attention RMSNorm
    per_layer = attn + mlp + norms
    body = layers * per_layer
    moe = _moe(cfg)
    if moe is not None:
        experts, top_k, expert_inter, shared, sparse = moe
        read = experts if active_batch is None else _experts_read(experts, top_k, active_batch)
        sparse_mlp = read * 3 * hidden * expert_inter + hidden * experts \
            + 3 * hidden * shared + (hidden if cfg.get("shared_expert_intermediate_size") else 0) \
            + (experts if model_type == "deepseek_v3" else 0)  # V3's router correction bias
        body += sparse * (round(sparse_mlp) - mlp)

    embed = vocab * hidden
    lm_head = 0 if cfg.get("tie_word_embeddings", False) else vocab * hidden
    return embed + body + hidden + lm_head  # + final norm


def projection_params(cfg: Mapping[str, Any], active_batch: int | None = None) -> int:
    """Weights of the decoder layers' projections (q, k, v, o, gate, up, down; of a mixture
    of experts' sparse layers, the experts (those `active_batch` tokens are expected to read,
    as count_params counts them) and the shared expert in place of the dense MLP): the
    matrices a quantized checkpoint stores in fewer bits (biases, norms, routers, embeddings
    and the lm_head stay in the model dtype)."""
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    layers = int(cfg["num_hidden_layers"])
    q_out = int(cfg["num_attention_heads"]) * _head_dim(cfg)
    kv_out = _num_kv_heads(cfg) * _head_dim(cfg)
    attention = 2 * hidden * q_out + 2 * hidden * kv_out
    dense_mlp = 3 * hidden * inter
    total = layers * (attention + dense_mlp)
    moe = _moe(cfg)
    if moe is not None:
        experts, top_k, expert_inter, shared, sparse = moe
        read = experts if active_batch is None else _experts_read(experts, top_k, active_batch)
        sparse_mlp = read * 3 * hidden * expert_inter + 3 * hidden * shared
        total += sparse * (round(sparse_mlp) - dense_mlp)
    return total


def weight_bytes(cfg: Mapping[str, Any], dtype_bytes: int = 2,
                 projection_bits: float | None = None, active_batch: int | None = None) -> float:
    """Bytes of the stored weights: every parameter in `dtype_bytes`, except the projections
    at `projection_bits` per weight when given (a quantized model: the codes plus their share
    of scales and zero points, e.g. 4 + 16/128 for INT4 with bf16 scales per group of 128).
    `active_batch`: a mixture of experts' weights a step of that many tokens reads
    (count_params)."""
    params = count_params(cfg, active_batch)
    if projection_bits is None:
        return float(params * dtype_bytes)
    proj = projection_params(cfg, active_batch)
    return (params - proj) * dtype_bytes + proj * projection_bits / 8


def prefill_flops(model_dir_or_config: str | os.PathLike | Mapping[str, Any], batch: int,
                  prompt_len: int) -> int:
    """FLOPs of prefilling `batch` prompts of `prompt_len` tokens and taking one token's
    logits per prompt (the TTFT step): 2 per weight per token through the layers, causal
    attention (QKᵀ and PV over the lower triangle: 2·heads·head_dim·n² per layer), and the
    LM head for the last token only."""
    cfg = load_config(model_dir_or_config)
    hidden = int(cfg["hidden_size"])
    layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    head_dim = _head_dim(cfg)
    linear = 2 * _layer_weights_per_token(cfg) * prompt_len
    attention = 2 * heads * head_dim * prompt_len * prompt_len * layers
    lm_head = 2 * hidden * int(cfg["vocab_size"])
    return batch * (linear + attention + lm_head)


def _layer_weights_per_token(cfg: Mapping[str, Any]) -> int:
    """The decoder layers' weights one token multiplies (a mixture of experts: its top-k
    experts only): without the embedding, the output matrix and the RMSNorm gains."""
    hidden = int(cfg["hidden_size"])
    tables = int(cfg["vocab_size"]) * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    norms = (2 * int(cfg["num_hidden_layers"]) + 1) * hidden
    return count_params(cfg, active_batch=1) - tables - norms


def kv_bytes_per_token(cfg: Mapping[str, Any], dtype_bytes: int = 2) -> int:
    """K and V of one token across all layers (the reference script's formula); for latent
    attention the one latent (kv_lora_rank + qk_rope_head_dim) per layer."""
    if cfg.get("kv_lora_rank"):
        width = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
        return int(cfg["num_hidden_layers"]) * width * dtype_bytes
    return int(cfg["num_hidden_layers"]) * _num_kv_heads(cfg) * _head_dim(cfg) * 2 * dtype_bytes


def decode_bytes_per_step(model_dir_or_config: str | os.PathLike | Mapping[str, Any],
                          batch: int, context_len: int, dtype_bytes: int = 2,
                          projection_bits: float | None = None,
                          kv_dtype_bytes: int | None = None,
                          stored_weight_bytes: float | None = None) -> int:
    """Bytes one decode step must read: all weights once (shared by the batch; `weight_bytes`;
    of a mixture of experts, the experts `batch` tokens are expected to touch) plus the KV
    cache of `context_len` tokens for each of `batch` sequences, in `kv_dtype_bytes` per
    element (default: the model's). `stored_weight_bytes`: the running model's own weight
    bytes, counted from its tensors, in place of the formula for a dense model (weights kept
    in a GGUF file's packed forms, whose bits per weight differ by tensor)."""
    cfg = load_config(model_dir_or_config)
    kv = kv_bytes_per_token(cfg, kv_dtype_bytes or dtype_bytes)
    weights = stored_weight_bytes if stored_weight_bytes is not None and _moe(cfg) is None \
        else weight_bytes(cfg, dtype_bytes, projection_bits, active_batch=batch)
    return int(weights + batch * context_len * kv)


def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache, from Linux's sysfs (None where it cannot be read). A decode
    step whose bytes fit in it can run above the DRAM floor that the copy probe measures."""
    import glob
    largest = None
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
        largest = value if largest is None else max(largest, value)
    return largest


def offline_floor(model_dir_or_config: str | os.PathLike | Mapping[str, Any],
                  prompt_lens: list[int], output_lens: list[int], bandwidth: float,
                  flops: float, dtype_bytes: int = 2, projection_bits: float | None = None,
                  kv_dtype_bytes: int | None = None,
                  stored_weight_bytes: float | None = None) -> dict[str, float]:
    """The floor of an offline batch, by the reference script's model: every request runs from
    the start (a lower bound when fewer fit at once); decode step s reads all weights once plus
    the KV of each request still generating (its prompt + s tokens) and costs
    max(bytes / bandwidth, 2·params·running / flops); the prompts' prefill adds 2·params per
    prompt token at `flops`. Returns the floor in seconds and its parts. `projection_bits`,
    `kv_dtype_bytes` and `stored_weight_bytes`: a quantized model's weights and KV cache
    (decode_bytes_per_step)."""
    cfg = load_config(model_dir_or_config)
    params = count_params(cfg, active_batch=1)  # of a mixture, a token's top-k experts only
    kv_token = kv_bytes_per_token(cfg, kv_dtype_bytes or dtype_bytes)
    moe = _moe(cfg)
    # Requests leave in order of output length; keep the running count and prompt-token sum.
    by_output = sorted(zip(output_lens, prompt_lens))
    running, prompt_sum = len(by_output), sum(prompt_lens)
    nxt = 0
    decode_s = memory_s = 0.0
    for step in range(max(output_lens, default=0)):
        while nxt < len(by_output) and by_output[nxt][0] <= step:
            running -= 1
            prompt_sum -= by_output[nxt][1]
            nxt += 1
        # all weights (of a mixture, the experts this step's tokens are expected to touch)
        stored = stored_weight_bytes if stored_weight_bytes is not None and moe is None \
            else weight_bytes(cfg, dtype_bytes, projection_bits, active_batch=running)
        mem = (stored + (prompt_sum + step * running) * kv_token) / bandwidth
        memory_s += mem
        decode_s += max(mem, 2 * params * running / flops)
    prefill_s = 2 * params * sum(prompt_lens) / flops
    return {"floor_s": decode_s + prefill_s, "decode_s": decode_s, "memory_s": memory_s,
            "prefill_s": prefill_s, "output_tokens": float(sum(output_lens))}


def _device(device: Any) -> Any:
    import torch
    return device if isinstance(device, torch.device) else torch.device(str(device))


def measure_copy_bandwidth(device: Any = "cpu", nbytes: int | None = None,
                           iters: int | None = None) -> float:
    """Achievable memory bandwidth in bytes/s: bytes read + written by a large copy.

    CUDA: the best of `iters` (default 15) device-to-device copies of 4 GiB (less if the device
    has not the room for two such buffers; never below 1 GiB), after three untimed ones, timed
    with CUDA events. The best, not the
    median, of large copies: on an H200 the median of 1 GiB copies read 3.63-3.76 TB/s where
    the best 4 GiB copies read 4.26-4.28 TB/s, the rate the hardware sustains and so the
    roof a decode step's kernels can reach; the smaller figure overstated every "% of
    roofline" by ~12 %. CPU: a 256 MiB tensor clone timed with perf_counter, median of
    `iters`. The buffer must be far larger than the last-level cache, or we would measure
    cache bandwidth."""
    import torch
    dev = _device(device)
    if iters is None:
        iters = 15 if dev.type == "cuda" else 7
    if nbytes is None:
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            nbytes = max(1 << 30, min(4 << 30, int(free * 0.45) >> 20 << 20))
            if nbytes < 4 << 30:
                # smaller copies read less (1 GiB: ~12 % less on an H200): say so beside the
                # figure rather than let a busy device lower the roof unseen
                print(f"bandwidth probe: {free / 2**30:.1f} GiB free, so {nbytes / 2**30:.2f} "
                      f"GiB copies (not 4 GiB); the roof may read low", file=sys.stderr)
        else:
            nbytes = 256 << 20
    numel = nbytes // 4
    src = torch.empty(numel, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    moved = 2 * numel * 4                            # every byte is read once and written once
    times: list[float] = []
    if dev.type == "cuda":
        for _ in range(3):                           # warm-up (and the clocks up)
            dst.copy_(src)
        torch.cuda.synchronize(dev)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        best = min(times)
    else:
        dst = src.clone()                            # warm-up: faults in the pages
        for _ in range(iters):
            t0 = time.perf_counter()
            dst = src.clone()
            times.append(time.perf_counter() - t0)
        best = statistics.median(times)
    del src, dst
    return moved / best


def copy_bandwidth_before_engine(engine_kwargs: Mapping[str, Any]) -> float | None:
    """The copy bandwidth of the CUDA device a benchmark's engine is about to use, measured
    before the engine starts; None where the engine runs on the CPU (`device` "cpu", or
    "auto" without a GPU) or outside this process (the mp and ray executors, tensor or
    pipeline parallelism: their benches take no roofline, and a CUDA context here would sit
    on the first GPU beside a worker). The probe's buffers go back to the driver at once, so
    the engine's memory profile sees them free.

    Why before: on an H100 the probe after a latency run read 2.62 TB/s where the same card's
    fresh probes read 3.03 TB/s, which put bf16 decode at 109 % of its roofline. The bench
    takes the better of the two probes (`best_copy_bandwidth`): a copy can only run slow,
    never faster than the card allows."""
    if engine_kwargs.get("device", "auto") == "cpu":
        return None
    if engine_kwargs.get("distributed_executor_backend") in ("mp", "ray") \
            or engine_kwargs.get("tensor_parallel_size", 1) != 1 \
            or engine_kwargs.get("pipeline_parallel_size", 1) != 1:
        return None
    import torch
    if not torch.cuda.is_available():
        return None
    bandwidth = measure_copy_bandwidth("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return bandwidth


def best_copy_bandwidth(device: Any, before_engine: float | None) -> float:
    """The copy bandwidth measured now on `device`, or the probe taken before the engine
    started where that read higher (copy_bandwidth_before_engine)."""
    now = measure_copy_bandwidth(device)
    return max(now, before_engine or 0.0)


def matmul_peak_flops(device: Any = "cpu", dtype: Any = None, n: int | None = None,
                      iters: int = 5) -> float:
    """Achieved dense-matmul FLOP/s (2·n³ per n×n×n product), median of `iters` runs.

    Defaults: bf16 at n=8192 on CUDA (tensor-core peak, the roof for prefill/TTFT); fp32 at
    n=1024 on CPU (bf16 matmul on CPU is often emulated and would understate the roof)."""
    import torch
    dev = _device(device)
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if n is None:
        n = 8192 if dev.type == "cuda" else 1024
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    times: list[float] = []
    torch.matmul(a, b)                               # warm-up: picks the kernel / thread pool
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


def roofline_line(floor_s_per_token: float, bandwidth: float, achieved_s_per_token: float,
                  step_bytes: float | None = None, cache_bytes: int | None = None) -> str:
    """The one-line verdict printed by the benchmarks. With `cache_bytes` (a CPU's last-level
    cache) at least `step_bytes`, it says the step fits there: the floor is DRAM's, and the
    step need not touch DRAM (the default model's 99 MB on this project's 480 MiB-L3 VM)."""
    pct = 100.0 * floor_s_per_token / achieved_s_per_token if achieved_s_per_token > 0 else 0.0
    line = (f"roofline: {floor_s_per_token * 1e3:.3f} ms/token at {bandwidth / 1e9:.1f} GB/s "
            f"measured → achieved {pct:.1f}% of roofline")
    if step_bytes is not None and cache_bytes is not None and step_bytes <= cache_bytes:
        line += (f" (the step's {step_bytes / 1e6:.0f} MB fit the CPU's "
                 f"{cache_bytes / 2**20:.0f} MiB last-level cache: the floor is DRAM's)")
    return line
