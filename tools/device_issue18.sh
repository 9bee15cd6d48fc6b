#!/usr/bin/env bash
# Issue 18 (model families) on the lent GPU, in parts that each fit one device call:
#   PART=s22|s21|s21b|s21c|s15|kernels|moe_models|mla|s7|s8 bash tools/device_issue18.sh
# Carry `.whl` and `device_tokenizer/` as tools/device_issue16.sh says. Logs and JSON go to
# $OUT.
set -uo pipefail
STEP_PATTERN="latency:|decode:|roofline|Throughput|output tok/s|KV cache|fused_over|passed|failed|Error|error"
. tools/device_common.sh
case "${PART:-kernels}" in
s22)  # next session: the FP8 experts' gate_up tile (session 21's last sweep) through the GPU
  # tests, and the layer against its floor bf16 / FP8
  step 300 moe_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_moe.py
  PEAK=$(python3 -c "from folio.bench.roofline import measure_copy_bandwidth as m; print(m('cuda') / 1e12)")
  for f in "" "--fp8"; do
    step 150 moe_layer$f python3 tools/gpu_bench_moe.py --batches 1,4 --peak "$PEAK" $f
  done ;;
s21c)  # session 21, third call: FP8 experts (--quantization fp8) -- the GPU tests, the layer
  # against its floor (bytes of FP8 codes), batch-1 decode of Qwen3-30B-A3B shapes bf16 / FP8
  step 300 moe_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_moe.py
  PEAK=$(python3 -c "from folio.bench.roofline import measure_copy_bandwidth as m; print(m('cuda') / 1e12)")
  echo "copy bandwidth: $PEAK TB/s"
  for f in "" "--fp8"; do
    step 150 moe_layer$f python3 tools/gpu_bench_moe.py --batches 1,2,4,64 --peak "$PEAK" $f
    grep '"batch"' "$OUT/moe_layer$f.log" | python3 -c "
import json, sys
for line in sys.stdin:
    d = json.loads(line); print('$f', d['batch'], 'chained', round(d['chained_us'], 2), 'floor', round(d['floor_us'], 2), 'ratio', round(d['chained_over_floor'], 3), 'err', round(d['rel_err_vs_torch'], 4))"
  done
  M="--random-weights --config qwen3-30b-a3b --random-num-layers 12 --input-len 128 --output-len 128 --max-model-len 4096 --max-num-seqs 1 --num-iters-warmup 1 --num-iters 3"
  step 200 lat_qwen3moe_bf16 python3 -m folio.bench.latency $M
  step 200 lat_qwen3moe_fp8 python3 -m folio.bench.latency $M --quantization fp8 ;;
s21b)  # session 21, second call: the tiles chosen from s21's sweep, chained, twice; the tests
  PEAK=$(python3 -c "from folio.bench.roofline import measure_copy_bandwidth as m; print(m('cuda') / 1e12)")
  echo "copy bandwidth: $PEAK TB/s"
  for r in 1 2; do
    step 150 moe_layer_$r python3 tools/gpu_bench_moe.py --batches 1,2,4 --peak "$PEAK"
    grep '"batch"' "$OUT/moe_layer_$r.log" | python3 -c "
import json, sys
for line in sys.stdin:
    d = json.loads(line); print(d['batch'], 'chained', round(d['chained_us'], 2), 'floor', round(d['floor_us'], 2), 'ratio', round(d['chained_over_floor'], 3))"
  done
  step 200 moe_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_moe.py ;;
s21)  # session 21 (on whichever card is lent): the card's copy bandwidth (best of large
  # copies) for the floor, then s15's chained layer and tile sweep against it
  PEAK=$(python3 -c "from folio.bench.roofline import measure_copy_bandwidth as m; print(m('cuda') / 1e12)")
  echo "copy bandwidth: $PEAK TB/s"; nvidia-smi --query-gpu=name --format=csv,noheader
  step 150 moe_layer python3 tools/gpu_bench_moe.py --batches 1,2,4,64 --peak "$PEAK" \
      --out "$OUT/moe_layer.json"
  grep -v "^{" "$OUT/moe_layer.log" | tail -5; grep '"batch"' "$OUT/moe_layer.log" | cut -c1-400
  step 400 moe_sweep python3 tools/gpu_bench_moe.py --sweep --batches 1,2,4 --iters 30 \
      --peak "$PEAK" --out "$OUT/moe_sweep.json"
  grep BEST "$OUT/moe_sweep.log" | cut -c1-300 ;;
