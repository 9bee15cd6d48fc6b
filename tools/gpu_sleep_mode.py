"""Sleep mode on the GPU (issue 21, item 3): device memory before, asleep and after each
level, the seconds sleep and wake take, and greedy outputs before and after (they must be
equal). One JSON line per level, then a summary; `--out` writes them all.

python3 tools/gpu_sleep_mode.py --config qwen3-0.6b [--out FILE]"""
from __future__ import annotations

import argparse
import json
import time

import torch


def device_used_bytes() -> int:
    """Bytes in use on the device, by every process (the driver's view)."""
    free, total = torch.cuda.mem_get_info()
    return total - free


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen3-0.6b")
    ap.add_argument("--kv-cache-gib", type=float, default=8.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from folio import LLM, SamplingParams
    from folio.bench.random_model import build_random_model
    path = build_random_model(args.config)
    llm = LLM(path, dtype="bfloat16", device="cuda", max_model_len=2048,
              kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), enable_sleep_mode=True)
    prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def answers() -> list[list[int]]:
        return [list(o.outputs[0].token_ids)
                for o in llm.generate(prompts, params, use_tqdm=False)]

    want = answers()
    rows = []
    for level in (1, 2):
        torch.cuda.synchronize()
        before = device_used_bytes()
        start = time.perf_counter()
        freed = llm.sleep(level)
        sleep_s = time.perf_counter() - start
        asleep = device_used_bytes()
        start = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - start
        after = device_used_bytes()
        got = answers()
        row = dict(config=args.config, level=level, used_before_gib=before / 2**30,
                   used_asleep_gib=asleep / 2**30, used_after_gib=after / 2**30,
                   freed_weights_gib=freed.get("weights", 0) / 2**30,
                   freed_kv_gib=freed.get("kv_cache", 0) / 2**30, sleep_s=sleep_s,
                   wake_s=wake_s, outputs_equal=got == want)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for row in rows:
        print(f"level {row['level']}: {row['used_before_gib']:.2f} GiB used -> "
              f"{row['used_asleep_gib']:.2f} asleep -> {row['used_after_gib']:.2f} after; "
              f"sleep {row['sleep_s']:.2f} s, wake {row['wake_s']:.2f} s; outputs equal: "
              f"{row['outputs_equal']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
