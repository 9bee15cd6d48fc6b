#!/usr/bin/env bash
# Issue 20 (multi-LoRA) on the lent GPU, in parts that each fit one device call:
#   PART=tests|kernels|b64|b1|final|final2|s7a|s7b bash tools/device_issue20.sh
# Carry `.whl` (../shared/tools/device-wheels.sh peft==0.21.2 accelerate==1.15.0) and
# `device_tokenizer/` (see tools/device_issue16.sh). Logs and JSON go to $OUT.
set -uo pipefail
STEP_PATTERN="latency:|decode:|µs|ratio|passed|failed|Error|error"
. tools/device_common.sh
LAT="python3 -m folio.bench.latency --random-weights --config llama3-8b --input-len 128 --output-len 128 --max-model-len 1024 --num-iters-warmup 1 --num-iters 3 --no-roofline"
case "${PART:-tests}" in
tests)  # the kernels against the per-token reference, the engine against peft
  step 300 lora_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_lora_kernels.py tests/gpu/test_gpu_lora_engine.py ;;
kernels)  # shrink + expand against the base projection, in CUDA graphs
  step 150 lora_kernels python3 tools/gpu_bench_lora.py --out "$OUT/lora_kernels.json" ;;
b64)  # the engine test, then the target: a decode batch of 64 over 8 adapters against none
  step 150 lora_engine_test python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_lora_engine.py
  step 200 lat_b64_base $LAT --batch-size 64 --max-num-seqs 64 --output-json "$OUT/lat_b64_base.json"
  step 170 lat_b64_lora8 $LAT --batch-size 64 --max-num-seqs 64 --lora 8 --lora-rank 16 \
      --output-json "$OUT/lat_b64_lora8.json" ;;
b1)  # batch 1 with one adapter against none
  step 150 lat_b1_base $LAT --batch-size 1 --max-num-seqs 1 --output-json "$OUT/lat_b1_base.json"
  step 150 lat_b1_lora1 $LAT --batch-size 1 --max-num-seqs 1 --lora 1 --lora-rank 16 \
      --output-json "$OUT/lat_b1_lora1.json" ;;
final)  # after PDL on the LoRA kernels: batch 1 with and without an adapter, batch 64 over 8
  step 150 lat_b1_base $LAT --batch-size 1 --max-num-seqs 1 --output-json "$OUT/lat_b1_base.json"
  step 150 lat_b1_lora1 $LAT --batch-size 1 --max-num-seqs 1 --lora 1 --lora-rank 16 \
      --output-json "$OUT/lat_b1_lora1.json"
  step 170 lat_b64_lora8 $LAT --batch-size 64 --max-num-seqs 64 --lora 8 --lora-rank 16 \
      --output-json "$OUT/lat_b64_lora8.json" ;;
final2)  # the fused and slot-sorted kernels: their GPU tests, then the targets
  step 80 lora_kernel_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf -x \
      tests/gpu/test_gpu_lora_kernels.py
  step 75 lat_b1_lora1 $LAT --batch-size 1 --max-num-seqs 1 --lora 1 --lora-rank 16 \
      --output-json "$OUT/lat_b1_lora1.json"
  step 75 lat_b64_lora8 $LAT --batch-size 64 --max-num-seqs 64 --lora 8 --lora-rank 16 \
      --output-json "$OUT/lat_b64_lora8.json"
  step 60 lat_b1_base $LAT --batch-size 1 --max-num-seqs 1 --output-json "$OUT/lat_b1_base.json"
  step 60 lat_b64_base $LAT --batch-size 64 --max-num-seqs 64 --output-json "$OUT/lat_b64_base.json" ;;
s7a)  # session 7: the dense-shrink variants (mm+expand, cat) beside the kernels; the fused
  # kernel at batch 1 in the engine; issue 18's fused MoE layer with the one-program align
  step 90 lora_kernel_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf -x \
      tests/gpu/test_gpu_lora_kernels.py
  step 200 lora_kernels python3 tools/gpu_bench_lora.py --tokens 1,4,16,64 --reps 10 \
      --iters 10 --out "$OUT/lora_kernels.json"
  step 120 moe_layer python3 tools/gpu_bench_moe.py --out "$OUT/moe_layer.json"
  step 150 lat_b1_lora1 $LAT --batch-size 1 --max-num-seqs 1 --lora 1 --lora-rank 16 \
      --output-json "$OUT/lat_b1_lora1.json"
  step 80 lat_b1_base $LAT --batch-size 1 --max-num-seqs 1 --output-json "$OUT/lat_b1_base.json" ;;
s7b)  # session 7: adapters riding the base weights ([W; A_all] in one GEMM), the GPU tests
  # then both targets (FOLIO_LORA=kernels is the separate kernels' side)
  step 190 lora_gpu_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf -x \
      tests/gpu/test_gpu_lora_kernels.py tests/gpu/test_gpu_lora_engine.py
  step 150 lat_b1_lora1 $LAT --batch-size 1 --max-num-seqs 1 --lora 1 --lora-rank 16 \
      --output-json "$OUT/lat_b1_lora1.json"
  step 80 lat_b64_lora8 $LAT --batch-size 64 --max-num-seqs 64 --lora 8 --lora-rank 16 \
      --output-json "$OUT/lat_b64_lora8.json"
  step 70 lat_b1_base $LAT --batch-size 1 --max-num-seqs 1 --output-json "$OUT/lat_b1_base.json"
  step 70 lat_b64_base $LAT --batch-size 64 --max-num-seqs 64 --output-json "$OUT/lat_b64_base.json" ;;
esac
