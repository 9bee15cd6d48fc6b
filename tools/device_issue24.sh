#!/usr/bin/env bash
# Issue 24 (multimodal) on the lent GPU:   PART=tests bash tools/device_issue24.sh
# Carry `.whl` and `device_tokenizer/` as tools/device_issue16.sh says.
#   tests: tests/gpu/test_gpu_multimodal.py (LLaVA-style images on CUDA against transformers,
#          the encoder in the start-up memory profile, the refusal of a KV budget of nothing)
set -uo pipefail
. tools/device_common.sh
case "${PART:-tests}" in
tests)
  step 300 multimodal_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf --tb=short \
      tests/gpu/test_gpu_multimodal.py ;;
esac
case "${PART:-tests}" in
bench)
  # LLaVA-1.5-7B shape, random weights: TTFT of chat requests with one 336 px image, each
  # image first seen (encoder runs) and again with another text (encoder cache), one at a time
  M=$(python3 tools/gpu_bench_llava.py --out /tmp/llava7b | tail -1)
  python3 -m folio.entrypoints.cli serve "$M" --dtype bfloat16 --max-model-len 4096 \
      --port 8011 > "$OUT/llava_server.log" 2>&1 &
  for i in $(seq 1 120); do curl -sf localhost:8011/health > /dev/null && break; sleep 2; done
  step 300 llava_mm python3 -m folio.entrypoints.cli bench serve --base-url http://127.0.0.1:8011 \
      --endpoint /v1/chat/completions --dataset random-mm --num-prompts 32 \
      --random-input-len 64 --random-output-len 8 --max-concurrency 1 --tokenizer "$M" \
      --disable-tqdm --output-json "$OUT/llava_mm.json"
  grep -E "encoder cache|TTFT" "$OUT/llava_mm.log"
  kill %1 ;;
esac
