"""Quantized checkpoints in the formats users download, made from a float one, without a download.

Each writer reads a Llama-family Hugging Face directory of float safetensors, quantizes the seven
projections of every layer (`model.layers.N.self_attn.{q,k,v,o}_proj.weight`,
`model.layers.N.mlp.{gate,up,down}_proj.weight`, nn.Linear layout [out_features, in_features])
and writes a directory in one published checkpoint format:

* `write_compressed_tensors`: what llm-compressor writes (FP8, W8A8-INT8, W4A16), packed and
  described by the compressed-tensors library itself;
* `write_fp8`: vLLM's "fp8" format as AutoFP8 writes it (per-tensor FP8 weights);
* `write_awq`: AutoAWQ's GEMM format (int4, packed along the output dim, interleaved);
* `write_gptq`: the AutoGPTQ / GPTQModel format (int4, packed along the input dim, g_idx).

Everything else (embeddings, norms, lm_head, biases) is copied unchanged in its own dtype, with
config.json (plus the format's `quantization_config`), generation_config.json and the tokenizer
files.

How the values are chosen (`calibration`):
* "rtn" (every writer; the default): round-to-nearest with min-max scales, no data. Fast, and
  all a loader or kernel test needs, but far from what users run at 4 bits.
* "gptq" (`write_gptq`; `write_compressed_tensors` for w4a16 and w8a8-int8): GPTQ (Frantar et
  al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
  Transformers"), as GPTQ checkpoints and llm-compressor's GPTQModifier are made. The float
  model runs (transformers, CPU) over calibration text, English that ships with Python and is
  not CPython's LICENSE.txt (the perplexity tests' text): the pydoc topic texts
  (`pydoc_data.topics`) and IDLE's documentation, `calibration_tokens` windows of them
  (64 x 256 tokens: about 40 s for SmolLM2-135M on 2 CPU cores). The projections are quantized
  in the order the forward pass reaches them, each from the inputs it receives with everything
  before it already quantized (layer by layer, and q/k/v -> o -> gate/up -> down within a
  layer: "true sequential"); each one's columns are quantized in blocks with the error fed back
  into the columns not yet quantized through the inverse Hessian of the layer-wise squared error
  (H = 2 X^T X / n, dampened), group scales taken from the columns as the quantization reaches
  each group (static_groups false; true: from the weight before any update), and optionally in
  act-order (desc_act: columns by decreasing diag(H), g_idx recording each column's group).
  The code is written here from the paper. (Measured on SmolLM2-135M: see the perplexity
  tests in tests/model/test_quantized_loading.py.)

Every writer can also write `dequantized_dir`: the same model as a plain float checkpoint whose
projections are exactly the dequantized values of what was written (float32, computed from the
stored integers/FP8 values and scales), so tests can run transformers on "the same model
dequantized" as the reference for a quantized loader.

The whole model is held in memory (it is written as one `model.safetensors`; GPTQ's calibration
runs all its samples as one batch): fine for the tiny and benchmark-sized models this is for.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "CALIBRATIONS",
    "CT_SCHEMES",
    "calibration_tokens",
    "write_awq",
    "write_compressed_tensors",
    "write_fp8",
    "write_gptq",
    "write_smoothed",
]

# The tensors every writer quantizes: the attention and MLP projections of each layer.
PROJECTION_RE = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
# Copied as they are: what a loader or a chat front end reads besides config.json and weights.
_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json",
               "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json")
_FP8_MAX = 448.0   # largest finite float8_e4m3fn
CT_SCHEMES = ("fp8", "fp8-tensor", "w8a8-int8", "w4a16")
CALIBRATIONS = ("rtn", "gptq")
# The compressed-tensors schemes GPTQ can calibrate (integer weights).
_CT_GPTQ_SCHEMES = ("w8a8-int8", "w4a16")
# GPTQ's calibration set by default (calibration_tokens): this many windows of this many tokens.
CALIBRATION_SAMPLES = 64
CALIBRATION_LEN = 256
# AutoAWQ's GEMM packing: nibble slot i (bits 4i..4i+3) of each int32 holds output column
# _AWQ_ORDER[i] of its 8-column block (AutoAWQ's `order_map` in WQLinear_GEMM.from_linear; its
# unpacker undoes it with the inverse order (0, 4, 1, 5, 2, 6, 3, 7)).
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# ----------------------------------------------------------------------------------------------
# Reading the source and writing directories
# ----------------------------------------------------------------------------------------------

def _read_source(src: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and every tensor of `src` (one file or an indexed set of shards)."""
    from safetensors.torch import load_file

    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if "quantization_config" in config:
        raise ValueError(f"{src} is already quantized (its config.json has a "
                         "quantization_config); the source must be a float checkpoint")
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {src}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(os.path.join(src, name)))
    if not any(PROJECTION_RE.match(n) for n in tensors):
        raise ValueError(f"{src} has no Llama-style projection weights "
                         "(model.layers.N.self_attn.q_proj.weight, ...)")
    return config, tensors


def _projections(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in tensors if PROJECTION_RE.match(n)]


