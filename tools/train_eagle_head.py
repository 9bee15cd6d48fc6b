"""Train an EAGLE-1 draft head for SmolLM2-135M-Instruct on the CPU, from the model's own greedy
answers to prompts built from Python's standard library, and save it in the published EAGLE
checkpoint layout that folio loads (folio/model/eagle.py):

    folio serve --speculative-config '{"method": "eagle", "model": "<out>",
                                       "num_speculative_tokens": 3}'

Pipeline (each stage cached under --work-dir, so a rerun resumes):
1. prompts: chat requests about stdlib functions and classes ("Explain what this function
   does", "Add type hints", "Summarise this documentation"), the modules split into a training
   set and a held-out set (for measuring acceptance: see --measure);
2. answers: the target (folio's offline LLM on the bundled GGUF) answers them greedily;
3. features: transformers runs the target (the GGUF dequantized to a Hugging Face directory)
   over prompt + answer and keeps, per position, the final normed hidden state (what
   folio's EagleProposer feeds the head) and the target's greedy next token;
4. training: the head, at position q, reads (embedding of token q+1, hidden state of q) and
   must give a state that (a) the target's output matrix maps to the target's greedy token
   at q+1 (cross-entropy) and (b) equals the hidden state of q+1 (smooth L1), since folio
   feeds the head's output back as the next drafting step's hidden state. The target's
   embedding / output matrix (tied) stay frozen and are not saved. With --ttt-steps > 1 the
   head is also trained on its own outputs ("training-time test"): step s of the chain
   anchored at b reads (token b+s+1, the head's step s-1 output) at position b+s and attends
   to the real rows at positions <= b and to the chain's own earlier rows, as at inference.

The head's math follows folio's EagleHead for `eagle`: fc [H, 2H] (+ bias) on
[embedding; hidden], one Llama decoder layer whose input norm is absent, no final norm, the
output (stream + residual) feeding both the logits and the next step.

Usage:
    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 .venv/bin/python tools/train_eagle_head.py \
        --work-dir /tmp/eagle --out /tmp/eagle/head
    .venv/bin/python tools/train_eagle_head.py --work-dir /tmp/eagle --out /tmp/eagle/head \
        --measure   # held-out prompts, batch 1, greedy: spec off / eagle k=2,3,4 / ngram
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

# Disjoint stdlib module sets: training prompts come from the first, measurement prompts from
# the second, so the measured acceptance is on code and prose the head never saw.
TRAIN_MODULES = ("argparse", "base64", "bisect", "calendar", "collections", "colorsys",
                 "configparser", "copy", "csv", "dataclasses", "datetime", "difflib",
                 "email.utils", "fnmatch", "fractions", "functools", "gettext", "glob", "gzip",
                 "heapq", "hmac", "html", "http.cookies", "imaplib", "ipaddress", "json",
                 "locale", "logging", "mimetypes", "netrc", "operator", "os.path", "pathlib",
                 "pprint", "queue", "quopri", "random", "sched", "secrets", "shlex", "shutil",
                 "smtplib", "statistics", "string", "subprocess", "tarfile", "tempfile",
                 "threading", "tokenize", "urllib.parse", "uuid", "wave", "zipfile")
HELDOUT_MODULES = ("textwrap", "ftplib", "poplib", "plistlib", "graphlib", "numbers",
                   "getopt", "filecmp", "linecache", "contextlib", "selectors", "weakref")

# Request templates: explanations (free prose), rewrites (mostly copying code) and summaries.
CODE_TASKS = ("Explain what this Python function does.",
              "Rewrite this code with type hints added. Output only the code.",
              "Write a short usage example for this function.",
              "Describe the inputs and outputs of this code, then list possible bugs.")
DOC_TASKS = ("Summarise this documentation in a few sentences.",
             "Explain this documentation to a beginner, with an example.")


@dataclass
class TrainConfig:
    """Options of the pipeline (the CLI's flags)."""
    work_dir: str = "/tmp/eagle"
    out: str = "/tmp/eagle/head"
    num_train_prompts: int = 320
    num_heldout_prompts: int = 24
    max_source_chars: int = 900       # code / docstring in a prompt, cut at a line end
    answer_tokens: int = 256          # greedy answer length cap for the training data
    max_seq_len: int = 512
    epochs: int = 4
    batch_tokens: int = 2048          # padded tokens per optimizer step
    lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    ce_weight: float = 0.1            # EAGLE's weighting: regression 1, classification 0.1
    ttt_steps: int = 1                # 1: plain EAGLE-1 teacher forcing
    ttt_decay: float = 0.8            # loss weight of chain step s: decay ** s
    max_minutes: float = 30.0         # training stops (and saves) at this wall-clock limit
    init_from: str = ""               # a saved head to continue from (e.g. add TTT steps)
    seed: int = 0
    threads: int = 2


# ---- 1. prompts -------------------------------------------------------------------------

def _trim(text: str, max_chars: int) -> str:
    """At most max_chars characters of text, cut at a line end (whole lines read better)."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    return text[: cut if cut > 0 else max_chars]


def _members(module_name: str) -> list[tuple[str, str, str]]:
    """(qualified name, source, docstring) of a module's public functions and classes."""
    module = importlib.import_module(module_name)
    out = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue   # re-exported from elsewhere
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            continue
        out.append((f"{module_name}.{name}", source, inspect.getdoc(obj) or ""))
    return out


def build_requests(modules: tuple[str, ...], num: int, max_chars: int, seed: int) -> list[str]:
    """`num` user messages about members of `modules`, shuffled with `seed`, each member used
    once at most (so no two prompts share their code)."""
    rng = random.Random(seed)
    members = [m for name in modules for m in _members(name)]
    rng.shuffle(members)
    requests = []
    for qualname, source, doc in members:
        if len(requests) >= num:
            break
        if len(doc) > 200 and rng.random() < 0.3:
            task = rng.choice(DOC_TASKS)
            requests.append(f"{task}\n\nDocumentation of `{qualname}`:\n\n"
                            f"{_trim(doc, max_chars)}")
        elif len(source) >= 80:
            task = rng.choice(CODE_TASKS)
            requests.append(f"{task}\n\n```python\n{_trim(source, max_chars)}\n```")
    return requests


# ---- 2. answers (folio, GGUF) -----------------------------------------------------------

def chat_prompt_ids(tokenizer: Any, requests: list[str]) -> list[list[int]]:
    """The requests in the model's chat template (with its default system prompt)."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": r}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
            for r in requests]


def generate_answers(prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target's greedy answers (token ids), batched on folio's offline engine."""
    from folio import LLM, SamplingParams
    llm = LLM(max_num_seqs=32, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


# ---- 3. features (transformers) ---------------------------------------------------------

@torch.no_grad()
def target_features(model: Any, sequences: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """Per sequence: tokens, the final normed hidden states [T, H] (the base model's
    last_hidden_state: after the final norm, what folio hands the EAGLE proposer) and the
    target's greedy next token at each position."""
    out = []
    for ids in sequences:
        x = torch.tensor([ids])
        hidden = model.model(input_ids=x).last_hidden_state[0]
        greedy = model.lm_head(hidden).argmax(-1)
        out.append({"tokens": x[0], "hidden": hidden.to(torch.float32), "greedy": greedy})
    return out


# ---- 4. the head ------------------------------------------------------------------------

def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated) of x [..., S, D] at positions [..., S]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions[..., None].float() * inv
    cos = torch.cat([angles.cos()] * 2, -1)
    sin = torch.cat([angles.sin()] * 2, -1)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass
class HeadShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float

    @staticmethod
    def of(config: Any) -> "HeadShape":
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        return HeadShape(config.hidden_size, config.intermediate_size,
                         config.num_attention_heads, config.num_key_value_heads, head_dim,
                         float(theta), float(config.rms_norm_eps))


class EagleTrainHead(nn.Module):
    """EAGLE-1 head (folio's `eagle` math) with parameters named as the checkpoint's
    tensors, whose forward runs a whole chain of `steps` drafting steps at once."""

    def __init__(self, shape: HeadShape) -> None:
        super().__init__()
        self.shape = shape
        H, I, hd = shape.hidden, shape.intermediate, shape.head_dim
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.q_proj = nn.Linear(H, shape.heads * hd, bias=False)
        self.k_proj = nn.Linear(H, shape.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, shape.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(shape.heads * hd, H, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self._init()

    def _init(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # fc starts as "pass the hidden state through": the untrained head then predicts
        # the target's next token from the state before it, a better start than noise
        H = self.shape.hidden
        with torch.no_grad():
            self.fc.weight[:, H:] += torch.eye(H)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, s.heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, s.kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, s.kv_heads, s.head_dim).transpose(1, 2)
        pos = positions[:, None, :]
        q, k = _rotate(q, pos, s.rope_theta), _rotate(k, pos, s.rope_theta)
        groups = s.heads // s.kv_heads
        return q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)

    def _mlp_block(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        r = x + self.o_proj(attn)
        h = _rms_norm(r, self.post_attention_layernorm, self.shape.eps)
        return r + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def chain(self, embeds: list[torch.Tensor], hidden: torch.Tensor, lengths: torch.Tensor
              ) -> list[torch.Tensor]:
        """Outputs of the chain's steps s = 0..len(embeds)-1, each [B, S, H], indexed by the
        anchor b: step s reads (embeds[s][b] = embedding of token b+s+1, step s-1's output at
        b, or the target's hidden at b for s = 0) at position b+s; it attends to step 0's
        rows at positions <= b and to steps 1..s of its own chain (a KV cache holding the
        context's real rows and the chain's drafts, as folio's proposer has)."""
        B, S, _ = hidden.shape
        s_ = self.shape
        base = torch.arange(S)[None, :].expand(B, S)
        scale = 1.0 / math.sqrt(s_.head_dim)
        causal = torch.ones(S, S, dtype=torch.bool).tril()            # key j <= anchor b
        valid_key = base[:, None, None, :] < lengths[:, None, None, None]
        mask0 = causal[None, None] & valid_key
        outs: list[torch.Tensor] = []
        keys0 = values0 = None
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        h = hidden
        for step, e in enumerate(embeds):
            x = self.fc(torch.cat([e, h], dim=-1))
            q, k, v = self._qkv(x, base + step)
            if step == 0:
                keys0, values0 = k, v
            diag_k.append(k)
            diag_v.append(v)
            scores = torch.einsum("bhqd,bhkd->bhqk", q, keys0) * scale
            scores = scores.masked_fill(~mask0, float("-inf"))
            # the chain's own rows 1..step: one key per anchor, same index b
            own = [(q * kk).sum(-1, keepdim=True) * scale for kk in diag_k[1:]]
            weights = torch.cat([scores] + own, dim=-1).softmax(-1)
            attn = torch.einsum("bhqk,bhkd->bhqd", weights[..., :S], values0)
            for i, vv in enumerate(diag_v[1:]):
                attn = attn + weights[..., S + i: S + i + 1] * vv
            attn = attn.transpose(1, 2).reshape(B, S, s_.heads * s_.head_dim)
            h = self._mlp_block(x, attn)
            outs.append(h)
        return outs

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters under the published EAGLE-LLaMA names."""
        return {k: v.detach().contiguous().clone()
                for k, v in _named_checkpoint_params(self).items()}


def load_head(head: EagleTrainHead, path: str) -> None:
    """The tensors of a head saved by save_head, into `head`."""
    from safetensors.torch import load_file
    saved = load_file(os.path.join(path, "model.safetensors"))
    with torch.no_grad():
        for name, param in _named_checkpoint_params(head).items():
            param.copy_(saved[name])


def _named_checkpoint_params(head: EagleTrainHead) -> dict[str, torch.Tensor]:
    p = "layers.0."
    return {"fc.weight": head.fc.weight, "fc.bias": head.fc.bias,
            f"{p}self_attn.q_proj.weight": head.q_proj.weight,
            f"{p}self_attn.k_proj.weight": head.k_proj.weight,
            f"{p}self_attn.v_proj.weight": head.v_proj.weight,
            f"{p}self_attn.o_proj.weight": head.o_proj.weight,
            f"{p}post_attention_layernorm.weight": head.post_attention_layernorm,
            f"{p}mlp.gate_proj.weight": head.gate_proj.weight,
            f"{p}mlp.up_proj.weight": head.up_proj.weight,
            f"{p}mlp.down_proj.weight": head.down_proj.weight}


def save_head(head: EagleTrainHead, target_config: Any, out_dir: str) -> None:
    """config.json (the target's Llama config with one layer) + model.safetensors."""
    from safetensors.torch import save_file
    config = target_config.__class__.from_dict(target_config.to_dict())
    config.num_hidden_layers = 1
    config.architectures = ["EagleLlamaForCausalLM"]
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file(head.checkpoint_tensors(), os.path.join(out_dir, "model.safetensors"))


# ---- training ---------------------------------------------------------------------------

@dataclass
class TargetWeights:
    """The target's frozen input embedding and output matrix ([V, H] each; one tensor when
    tied, as SmolLM2's are). folio's EAGLE head uses both, having neither of its own."""
    embed: torch.Tensor
    unembed: torch.Tensor

    @staticmethod
    def of(model: Any) -> "TargetWeights":
        return TargetWeights(model.get_input_embeddings().weight.detach(),
                             model.get_output_embeddings().weight.detach())


@dataclass
class Batch:
    tokens: torch.Tensor      # [B, S] (0-padded)
    hidden: torch.Tensor      # [B, S, H]
    greedy: torch.Tensor      # [B, S]
    lengths: torch.Tensor     # [B]


def batches(data: list[dict[str, torch.Tensor]], batch_tokens: int, rng: random.Random
            ) -> Iterator[Batch]:
    """Shuffled batches of similar-length sequences (little padding) of about batch_tokens."""
    order = sorted(range(len(data)), key=lambda i: len(data[i]["tokens"]))
    groups, group, longest = [], [], 0
    for i in order:
        n = len(data[i]["tokens"])
        if group and max(longest, n) * (len(group) + 1) > batch_tokens:
            groups.append(group)
            group, longest = [], 0
        group.append(i)
        longest = max(longest, n)
    if group:
        groups.append(group)
    rng.shuffle(groups)
    for group in groups:
        S = max(len(data[i]["tokens"]) for i in group)
        B, H = len(group), data[group[0]]["hidden"].shape[-1]
        tokens = torch.zeros(B, S, dtype=torch.long)
        greedy = torch.zeros(B, S, dtype=torch.long)
        hidden = torch.zeros(B, S, H)
        lengths = torch.zeros(B, dtype=torch.long)
        for row, i in enumerate(group):
            n = len(data[i]["tokens"])
            tokens[row, :n] = data[i]["tokens"]
            greedy[row, :n] = data[i]["greedy"]
            hidden[row, :n] = data[i]["hidden"]
            lengths[row] = n
        yield Batch(tokens, hidden, greedy, lengths)


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x[:, b + by] at index b (zeros past the end)."""
    if by == 0:
        return x
    out = torch.zeros_like(x)
    out[:, :-by] = x[:, by:]
    return out


def chain_losses(head: EagleTrainHead, target: TargetWeights, batch: Batch, steps: int,
                 ce_weight: float) -> list[dict[str, torch.Tensor]]:
    """Per chain step s: smooth L1 to the target's hidden at b+s+1, cross-entropy of the
    logits (target's output matrix) against the target's greedy token at b+s+1 and the
    top-1 accuracy, over anchors b with b+s+1 inside the sequence."""
    B, S = batch.tokens.shape
    base = torch.arange(S)[None, :]
    embeds = [F.embedding(_shift(batch.tokens, s + 1), target.embed) for s in range(steps)]
    outs = head.chain(embeds, batch.hidden, batch.lengths)
    result = []
    for s, out in enumerate(outs):
        valid = base + s + 1 < batch.lengths[:, None]
        want_hidden = _shift(batch.hidden, s + 1)[valid]
        want_token = _shift(batch.greedy, s + 1)[valid]
        got = out[valid]
        l1 = F.smooth_l1_loss(got, want_hidden)
        logits = got @ target.unembed.t()
        ce = F.cross_entropy(logits, want_token)
        acc = (logits.argmax(-1) == want_token).float().mean()
        result.append({"l1": l1, "ce": ce, "loss": l1 + ce_weight * ce, "acc": acc})
    return result


def train_head(head: EagleTrainHead, target: TargetWeights,
               data: list[dict[str, torch.Tensor]], cfg: TrainConfig,
               log: Callable[[str], None] = print) -> list[dict[str, float]]:
    """AdamW with linear warmup then cosine decay to a tenth; returns per-step logs. The
    target's embedding and output matrix stay frozen (the head has neither)."""
    rng = random.Random(cfg.seed)
    steps_per_epoch = sum(1 for _ in batches(data, cfg.batch_tokens, random.Random(0)))
    total = max(1, steps_per_epoch * cfg.epochs)
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    history: list[dict[str, float]] = []
    start = time.perf_counter()
    step = 0
    for epoch in range(cfg.epochs):
        for batch in batches(data, cfg.batch_tokens, rng):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            parts = chain_losses(head, target, batch, cfg.ttt_steps, cfg.ce_weight)
            loss = sum((cfg.ttt_decay ** s) * p["loss"] for s, p in enumerate(parts))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            entry = {"step": step, "epoch": epoch, "loss": float(loss.detach()),
                     "minutes": (time.perf_counter() - start) / 60}
            for s, p in enumerate(parts):
                entry.update({f"{name}_{s}": float(p[name].detach())
                              for name in ("l1", "ce", "acc")})
            history.append(entry)
            if step % 10 == 0:
                log(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                for k, v in entry.items()}))
            step += 1
            if entry["minutes"] > cfg.max_minutes:
                log(f"stopping at the {cfg.max_minutes}-minute limit (step {step})")
                return history
    return history


# ---- the pipeline -----------------------------------------------------------------------

def _cached(path: str, make: Callable[[], Any]) -> Any:
    if os.path.exists(path):
        return torch.load(path, weights_only=True)   # our own cache: tensors, lists, str
    value = make()
    torch.save(value, path)
    return value


def prepare_data(cfg: TrainConfig, tokenizer: Any) -> dict[str, Any]:
    """Train / held-out prompts (token ids) and the training answers, cached."""
    def make() -> dict[str, Any]:
        train_req = build_requests(TRAIN_MODULES, cfg.num_train_prompts, cfg.max_source_chars,
                                   cfg.seed)
        held_req = build_requests(HELDOUT_MODULES, cfg.num_heldout_prompts,
                                  cfg.max_source_chars, cfg.seed + 1)
        train_ids = chat_prompt_ids(tokenizer, train_req)
        t0 = time.perf_counter()
        answers = generate_answers(train_ids, cfg.answer_tokens)
        print(f"generated {sum(map(len, answers))} answer tokens for {len(answers)} prompts "
              f"in {time.perf_counter() - t0:.0f} s")
        return {"train_requests": train_req, "heldout_requests": held_req,
                "train_prompt_ids": train_ids, "train_answers": answers,
                "heldout_prompt_ids": chat_prompt_ids(tokenizer, held_req)}
    return _cached(os.path.join(cfg.work_dir, "data.pt"), make)


def run_training(cfg: TrainConfig) -> None:
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.work_dir, exist_ok=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from folio.model.default_model import default_model_path
    hf_dir = default_model_path()   # the bundled GGUF, dequantized into folio's cache once
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    data = prepare_data(cfg, tokenizer)
    target = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    sequences = [(p + a)[: cfg.max_seq_len]
                 for p, a in zip(data["train_prompt_ids"], data["train_answers"])]
    t0 = time.perf_counter()
    features = _cached(os.path.join(cfg.work_dir, "features.pt"),
                       lambda: target_features(target, sequences))
    print(f"features: {len(features)} sequences, {sum(len(f['tokens']) for f in features)} "
          f"tokens ({time.perf_counter() - t0:.0f} s)")
    head = EagleTrainHead(HeadShape.of(target.config))
    if cfg.init_from:
        load_head(head, cfg.init_from)
    t0 = time.perf_counter()
    history = train_head(head, TargetWeights.of(target), features, cfg)
    print(f"trained {len(history)} steps in {(time.perf_counter() - t0) / 60:.1f} min; "
          f"last: {json.dumps(history[-1])}")
    save_head(head, target.config, cfg.out)
    with open(os.path.join(cfg.out, "training_log.json"), "w", encoding="utf-8") as f:
        json.dump({"config": dataclasses.asdict(cfg), "history": history}, f)
    print(f"saved {cfg.out}")


# ---- measurement ------------------------------------------------------------------------

def measure(cfg: TrainConfig, ks: tuple[int, ...] = (2, 3, 4), max_tokens: int = 128,
            adaptive: bool = False, device: str = "cpu",
            model: str | None = None) -> list[dict[str, Any]]:
    """Held-out prompts one at a time (batch 1), greedy, on the GGUF target: speculation off,
    the head at each k, and prompt-lookup n-gram; mean acceptance length (verify step's
    tokens incl. the bonus token), tokens/s and whether outputs equal the baseline's."""
    from folio import LLM, SamplingParams
    from folio.bench.spec_report import spec_counts, spec_report
    data = torch.load(os.path.join(cfg.work_dir, "data.pt"), weights_only=True)
    prompts = [{"prompt_token_ids": p} for p in data["heldout_prompt_ids"]]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
    configs: list[tuple[str, dict | None]] = [("off", None)]
    configs += [(f"eagle k={k}", {"method": "eagle", "model": cfg.out,
                                  "num_speculative_tokens": k,
                                  "adaptive_draft_length": adaptive}) for k in ks]
    configs.append(("ngram k=4", {"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                  "adaptive_draft_length": adaptive}))
    rows, baseline = [], None
    for name, spec in configs:
        # model None: the bundled GGUF (the default model); on a GPU machine without the
        # package, its file (--measure-model)
        llm = LLM(model, max_num_seqs=1, device=device, speculative_config=spec,
                  enable_prefix_caching=False)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=16),
                     use_tqdm=False)   # warm-up
        before = spec_counts(llm.llm_engine)
        outputs, elapsed = [], 0.0
        for prompt in prompts:
            t0 = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)
            elapsed += time.perf_counter() - t0
            outputs.append(list(out[0].outputs[0].token_ids))
        report = spec_report(before, spec_counts(llm.llm_engine))
        tokens = sum(map(len, outputs))
        baseline = baseline if baseline is not None else outputs
        rows.append({"config": name, "tokens": tokens, "seconds": elapsed,
                     "tok_per_s": tokens / elapsed,
                     "mean_acceptance_length": report["mean_acceptance_length"] if report
                     else None,
                     "acceptance_rate": report["draft_acceptance_rate"] if report else None,
                     "identical": outputs == baseline,
                     "identical_prompts": sum(a == b for a, b in zip(outputs, baseline)),
                     "prompts": len(outputs)})
        print(json.dumps(rows[-1]), flush=True)
        del llm
    off = rows[0]["tok_per_s"]
    for row in rows:
        row["speedup"] = row["tok_per_s"] / off
    return rows


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(TrainConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                            default=f.default)
    parser.add_argument("--measure", action="store_true",
                        help="benchmark the saved head on the held-out prompts (no training)")
    parser.add_argument("--measure-max-tokens", type=int, default=128)
    parser.add_argument("--adaptive", action="store_true",
                        help="measure with folio's adaptive draft length on")
    parser.add_argument("--measure-device", default="cpu", help="cpu or cuda")
    parser.add_argument("--measure-model", default=None,
                        help="the target's file (default: the bundled SmolLM2 GGUF)")
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    return cfg, args


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.measure:
        rows = measure(cfg, max_tokens=args.measure_max_tokens, adaptive=args.adaptive,
                       device=args.measure_device, model=args.measure_model)
        with open(os.path.join(cfg.out, "measurement.json"), "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
        for r in rows:
            mal = "-" if r["mean_acceptance_length"] is None else \
                f"{r['mean_acceptance_length']:.2f}"
            print(f"{r['config']:12s} MAL {mal:>5s}  {r['tok_per_s']:6.1f} tok/s  "
                  f"x{r['speedup']:.2f}  identical {r['identical_prompts']}/{r['prompts']}")
        return
    run_training(cfg)


if __name__ == "__main__":
    main()
