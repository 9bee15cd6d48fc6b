"""tools/train_eagle_head.py on a tiny random Llama target: a few training steps (with the
two-step training-time test) lower the loss; the saved head loads in folio as an `eagle`
head; every chain of drafts folio's proposer makes equals the training module's own greedy
chain (so training and inference compute the same function), and greedy answers with the head
equal the answers without speculation."""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from typing import Any

import torch

from folio import LLM, SamplingParams

from test_spec_eagle import record_drafts

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("train_eagle_head",
                                                  ROOT / "tools" / "train_eagle_head.py")
    module = importlib.util.module_from_spec(spec)
    # registered first: its dataclasses resolve their (string) annotations through it
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _sequences(model: Any, num: int, prompt_len: int, new: int, seed: int) -> list[list[int]]:
    """Random prompts continued greedily by the model (its own generations, as the tool's
    training data is)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, 5000, (num, prompt_len), generator=gen)
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=new, do_sample=False,
                             attention_mask=torch.ones_like(prompts), pad_token_id=None)
    return out.tolist()


def _greedy_chain(tool: Any, head: Any, target: Any, context: list[int], k: int) -> list[int]:
    """k drafts for `context` from the training module: the chain anchored at the context's
    second-to-last row, step s reading (token, previous output) as folio's proposer does."""
    weights = tool.TargetWeights.of(target)
    with torch.no_grad():
        hidden = target.model(input_ids=torch.tensor([context])).last_hidden_state
        drafts: list[int] = []
        for _ in range(k):
            tokens = torch.tensor([context + drafts])
            # step s at anchor b reads token b+s+1 (the anchor used here: the context's
            # second-to-last row, whose step s reads the context's last token or draft s-1)
            embeds = [torch.nn.functional.embedding(tool._shift(tokens, s + 1)[:, :len(context)],
                                                    weights.embed)
                      for s in range(len(drafts) + 1)]
            outs = head.chain(embeds, hidden, torch.tensor([len(context)]))
            drafts.append(int((outs[-1][0, len(context) - 2] @ weights.unembed.t()).argmax()))
    return drafts


def test_train_save_load_and_draft(tiny_model_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM
    tool = _tool()
    torch.manual_seed(0)
    target_dir = tiny_model_dir("llama")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    sequences = _sequences(target, 4, 12, 28, seed=1)
    data = tool.target_features(target, sequences)
    # a high rate: a few steps must fit the tiny target's continuations (the test checks
    # acceptance on them)
    cfg = tool.TrainConfig(out=str(tmp_path / "head"), epochs=12, batch_tokens=80,
                           lr=1e-2, warmup_steps=3, ttt_steps=2)
    head = tool.EagleTrainHead(tool.HeadShape.of(target.config))
    history = tool.train_head(head, tool.TargetWeights.of(target), data, cfg,
                              log=lambda _: None)
    first = sum(h["loss"] for h in history[:3]) / 3
    last = sum(h["loss"] for h in history[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    tool.save_head(head, target.config, cfg.out)

    spec = {"method": "eagle", "model": cfg.out, "num_speculative_tokens": 3,
            "adaptive_draft_length": False}
    common = dict(dtype="float32", kv_cache_dtype="float32", max_model_len=256,
                  num_gpu_blocks_override=64, max_num_seqs=4, device="cpu",
                  enable_prefix_caching=False)
    llm = LLM(target_dir, speculative_config=spec, **common)
    seen = record_drafts(llm)
    # prompts the head was trained to continue (acceptance), and a fresh one
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": seq[:12]} for seq in sequences[:3]]
    prompts.append({"prompt_token_ids": [rng.randrange(100, 5000) for _ in range(15)]})
    params = SamplingParams(temperature=0, max_tokens=24)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [list(o.outputs[0].token_ids)
            for o in LLM(target_dir, **common).generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert len(seen) >= 5
    head.eval()
    for context, drafts in seen[:5]:
        assert drafts == _greedy_chain(tool, head, target, context, 3), len(context)
    stats = llm.llm_engine.engine_core.scheduler.stats()
    assert stats.spec_num_accepted_tokens > 0