def _check_shape(name: str, weight: torch.Tensor, *, group_size: int | None = None,
                 in_multiple: int = 1, out_multiple: int = 1) -> None:
    """Refuse (ValueError naming the field) a projection the format cannot hold."""
    if weight.ndim != 2 or not weight.is_floating_point():
        raise ValueError(f"{name}: expected a 2-D float weight, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    out_features, in_features = weight.shape
    if group_size is not None and in_features % group_size:
        raise ValueError(f"{name}: in_features {in_features} is not divisible by "
                         f"group_size {group_size} (this format's groups must divide it; "
                         "GPTQ's can end a row in a shorter group)")
    if in_features % in_multiple:
        raise ValueError(f"{name}: in_features {in_features} is not divisible by {in_multiple} "
                         "(the format packs the input dim)")
    if out_features % out_multiple:
        raise ValueError(f"{name}: out_features {out_features} is not divisible by "
                         f"{out_multiple} (the format packs the output dim)")


def _check_group_size(group_size: int) -> None:
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")


def _write_dir(src: str, dst: str, config: dict[str, Any],
               tensors: dict[str, torch.Tensor]) -> None:
    """dst/: `config` as config.json, the side files of `src`, `tensors` as model.safetensors."""
    from safetensors.torch import save_file

    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("the destination must differ from the source directory")
    os.makedirs(dst, exist_ok=True)
    for name in _SIDE_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    # transformers writes config.json this way (sorted keys, indent 2).
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def _write_dequantized(src: str, dst: str | None, config: dict[str, Any],
                       tensors: dict[str, torch.Tensor],
                       dequantized: dict[str, torch.Tensor]) -> None:
    """The float reference: the source with each projection replaced by its float32 dequantized
    value; `config` is the source's (no quantization_config)."""
    if dst is None:
        return
    import torch

    for name, w in dequantized.items():
        assert w.dtype == torch.float32 and w.shape == tensors[name].shape, name
    _write_dir(src, dst, config, {**tensors, **dequantized})


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32-bit patterns -> int32 with the same bits (two's complement)."""
    import torch

    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# ----------------------------------------------------------------------------------------------
# Integer grids, round-to-nearest and GPTQ
# ----------------------------------------------------------------------------------------------


def require_compressed_tensors() -> None:
    """The quant-tools extra, or a clear exit naming it (the engine reads compressed-tensors
    checkpoints without the library; only writing them needs it)."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise SystemExit("writing compressed-tensors checkpoints needs the quant-tools "
                         "extra: pip install 'folio[quant-tools]'") from None

class _GptqGrid:
    """AutoGPTQ's quantizer conventions, codes 0..15 (the range always includes 0): sym: s =
    2 * absmax / 15 and zero 8; asym: s = (max - min) / 15 and zero = round(-min / s); s rounded
    to float16 (the packers quantize with the stored float16 scales); q = clamp(round(w / s) +
    zero, 0, 15). v1 ("gptq") cannot store a zero of 0 (zero - 1 = -1 does not fit a nibble;
    readers would get 16), so such a group and column gets zero 1 and s = max / 14 instead,
    which still covers its range."""

    def __init__(self, sym: bool, checkpoint_format: str) -> None:
        self.sym, self.v1 = sym, checkpoint_format == "gptq"

    def params(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
        if self.sym:
            hi = torch.maximum(hi, -lo)
            lo = -hi
        span = torch.where(hi - lo > 0, hi - lo, torch.full_like(hi, 2.0))  # all-zero: [-1, 1]
        scales = (span / 15).to(torch.float16).float()
        if self.sym:
            return scales, torch.full_like(scales, 8.0)
        zeros = torch.round(-lo / scales).clamp(0, 15)
        if self.v1:
            unstorable = zeros == 0
            stretched = (hi.clamp(min=1e-5) / 14).to(torch.float16).float()
            scales = torch.where(unstorable, stretched, scales)
            zeros = torch.where(unstorable, torch.ones_like(zeros), zeros)
        return scales, zeros

    def codes(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        import torch

        return (torch.round(w / scale) + zero).clamp(0, 15)


class _CtGrid:
    """compressed-tensors' conventions for integer weights (`args`: the scheme's weight
    QuantizationArgs): scale and zero point from the library's `calculate_qparams` (see
    `_minmax_qparams`), codes as its quantizer makes them: round(clamp(w / s + zero, qmin,
    qmax)), qmin..qmax = -2^(bits-1)..2^(bits-1) - 1. So the library's compressor, handed the
    dequantized weight and these qparams, reproduces the codes exactly. The scale is rounded
    to `dtype`, the weight's (the dtype llm-compressor stores it in)."""

    def __init__(self, args: Any, dtype: torch.dtype) -> None:
        require_compressed_tensors()
        from compressed_tensors.quantization.utils import calculate_range

        self.args, self.dtype = args, dtype
        qmin, qmax = calculate_range(args, "cpu")
        self.qmin, self.qmax = float(qmin), float(qmax)

    def params(self, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from compressed_tensors.quantization.utils import calculate_qparams

        scale, zero = calculate_qparams(lo.to(self.dtype), hi.to(self.dtype), self.args)
        return scale.float(), zero.float()

    def codes(self, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        import torch

        return torch.round((w / scale + zero).clamp(self.qmin, self.qmax))


_Grid = _GptqGrid | _CtGrid


@dataclass
class _Solved:
    """One quantized weight [N, K]: integer `codes` (float tensor), `scale` and `zero`
    [N, n_groups], `g_idx` [K] (int64) the group of each input channel;
    w[n, k] = (codes[n, k] - zero[n, g_idx[k]]) * scale[n, g_idx[k]]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return (self.codes - self.zero[:, self.g_idx]) * self.scale[:, self.g_idx]

    def rows(self, start: int, stop: int) -> _Solved:
        return _Solved(self.codes[start:stop], self.scale[start:stop], self.zero[start:stop],
                       self.g_idx)


def _groups_of(order: torch.Tensor, group_size: int) -> torch.Tensor:
    """g_idx when the input channels are taken in `order` (a permutation of 0..K-1), the first
    group_size of them forming group 0 and so on."""
    import torch

    g_idx = torch.empty(len(order), dtype=torch.int64)
    g_idx[order] = torch.arange(len(order)) // group_size
    return g_idx


def _group_extremes(columns: torch.Tensor,
                    group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The min and max of each run of group_size consecutive columns of [N, K] -> two
    [N, ceil(K / G)] (the last run shorter where G does not divide K: GPTQ's last group)."""
    import torch

    n, k = columns.shape
    pad = -k % group_size
    if pad:   # the last column repeated: the short group's extremes stay its own
        columns = torch.cat([columns, columns[:, -1:].expand(n, pad)], dim=1)
    grouped = columns.reshape(n, -1, group_size)
    return grouped.amin(dim=2), grouped.amax(dim=2)


def _rtn_solve(weight: torch.Tensor, grid: _Grid, group_size: int,
               order: torch.Tensor) -> _Solved:
    """Round-to-nearest: each group's scale and zero from its min and max."""
    w = weight.float()
    scale, zero = grid.params(*_group_extremes(w[:, order], group_size))
    g_idx = _groups_of(order, group_size)
    return _Solved(grid.codes(w, scale[:, g_idx], zero[:, g_idx]), scale, zero, g_idx)


def _inverse_cholesky(hessian: torch.Tensor) -> torch.Tensor:
    """The upper triangular U with U^T U = H^-1 (float64 in, float64 out). A Hessian that is
    not numerically positive definite gets ten times more dampening until it is."""
    import torch

    damp = 0.0
    mean_diag = float(hessian.diagonal().mean())
    for _ in range(8):
        h = hessian + damp * torch.eye(len(hessian), dtype=hessian.dtype)
        lower, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            # (cholesky_solve against I: much faster on the CPU than cholesky_inverse)
            inverse = torch.cholesky_solve(torch.eye(len(h), dtype=h.dtype), lower)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper
        damp = max(damp * 10, mean_diag * 1e-3)
    raise ValueError("the calibration Hessian is not positive definite even after dampening")


def _gptq_solve(weight: torch.Tensor, hessian: torch.Tensor, grid: _Grid, group_size: int,
                *, act_order: bool, damp_percent: float, static_groups: bool = False,
                block_size: int = 128) -> _Solved:
    """GPTQ on one weight W [N, K] (rows quantized independently, all with the same H [K, K]).

    The layer-wise objective is ||W X - Q X||^2 with H = 2 X^T X. Columns are quantized one at
    a time (act_order: in order of decreasing diag(H), the most active inputs first); the
    error e of column c, divided by U[c, c] (U upper triangular, U^T U = H^-1), is fed back
    into every later column j as -e * U[c, j]: the optimal update of the weights not yet
    quantized (Optimal Brain Surgeon's; the rows of U are the rows of the successive inverse
    Hessians, all computed by one Cholesky factorization). Within a block of columns a column
    receives the errors of the block's earlier columns when its turn comes; the columns after
    the block receive the whole block's at once (lazy batching). A group's scale and zero are
    taken, as the quantization reaches its first column, from its columns' current (updated)
    values; blocks hold whole groups, so those values are final. static_groups: the groups
    are the input channels k // G whatever the order, their scales and zeros taken from the
    weight before any update (so act-order needs no g_idx: llm-compressor's actorder
    "weight"). Dampening adds damp_percent * mean(diag H) to the diagonal; an input channel
    the calibration never saw (H[c, c] = 0) is quantized on its own (no feedback through it).
    """
    import torch

    n, k = weight.shape
    h = hessian.double().clone()
    dead = h.diagonal() <= 0
    h[dead, dead] = 1.0
    order = (torch.argsort(h.diagonal(), descending=True, stable=True) if act_order
             else torch.arange(k))
    # W's columns as rows (W^T, contiguous) in processing order.
    wt = weight.float().t()[order].contiguous()
    h = h[order][:, order]
    h.diagonal().add_(damp_percent * float(h.diagonal().mean()))
    u = _inverse_cholesky(h).float()

    n_groups = -(-k // group_size)   # the last one shorter where G does not divide K
    codes = torch.empty(k, n)
    scale, zero = torch.empty(n_groups, n), torch.empty(n_groups, n)
    if static_groups:  # every group's from the weight as it is, in the original order
        lo, hi = _group_extremes(weight.float(), group_size)
        scale[:], zero[:] = grid.params(lo.t(), hi.t())
        group_of = torch.div(order, group_size, rounding_mode="floor").tolist()
    block = group_size * max(1, block_size // group_size) if group_size <= 4 * block_size \
        else block_size
    s = z = None
    for start in range(0, k, block):
        stop = min(start + block, k)
        errors = torch.empty(stop - start, n)
        for j in range(stop - start):
            c = start + j
            if static_groups:
                s, z = scale[group_of[c]], zero[group_of[c]]
            elif c % group_size == 0:
                g = c // group_size
                slab = wt[c:c + group_size] - u[start:c, c:c + group_size].t() @ errors[:j]
                s, z = grid.params(slab.amin(dim=0), slab.amax(dim=0))
                scale[g], zero[g] = s, z
            column = wt[c] - u[start:c, c] @ errors[:j]
            q = grid.codes(column, s, z)
            codes[c] = q
            errors[j] = (column - (q - z) * s) / u[c, c]
        wt[stop:].addmm_(u[start:stop, stop:].t(), errors, alpha=-1.0)

    unpermuted = torch.empty_like(codes)
    unpermuted[order] = codes
    g_idx = torch.arange(k) // group_size if static_groups else _groups_of(order, group_size)
    return _Solved(unpermuted.t(), scale.t(), zero.t(), g_idx)


def _calibration_texts() -> list[str]:
    """The calibration texts, English that ships with CPython and is not its LICENSE.txt: the
    pydoc topics (`pydoc_data.topics`: the language reference's sections, in sorted order,
    joined by blank lines) and IDLE's documentation (idlelib's *.txt files in sorted order and
    the text of its help.html, joined by blank lines), where the installation has idlelib
    (some Linux distributions package it apart; then the pydoc topics alone, with a warning)."""
    import html
    import importlib.util
    import warnings

    from pydoc_data.topics import topics

    texts = ["\n\n".join(topics[key] for key in sorted(topics))]
    spec = importlib.util.find_spec("idlelib")
    folder = os.path.dirname(spec.origin) if spec is not None and spec.origin else None
    if folder is None or not os.path.isfile(os.path.join(folder, "help.html")):
        warnings.warn("idlelib's documentation is not installed; GPTQ calibrates on the pydoc "
                      "topics alone", stacklevel=3)
        return texts
    parts = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".txt"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                parts.append(f.read())
    with open(os.path.join(folder, "help.html"), encoding="utf-8") as f:
        parts.append(html.unescape(re.sub(r"<[^>]+>", "", f.read())))
    texts.append("\n\n".join(parts))
    return texts


def calibration_tokens(src: str, samples: int = CALIBRATION_SAMPLES,
                       seq_len: int = CALIBRATION_LEN) -> torch.Tensor:
    """GPTQ's default calibration set: int64 [samples, seq_len], windows of the calibration
    texts (`_calibration_texts`: the pydoc topics, then IDLE's documentation) tokenized with
    `src`'s tokenizer (no special tokens), the samples shared out between the texts (the first
    gets the odd one), each text's evenly spaced from its start to its end. Two kinds of
    English calibrate better than one: on SmolLM2 at 4 bits, each of the four configurations
    tried came closer to the float model's perplexity than with the pydoc topics alone."""
    import torch
    from transformers import AutoTokenizer

    if samples < 1 or seq_len < 2:
        raise ValueError(f"need at least one calibration sample of 2 tokens, got {samples} x "
                         f"{seq_len}")
    texts = _calibration_texts()
    tokenizer = AutoTokenizer.from_pretrained(src)
    windows = []
    for i, text in enumerate(texts):
        count = samples // len(texts) + (i < samples % len(texts))
        if not count:
            continue
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) < seq_len:
            raise ValueError(f"calibration text {i} is {len(ids)} tokens, shorter than "
                             f"seq_len {seq_len}")
        ids = torch.tensor(ids, dtype=torch.int64)
        starts = torch.linspace(0, len(ids) - seq_len, count).round().long()
        windows += [ids[int(j):int(j) + seq_len] for j in starts]
    return torch.stack(windows)


# Projections that read the same input: q/k/v (the attention's normed input), gate/up (the
# MLP's); o_proj and down_proj read their own.
_INPUT_GROUP_RE = re.compile(r"^(model\.layers\.\d+\.)(?:self_attn\.([qkv]|o)_proj|"
                             r"mlp\.(gate|up|down)_proj)\.weight$")


def _input_group(name: str) -> str:
    m = _INPUT_GROUP_RE.match(name)
    assert m is not None, name
    kind = m.group(2) or m.group(3)
    return m.group(1) + {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up",
                         "up": "gate_up"}.get(kind, kind)


def _calibrate(src: str, names: list[str], solve: Callable[[torch.Tensor, torch.Tensor], _Solved],
               tokens: torch.Tensor | None) -> dict[str, _Solved]:
    """Projection -> its solved weight, every projection of `names` quantized by
    solve(weight [N, K], H [K, K]) from the inputs it receives in one forward pass of the model
    over `tokens` (default: calibration_tokens(src)) with every projection before it quantized.

    transformers runs the model; a forward pre-hook on each projection, on the first call of
    the projections that share its input, computes H = 2 X^T X / n from that input, solves them
    together (their rows stacked: one H) and replaces their weights by the dequantized ones,
    so what follows sees the quantized model's activations."""
    import torch
    from transformers import AutoModelForCausalLM

    if tokens is None:
        tokens = calibration_tokens(src)
    if tokens.ndim != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"calibration tokens must be int64 [samples, seq_len], got "
                         f"{tuple(tokens.shape)} {tokens.dtype}")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.eval()
    modules = {n: model.get_submodule(n.removesuffix(".weight")) for n in names}
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(_input_group(name), []).append(name)
    solved: dict[str, _Solved] = {}
    inputs: dict[str, tuple[int, tuple[int, ...]]] = {}

    def hook(name: str) -> Callable[..., None]:
        key = _input_group(name)

        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            seen = (x.data_ptr(), tuple(x.shape))
            if key in inputs:  # solved with the first of its group; the same input, or a model
                if inputs[key] != seen:  # this grouping does not describe
                    raise ValueError(f"{name} does not read the same input as the other "
                                     f"projections of {key}")
                return
            inputs[key] = seen
            x = x.reshape(-1, x.shape[-1]).float()
            hessian = (x.t() @ x) * (2.0 / x.shape[0])
            members = groups[key]
            result = solve(torch.cat([modules[m].weight.float() for m in members]), hessian)
            start = 0
            for member in members:
                weight = modules[member].weight
                part = result.rows(start, start + weight.shape[0])
                weight.copy_(part.dequantize().to(weight.dtype))
                solved[member] = part
                start += weight.shape[0]

        return pre_hook

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            model.get_decoder()(input_ids=tokens, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    missing = sorted(set(names) - set(solved))
    if missing:
        raise ValueError(f"the calibration forward pass never reached {missing}")
    return solved


def _check_calibration(calibration: str) -> None:
    if calibration not in CALIBRATIONS:
        raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {calibration!r}")


def write_smoothed(src: str, dst: str, strength: float,
                   tokens: torch.Tensor | None = None) -> None:
    """`src` (a float Hugging Face directory of a smoothquant.SMOOTHABLE family) smoothed at
    `strength` (0 < strength < 1) into `dst` (folio/bench/smoothquant.py), calibrated on
    `tokens` (default: calibration_tokens(src))."""
    from folio.bench import smoothquant

    if not 0.0 < strength < 1.0:
        raise ValueError(f"smoothing_strength must be between 0 and 1, got {strength!r}")
    config, tensors = _read_source(src)
    smoothquant.check_smoothable(config)
    if tokens is None:
        tokens = calibration_tokens(src)
    stats = smoothquant.activation_absmax(src, tokens)
    smoothed = smoothquant.smooth_tensors(tensors, stats, int(config["num_hidden_layers"]),
                                          strength)
    _write_dir(src, dst, config, smoothed)


# ----------------------------------------------------------------------------------------------
# compressed-tensors (llm-compressor's output)
# ----------------------------------------------------------------------------------------------

def _ct_scheme(scheme: str, group_size: int, symmetric: bool,
               actorder: str | None = None) -> tuple[Any, str]:
    """The QuantizationScheme of `scheme` (targets: every Linear, as llm-compressor's presets)
    and the compressed-tensors format name its weights are stored in; `actorder`: the w4a16
    weights' (GPTQ's activation ordering)."""
    require_compressed_tensors()
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    def fp8_token() -> Any:  # dynamic per-token FP8 activations (llm-compressor's FP8_DYNAMIC)
        return QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True,
                                dynamic=True)

    if scheme in ("fp8", "fp8-tensor"):
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False,
                                   strategy="channel" if scheme == "fp8" else "tensor")
        inputs, fmt = fp8_token(), "float-quantized"
    elif scheme == "w8a8-int8":
        weights = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True,
                                   dynamic=False)
        inputs = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True,
                                  dynamic=True)
        fmt = "int-quantized"
    elif scheme == "w4a16":
        weights = QuantizationArgs(num_bits=4, type="int", strategy="group",
                                   group_size=group_size, symmetric=symmetric, dynamic=False,
                                   actorder=actorder)
        inputs, fmt = None, "pack-quantized"
    else:
        raise ValueError(f"unknown compressed-tensors scheme {scheme!r}; known: {CT_SCHEMES}")
    if not symmetric and scheme != "w4a16":
        raise ValueError(f"symmetric=False is only offered for w4a16, not {scheme!r}")
    return (QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs,
                               format=fmt), fmt)


