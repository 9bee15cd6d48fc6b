#!/usr/bin/env bash
# Issue 23 (KV tiers) on the lent GPU:   PART=tests|bench|overlap|disagg bash tools/device_issue23.sh
# Carry `.whl` and `device_tokenizer/` as tools/device_issue16.sh says.
#   tests: tests/gpu/test_gpu_kv_tiers.py (pinned host pool, CUDA graphs, disk tier restart),
#          tests/gpu/test_gpu_disagg.py (a consumer engine fetching prompts' KV from a producer)
#   bench: the seed's case at the Llama-3-8B shape: TTFT of a 1,600-token prefix as a device
#          hit, from the host tier, recomputed (targets: host <= 1.6x device, <= 0.4x recompute)
set -uo pipefail
STEP_PATTERN="TTFT|ITL|P/D|passed|failed|Error|error"
. tools/device_common.sh
case "${PART:-tests}" in
tests)
  step 400 kv_tiers_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf --tb=short \
      tests/gpu/test_gpu_kv_tiers.py tests/gpu/test_gpu_disagg.py ;;
overlap)
  # host-tier loads layer by layer on a side stream (session 15): the GPU test, then the bench
  step 200 kv_tiers_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf --tb=short \
      tests/gpu/test_gpu_kv_tiers.py
  M=$(python3 -c "from folio.bench.random_model import build_random_model as b; print(b('llama3-8b'))" | tail -1)
  step 380 kv_tiers_llama8b python3 -m folio.entrypoints.cli bench kv-tiers --model "$M" \
      --dtype bfloat16 --input-len 1600 --num-iters 5 --num-iters-warmup 1 \
      --max-model-len 2048 --num-gpu-blocks-override 400 --kv-offloading-size 4 \
      --output-json "$OUT/kv_tiers_llama8b.json" ;;
bench)
  M=$(python3 -c "from folio.bench.random_model import build_random_model as b; print(b('llama3-8b'))" | tail -1)
  # 1,600-token prefix = 100 blocks; 400 device blocks: four 1,600-token fillers evict it
  step 500 kv_tiers_llama8b python3 -m folio.entrypoints.cli bench kv-tiers --model "$M" \
      --dtype bfloat16 --input-len 1600 --num-iters 5 --num-iters-warmup 1 \
      --max-model-len 2048 --num-gpu-blocks-override 400 --kv-offloading-size 4 \
      --output-json "$OUT/kv_tiers_llama8b.json" ;;
disagg)
  # prefill and decode as two servers on the one GPU (each 24 GiB of KV cache), 8k-token
  # prompts arriving while 16 requests decode; the single server gets the same cache
  M=$(python3 -c "from folio.bench.random_model import build_random_model as b; print(b('llama3-8b'))" | tail -1)
  step 560 disagg_llama8b python3 -m folio.entrypoints.cli bench disagg --model "$M" \
      --server-args "--dtype bfloat16 --max-model-len 8192 --kv-cache-memory-bytes 25769803776" \
      --num-decoders 16 --decode-input-len 128 --decode-output-len 256 --num-long 5 \
      --long-input-len 7936 --long-output-len 8 --long-interval 1.0 \
      --output-json "$OUT/disagg_llama8b.json" ;;
esac