s15)  # session 15: the few-token MoE layer chained in a graph (8 calls a replay, as a decode
  # graph runs layers back to back), then its tiles swept at 1, 2 and 4 tokens
  step 150 moe_layer python3 tools/gpu_bench_moe.py --batches 1,2,4,64 --out "$OUT/moe_layer.json"
  step 400 moe_sweep python3 tools/gpu_bench_moe.py --sweep --batches 1,2,4 --iters 30 \
      --out "$OUT/moe_sweep.json"
  grep BEST "$OUT/moe_sweep.log" | cut -c1-300 ;;
kernels)  # the fused-MoE layer against its bytes floor and the torch path; the GPU tests
  step 200 moe_layer python3 tools/gpu_bench_moe.py --out "$OUT/moe_layer.json"
  step 360 gpu_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu ;;
moe_models)  # Qwen3-30B-A3B shapes (12 of 48 layers: the per-layer figures are the point)
  M="--random-weights --config qwen3-30b-a3b --random-num-layers 12"
  step 240 lat_qwen3moe python3 -m folio.bench.latency $M --input-len 128 --output-len 128 \
      --max-model-len 4096 --max-num-seqs 1 --num-iters-warmup 1 --num-iters 3 \
      --output-json "$OUT/lat_qwen3moe.json"
  step 300 thr_qwen3moe python3 -m folio.bench.throughput $M --num-prompts 256 \
      --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 2048 --no-tqdm \
      --output-json "$OUT/thr_qwen3moe.json" ;;
mla)  # DeepSeek-V2-Lite shapes: batch 1 and 64 decode on the latent cache
  M="--random-weights --config deepseek-v2-lite --random-num-layers 9"
  for b in 1 64; do
    step 250 lat_dsv2lite_b$b python3 -m folio.bench.latency $M --input-len 512 \
        --output-len 128 --batch-size $b --max-model-len 2048 --max-num-seqs $b \
        --num-iters-warmup 1 --num-iters 3 --output-json "$OUT/lat_dsv2lite_b$b.json"
  done ;;
s7)  # session 7, the figures not yet measured: MoE throughput on the standard workload, then
  # DeepSeek-V2-Lite shapes at batch 1 and 64 on the latent cache (KV bytes per token)
  M="--random-weights --config qwen3-30b-a3b --random-num-layers 12"
  step 200 thr_qwen3moe python3 -m folio.bench.throughput $M --num-prompts 256 \
      --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 2048 --no-tqdm \
      --output-json "$OUT/thr_qwen3moe.json"
  M="--random-weights --config deepseek-v2-lite --random-num-layers 9"
  for b in 1 64; do
    step 110 lat_dsv2lite_b$b python3 -m folio.bench.latency $M --input-len 512 \
        --output-len 64 --batch-size $b --max-model-len 2048 --max-num-seqs $b \
        --num-iters-warmup 1 --num-iters 2 --output-json "$OUT/lat_dsv2lite_b$b.json"
  done ;;
s8)  # session 8: the DeepSeek-V2-Lite runs again after the smem-pruned attention configs
  M="--random-weights --config deepseek-v2-lite --random-num-layers 9"
  for b in 1 64; do
    step 150 lat_dsv2lite_b$b python3 -m folio.bench.latency $M --input-len 512 \
        --output-len 64 --batch-size $b --max-model-len 2048 --max-num-seqs $b \
        --num-iters-warmup 1 --num-iters 2 --output-json "$OUT/lat_dsv2lite_b$b.json"
  done
  grep -h "KV cache" "$OUT"/lat_dsv2lite_b*.log | head -4 ;;
esac