def _minmax_qparams(weight: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of `weight` for `args` from its min and max (a memoryless min-max
    observer) over the strategy's reduction, turned into qparams by the library's own
    `calculate_qparams` so the conventions are llm-compressor's: symmetric int s = absmax /
    ((2^bits - 1) / 2) (so +-absmax round or clip to the ends of [-2^(bits-1), 2^(bits-1) - 1]),
    asymmetric s = (max - min) / (2^bits - 1) with a rounded zero point, FP8 s = absmax / 448."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight.float()
    if args.strategy == "tensor":
        lo, hi = w.amin(), w.amax()
    elif args.strategy == "channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    elif args.strategy == "group":
        lo, hi = _group_extremes(w, args.group_size)
    else:
        raise AssertionError(args.strategy)
    return calculate_qparams(lo, hi, args)


def _ct_dequantize(compressed: dict[str, torch.Tensor], scheme: Any,
                   shape: tuple[int, int]) -> torch.Tensor:
    """float32 scale * (q - zero) of one compressed module, read back from what was written."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    args = scheme.weights
    scale = compressed["weight_scale"].float()
    if "weight_packed" in compressed:
        q = unpack_from_int32(compressed["weight_packed"], args.num_bits, shape).float()
        zero = torch.zeros_like(scale)
        if "weight_zero_point" in compressed:
            zero = unpack_from_int32(compressed["weight_zero_point"], args.num_bits,
                                     scale.shape, packed_dim=0).float()
    else:
        q = compressed["weight"].float()
        zero = compressed.get("weight_zero_point", torch.zeros_like(scale)).float()
    if args.strategy == "group":
        scale = scale.repeat_interleave(args.group_size, dim=1)
        zero = zero.repeat_interleave(args.group_size, dim=1)
    return scale * (q - zero)


def write_compressed_tensors(src: str, dst: str, scheme: str, *, group_size: int = 128,
                             symmetric: bool = True, ignore: Iterable[str] = ("lm_head",),
                             dequantized_dir: str | None = None, calibration: str = "rtn",
                             calibration_ids: torch.Tensor | None = None,
                             damp_percent: float = 0.01, act_order: bool = False,
                             smoothing_strength: float | None = None) -> None:
    """`src` quantized with compressed-tensors `scheme` into `dst`, as llm-compressor saves it.

    scheme: "fp8" (FP8 e4m3 weights, per-channel scales, dynamic per-token FP8 activations;
    format float-quantized), "fp8-tensor" (the same with one per-tensor weight scale),
    "w8a8-int8" (int8 per-channel symmetric weights, dynamic per-token int8 activations;
    int-quantized) or "w4a16" (int4 weights, groups of `group_size` along in_features,
    symmetric or, with symmetric=False, with zero points; pack-quantized: weight_packed,
    weight_scale, weight_zero_point, weight_shape).

    calibration "rtn": min-max scales, round-to-nearest. "gptq" (w4a16 and w8a8-int8, as
    llm-compressor's GPTQModifier makes them): GPTQ over `calibration_ids` (default
    calibration_tokens(src)) with dampening `damp_percent` chooses the values and the scales /
    zero points (the library's conventions, _CtGrid; w8a8-int8's per-channel scales from each
    whole row before any update); the library then packs exactly those values. act_order
    (w4a16, with "gptq"): the columns in act-order with the groups' scales fixed beforehand,
    recorded as the weights' actorder "weight" (no g_idx; llm-compressor's default).

    smoothing_strength (llm-compressor's SmoothQuantModifier, which its W8A8 recipes run
    before quantizing): the float model is first smoothed at that strength
    (folio/bench/smoothquant.py, calibrated on `calibration_ids`), and everything after,
    GPTQ and `dequantized_dir` included, starts from the smoothed model.

    The library does the rest as in llm-compressor's save: its lifecycle creates each Linear's
    qparams (`initialize_module_for_quantization`), its compressor quantizes and packs
    (`compress_module`), and `ModelCompressor.update_config` writes config.json's
    quantization_config. Every nn.Linear of the model is a target (targets ["Linear"]);
    `ignore` (module names, or "re:" regexes) lists those kept float, and must name lm_head
    (the default), which is never quantized here.
    """
    if smoothing_strength is not None:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="folio-smoothed-") as smoothed:
            write_smoothed(src, smoothed, smoothing_strength, calibration_ids)
            write_compressed_tensors(
                smoothed, dst, scheme, group_size=group_size, symmetric=symmetric,
                ignore=ignore, dequantized_dir=dequantized_dir, calibration=calibration,
                calibration_ids=calibration_ids, damp_percent=damp_percent,
                act_order=act_order)
        return
    import torch
    try:
        import compressed_tensors  # noqa: F401 - a tool dependency, not the engine's
    except ImportError as exc:
        raise ImportError("writing compressed-tensors checkpoints needs the compressed-tensors "
                          "package: pip install 'folio[quant-tools]' (or "
                          "compressed-tensors>=0.20)") from exc
    from compressed_tensors.compressors import ModelCompressor, compress_module
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus,
                                                 initialize_module_for_quantization)
    from compressed_tensors.utils.match import match_name

    ignore = list(ignore)
    if not any(match_name("lm_head", pattern) for pattern in ignore):
        raise ValueError(f"ignore must name lm_head (kept float by this writer), got {ignore}")
    if scheme == "w4a16":
        _check_group_size(group_size)
    _check_calibration(calibration)
    if calibration == "gptq" and scheme not in _CT_GPTQ_SCHEMES:
        raise ValueError(f"calibration 'gptq' is offered for {_CT_GPTQ_SCHEMES}, not "
                         f"{scheme!r}")
    if act_order and (calibration != "gptq" or scheme != "w4a16"):
        raise ValueError("act_order is offered for scheme 'w4a16' with calibration 'gptq'")
    qscheme, fmt = _ct_scheme(scheme, group_size, symmetric,
                              actorder="weight" if act_order else None)
    config, tensors = _read_source(src)
    quantized = [n for n in _projections(tensors)
                 if not any(match_name(n.removesuffix(".weight"), p) for p in ignore)]
    for name in quantized:
        _check_shape(name, tensors[name],
                     group_size=group_size if scheme == "w4a16" else None)

    solved: dict[str, _Solved] = {}
    if calibration == "gptq" and quantized:
        dtypes = {tensors[name].dtype for name in quantized}
        if len(dtypes) != 1:
            raise ValueError(f"the projections have several dtypes {sorted(map(str, dtypes))}")
        grid = _CtGrid(qscheme.weights, dtypes.pop())
        solved = _calibrate(src, quantized, lambda w, h: _gptq_solve(
            w, h, grid, group_size if scheme == "w4a16" else w.shape[1], act_order=act_order,
            damp_percent=damp_percent, static_groups=act_order), calibration_ids)

    out = dict(tensors)
    dequantized: dict[str, torch.Tensor] = {}
    for name in quantized:
        weight = tensors[name]
        prefix = name.removesuffix("weight")
        # A bare Linear holding the source weight: the lifecycle registers its qparams with the
        # shapes and dtypes llm-compressor's model would have (scale in the weight's dtype).
        with torch.device("meta"):
            module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        if name in solved:  # GPTQ's values: the compressor re-quantizes them to its codes
            result = solved[name]
            module.weight = torch.nn.Parameter(result.dequantize().to(weight.dtype),
                                               requires_grad=False)
            scale, zero = result.scale, result.zero
        else:
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
            scale, zero = _minmax_qparams(weight, qscheme.weights)
        initialize_module_for_quantization(module, qscheme)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero)
        compress_module(module)
        compressed = {k: v.detach() for k, v in module.state_dict().items()}
        del out[name]
        out.update({prefix + k: v for k, v in compressed.items()})
        dequantized[name] = _ct_dequantize(compressed, qscheme, tuple(weight.shape))
        if name in solved and not torch.equal(dequantized[name], solved[name].dequantize()):
            raise AssertionError(f"{name}: the library's packing changed GPTQ's values")

    _write_dir(src, dst, config, out)
    qconfig = QuantizationConfig(config_groups={"group_0": qscheme}, format=fmt,
                                 quantization_status=QuantizationStatus.COMPRESSED,
                                 ignore=ignore)
    ModelCompressor(quantization_config=qconfig).update_config(dst)
    _write_dequantized(src, dequantized_dir, config, tensors, dequantized)


# ----------------------------------------------------------------------------------------------
# FP8 KV cache scales (compressed-tensors' kv_cache_scheme)
# ----------------------------------------------------------------------------------------------

KV_SCALE_STRATEGIES = ("tensor", "attn_head")


def write_kv_cache_scales(src: str, dst: str, *, strategy: str = "tensor",
                          calibration_ids: torch.Tensor | None = None) -> None:
    """Add static FP8 KV cache scales to the checkpoint in `dst` (a compressed-tensors one
    written from the float model `src`, or a float copy of it), as llm-compressor saves a
    `kv_cache_scheme`: config.json's quantization_config gains
    kv_cache_scheme = {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": false,
    "symmetric": true} (a float checkpoint gets a quantization_config of that alone), and each
    layer's `model.layers.N.self_attn.k_scale` / `v_scale` (float32 [1] per tensor, or
    [kv_heads, 1, 1] per KV head with "attn_head") join the weights.

    A scale is the largest |K| or |V| the float model writes to its cache over
    `calibration_ids` (default calibration_tokens(src)) over e4m3's 448, as llm-compressor's
    min-max observer makes it. K is the rotated key: each rotary pair (j, j + d/2) is turned by
    an angle, so |K_j| after it is at most the pair's norm before it, which is the bound taken
    (the rotation itself is not run); a family that normalizes keys (q_norm / k_norm) is read
    after its k_norm."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    if strategy not in KV_SCALE_STRATEGIES:
        raise ValueError(f"strategy must be one of {KV_SCALE_STRATEGIES}, got {strategy!r}")
    config_path = os.path.join(dst, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    qconfig = config.get("quantization_config")
    if qconfig is not None and qconfig.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{dst}: KV cache scales are written into compressed-tensors "
                         f"checkpoints (or float ones), not {qconfig.get('quant_method')!r}")
    weights_file = os.path.join(dst, "model.safetensors")
    if not os.path.isfile(weights_file):
        raise ValueError(f"{dst}: expected one model.safetensors (as this module writes)")
    if calibration_ids is None:
        calibration_ids = calibration_tokens(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.eval()
    text = model.config.get_text_config()
    kv_heads = text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    amax: dict[str, torch.Tensor] = {}

    def observe(name: str, rotary: bool) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            x = out.detach().float().reshape(-1, kv_heads, head_dim)
            if rotary:   # the rotary pairs' norms bound the rotated key's elements
                half = head_dim // 2
                x = torch.sqrt(x[..., :half] ** 2 + x[..., half:] ** 2)
            per_head = x.abs().amax(dim=(0, 2))
            amax[name] = per_head if name not in amax else torch.maximum(amax[name], per_head)
        return hook

    handles = []
    for i, layer in enumerate(model.get_decoder().layers):
        attn = layer.self_attn
        k_out = getattr(attn, "k_norm", None) or attn.k_proj
        prefix = f"model.layers.{i}.self_attn."
        handles.append(k_out.register_forward_hook(observe(prefix + "k_scale", True)))
        handles.append(attn.v_proj.register_forward_hook(observe(prefix + "v_scale", False)))
    try:
        with torch.no_grad():
            model.get_decoder()(input_ids=calibration_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    fp8_max = float(torch.finfo(torch.float8_e4m3fn).max)
    tensors = load_file(weights_file)
    for name, per_head in amax.items():
        scale = (per_head if strategy == "attn_head" else per_head.amax().reshape(1)) / fp8_max
        scale = scale.clamp(min=1e-12)   # an all-zero K keeps a positive scale
        tensors[name] = scale.reshape(kv_heads, 1, 1) if strategy == "attn_head" else scale
    save_file(tensors, weights_file, metadata={"format": "pt"})
    scheme = {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False,
              "symmetric": True}
    if qconfig is None:
        qconfig = {"quant_method": "compressed-tensors", "config_groups": {},
                   "format": "dense", "quantization_status": "compressed", "ignore": []}
    config["quantization_config"] = {**qconfig, "kv_cache_scheme": scheme}
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


# ----------------------------------------------------------------------------------------------
# vLLM "fp8" (AutoFP8)
# ----------------------------------------------------------------------------------------------

def write_fp8(src: str, dst: str, *, dequantized_dir: str | None = None) -> None:
    """`src` in vLLM's "fp8" checkpoint format, as AutoFP8 writes it with dynamic activations.

    config.json: quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic"}.
    Per projection: `weight` float8_e4m3fn [out, in] and `weight_scale` a float32 0-d tensor
    (one scale per tensor: absmax / 448; AutoFP8 stores the reciprocal of its multiplier as a
    0-d parameter, and vLLM's per-tensor scale loader reshapes a 0-d scale to [1]);
    dequantized w = weight.float() * weight_scale. No input_scale (dynamic activations).
    """
    import torch

    config, tensors = _read_source(src)
    names = _projections(tensors)
    for name in names:
        _check_shape(name, tensors[name])
    out = dict(tensors)
    dequantized: dict[str, torch.Tensor] = {}
    for name in names:
        w = tensors[name].float()
        # Guard an all-zero tensor (a zero scale would divide by zero).
        scale = (w.abs().amax() / _FP8_MAX).clamp(min=1e-12)
        q = (w / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        out[name] = q
        out[name.removesuffix("weight") + "weight_scale"] = scale.reshape(())
        dequantized[name] = q.float() * scale
    _write_dir(src, dst, {**config, "quantization_config":
                          {"quant_method": "fp8", "activation_scheme": "dynamic"}}, out)
    _write_dequantized(src, dequantized_dir, config, tensors, dequantized)


# ----------------------------------------------------------------------------------------------
# AutoAWQ GEMM
# ----------------------------------------------------------------------------------------------

def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] nibbles (0..15) -> int32 [rows, cols // 8], AutoAWQ's interleaved order."""
    import torch

    rows, cols = values.shape
    blocks = values.to(torch.int64).view(rows, cols // 8, 8)
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for slot, column in enumerate(_AWQ_ORDER):
        words |= blocks[:, :, column] << (4 * slot)
    return _to_int32(words)


def write_awq(src: str, dst: str, *, group_size: int = 128,
              dequantized_dir: str | None = None,
              modules_to_not_convert: Sequence[str] = ()) -> None:
    """`src` in AutoAWQ's GEMM format (4-bit, zero point, version "gemm").

    config.json: quantization_config = {"quant_method": "awq", "bits": 4, "group_size": G,
    "zero_point": true, "version": "gemm", "modules_to_not_convert": [...] or null}: a
    projection whose name contains one of those entries is kept float (AutoAWQ's rule).
    Per projection (K = in_features, N = out_features), stored transposed relative to
    nn.Linear (K rows, N columns) and without the `weight`:
      qweight int32 [K, N // 8]: q[k, n] in 0..15, packed along N; nibble slot i of word
        (k, c) holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i];
      qzeros  int32 [K // G, N // 8]: the zero points (0..15), packed the same way;
      scales  float16 [K // G, N].
    Dequantized w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n].

    Asymmetric min-max RTN per group of G input channels and output column, with AutoAWQ's
    convention: s = (max - min) / 15, z = -round(min / s) (s rounded to float16 first, as
    AutoAWQ packs with its float16 scales). The range always includes 0 (min <= 0 <= max), so
    a one-signed group never has its z clipped at 0 or 15 and every element is within half a
    step of its float value.
    """
    import torch

    _check_group_size(group_size)
    config, tensors = _read_source(src)
    names = [n for n in _projections(tensors)
             if not any(entry in n.removesuffix(".weight") for entry in modules_to_not_convert)]
    for name in names:
        _check_shape(name, tensors[name], group_size=group_size, out_multiple=8)
    out = dict(tensors)
    dequantized: dict[str, torch.Tensor] = {}
    for name in names:
        w = tensors[name].float().t()                      # [K, N]
        k, n = w.shape
        grouped = w.view(k // group_size, group_size, n)
        lo = grouped.amin(dim=1).clamp(max=0.0)
        hi = grouped.amax(dim=1).clamp(min=0.0)
        scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)
        s = scales.float()
        zeros = (-torch.round(lo / s)).clamp(0, 15)
        s_full = s.repeat_interleave(group_size, dim=0)
        z_full = zeros.repeat_interleave(group_size, dim=0)
        q = (torch.round(w / s_full) + z_full).clamp(0, 15)
        prefix = name.removesuffix("weight")
        del out[name]
        out[prefix + "qweight"] = _awq_pack(q)
        out[prefix + "qzeros"] = _awq_pack(zeros)
        out[prefix + "scales"] = scales
        dequantized[name] = ((q - z_full) * s_full).t().contiguous()
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
               "version": "gemm", "modules_to_not_convert": list(modules_to_not_convert) or None}
    _write_dir(src, dst, {**config, "quantization_config": qconfig}, out)
    _write_dequantized(src, dequantized_dir, config, tensors, dequantized)


# ----------------------------------------------------------------------------------------------
# AutoGPTQ / GPTQModel
# ----------------------------------------------------------------------------------------------

def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] nibbles -> int32 [rows // 8, cols]: word w holds rows 8w..8w+7, row 8w+i in
    bits 4i..4i+3 (lowest bits first)."""
    import torch

    rows, cols = values.shape
    blocks = values.to(torch.int64).view(rows // 8, 8, cols)
    words = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for i in range(8):
        words |= blocks[:, i, :] << (4 * i)
    return _to_int32(words)


def _pack_cols(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] nibbles -> int32 [rows, cols // 8], columns in order (no interleave)."""
    return _pack_rows(values.t().contiguous()).t().contiguous()


def write_gptq(src: str, dst: str, *, group_size: int = 128, sym: bool = True,
               desc_act: bool = False, dequantized_dir: str | None = None,
               checkpoint_format: str = "gptq", seed: int = 0, calibration: str = "rtn",
               calibration_ids: torch.Tensor | None = None, damp_percent: float = 0.01,
               static_groups: bool = False, skip: Sequence[str] = ()) -> None:
    """`src` in the AutoGPTQ / GPTQModel 4-bit format.

    config.json: quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": G,
    "desc_act": desc_act, "sym": sym, "checkpoint_format": checkpoint_format,
    "static_groups": static_groups, "true_sequential": true, "damp_percent": damp_percent}.
    Per projection (K = in_features, N = out_features, n_groups = ceil(K / G): where G does not
    divide K the last group is shorter, as AutoGPTQ and GPTQModel write it; G = -1: one group
    of K), without `weight`:
      qweight int32 [K // 8, N]: q[k, n] in 0..15 packed along K, nibble i of word row w is
        input row 8w + i, lowest bits first;
      qzeros  int32 [n_groups, N // 8]: zero points packed along N in order; checkpoint_format
        "gptq" (v1) stores zero - 1 (a symmetric model stores 7 for its zero 8), "gptq_v2"
        (GPTQModel's internal format) stores the zero itself;
      scales  float16 [n_groups, N];
      g_idx   int32 [K]: the group of each input channel. desc_act=False or static_groups:
        k // G. desc_act=True: the channels in act-order (the first G of the order in group 0
        and so on), so g_idx is not monotone.
    Dequantized w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n].

    Scales and zeros follow GPTQ's quantizer (see _GptqGrid: sym s = 2 * absmax / 15 and zero
    8; asym s = (max - min) / 15 and zero = round(-min / s), the range including 0; v1's
    unstorable zero 0 moved to 1 with a stretched scale).

    calibration "rtn": each group's min and max, round-to-nearest; act-order (without
    static_groups) is simulated by a random permutation of the input channels (seeded by
    `seed`). "gptq": GPTQ (see the module docstring and _gptq_solve) over `calibration_ids`
    (int64 [samples, seq_len]; default calibration_tokens(src)) with dampening `damp_percent`;
    act-order is the real one (decreasing diag(H)), `seed` unused; static_groups: the groups'
    scales and zeros from the weight before GPTQ's updates (needed for act-order without a
    permuted g_idx).

    skip: regexes of modules kept float, written as GPTQModel's `dynamic` rules
    ({"-:regex": {}}, matched from the start of the module name).
    """
    import torch

    if group_size != -1:   # -1: one group over all of K (GPTQ's per-channel scales)
        _check_group_size(group_size)
        if group_size % 8:
            raise ValueError(f"group_size must be -1 or a multiple of 8, got {group_size}")
    _check_calibration(calibration)
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"checkpoint_format must be 'gptq' or 'gptq_v2', got "
                         f"{checkpoint_format!r}")
    config, tensors = _read_source(src)
    names = [n for n in _projections(tensors)
             if not any(re.match(p, n.removesuffix(".weight")) for p in skip)]
    for name in names:
        # AutoGPTQ / GPTQModel end a row whose K is not a multiple of G in a shorter group
        _check_shape(name, tensors[name], in_multiple=8, out_multiple=8)
    grid = _GptqGrid(sym, checkpoint_format)

    def group_of(w: torch.Tensor) -> int:
        return w.shape[1] if group_size == -1 else group_size

    if calibration == "gptq":
        solved = _calibrate(src, names, lambda w, h: _gptq_solve(
            w, h, grid, group_of(w), act_order=desc_act, damp_percent=damp_percent,
            static_groups=static_groups), calibration_ids)
    else:
        generator = torch.Generator().manual_seed(seed)
        solved = {}
        for name in names:
            k = tensors[name].shape[1]
            permuted = desc_act and not static_groups
            order = torch.randperm(k, generator=generator) if permuted else torch.arange(k)
            solved[name] = _rtn_solve(tensors[name], grid, group_of(tensors[name]), order)
    out = dict(tensors)
    dequantized: dict[str, torch.Tensor] = {}
    for name in names:
        result = solved[name]
        zeros = result.zero.t()                               # [n_groups, N]
        stored_zeros = zeros - 1 if checkpoint_format == "gptq" else zeros
        prefix = name.removesuffix("weight")
        del out[name]
        out[prefix + "qweight"] = _pack_rows(result.codes.t().contiguous())
        out[prefix + "qzeros"] = _pack_cols(stored_zeros)
        out[prefix + "scales"] = result.scale.t().to(torch.float16)
        out[prefix + "g_idx"] = result.g_idx.to(torch.int32)
        dequantized[name] = result.dequantize().contiguous()
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
               "desc_act": desc_act, "sym": sym, "checkpoint_format": checkpoint_format,
               "static_groups": static_groups, "true_sequential": True,
               "damp_percent": damp_percent}
    if skip:
        qconfig["dynamic"] = {f"-:{p}": {} for p in skip}
    _write_dir(src, dst, {**config, "quantization_config": qconfig}, out)
    _write_dequantized(src, dequantized_dir, config, tensors, dequantized)
