#!/usr/bin/env bash
# Issue 16 (quantization) on the lent GPU, in parts that each fit one device call:
#   PART=s14b|s14c|s14a|s13a|s13b|s13c|s13d|s13e|s12a|s12b|s12c|s12d|s12e|first|second|kernels|sweep|sweep2|final2a|final2b|spec17|profile1|s21|s22|s22b|s22c|s23a|s23b|s23c|s23d|s24c|s24d|s25b|s26b|s26c|s27h|s29c|s30a|s30b|s31a|s31b|s31c|s31d|s32a|s32b|s32c|s32d|s33a|s33b|s33h|s34|s34b|s34c|s35|s23 bash tools/device_issue16.sh
# Carry `.whl` (../shared/tools/device-wheels.sh compressed-tensors==0.20.1 loguru==0.7.3) and
# `device_tokenizer/` (untracked: the default model's tokenizer files, for the random-weight
# models). Logs and JSON go to $OUT.
set -uo pipefail
. tools/device_common.sh
LAT="python3 -m folio.bench.latency --random-weights --config llama3-8b --input-len 128 --output-len 128 --max-model-len 4096 --max-num-seqs 1 --num-iters-warmup 1 --num-iters 3"
THR="python3 -m folio.bench.throughput --random-weights --config llama3-8b --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 2048 --no-tqdm"
TTFT="python3 -m folio.bench.latency --random-weights --config llama3-8b --input-len 8000 --output-len 2 --max-model-len 8192 --max-num-batched-tokens 8192 --max-num-seqs 1 --num-iters-warmup 1 --num-iters 3 --no-roofline"
# The sweep's fastest N rows of each (projection, kind): forced configs, the layers' own rows
best_rows() {
  grep -E " (int4|fp8)" "$OUT/sweep.log" | grep -vE "^(chosen|tuned)" \
      | awk '{split($4, a, "/"); print a[1]"-"$1, $0}' | sed 's/-mma-/-/; s/-tri-/-/' \
      | sort -k1,1 -k6,6g | awk -v n="$1" '{c[$1]++} c[$1]<=n' | cut -d" " -f2- | cut -c1-80
}
case "${PART:-tests}" in
s14b)  # next session, first call: this session's CPU-only changes on the GPU -- the decode
       # kernel tuned on real contexts before capture, the norms writing the W8A8
       # projections' codes -- their GPU tests, the 8k TTFT bf16 and FP8, batch-1 FP8 decode
  step 260 tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_cuda_graphs.py tests/gpu/test_gpu_quant.py \
      -k "graph or rms_norm_quantized or norm_quantized_rows or silu_and_mul_quantized or engine_fp8 or eight_bit"
  tail -8 "$OUT/tests.log" | cut -c1-300
  step 130 ttft_bf16 $TTFT --output-json "$OUT/ttft_bf16.json"
  step 110 ttft_fp8 $TTFT --quantization fp8 --output-json "$OUT/ttft_fp8.json"
  step 100 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  step 100 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json" ;;
s14c)  # next session, second call: the decode attention's split count and tile per (batch,
       # context); the one-row FP8 GEMV with wider tiles; batch-1 FP8 decode with decode
       # graphs per split count (.old/decode_graph_tiers.patch, session 14: each batch size
       # captured for every split count its contexts call for) and its GPU test
  step 200 splits python3 tools/gpu_sweep_decode_splits.py --batches 1,4,16,64 \
      --ctx 128,256,512,2048,8192 --json "$OUT/splits.json"
  grep "^b=" "$OUT/splits.log" | cut -c1-250
  step 120 splits_fp8 python3 tools/gpu_sweep_decode_splits.py --batches 1,64 --ctx 256,2048,8192 \
      --kv-dtype fp8 --json "$OUT/splits_fp8.json"
  grep "^b=" "$OUT/splits_fp8.log" | cut -c1-250
  step 200 gemv python3 tools/gpu_check_quant.py --sweep --m 1 --json "$OUT/gemv.json"
  grep -E "fp8" "$OUT/gemv.log" | sort -k1,1 -k4,4n | awk '{c[$1]++} c[$1]<=6' | cut -c1-100
  patch -p1 < .old/decode_graph_tiers.patch > /dev/null
  step 100 lat_fp8_tiers $LAT --quantization fp8 --output-json "$OUT/lat_fp8_tiers.json"
  step 150 tiers_test python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_cuda_graphs.py -k per_split_count ;;
s14a)  # session 14, first call: the dense prefill as committed (padded lengths, plans at
       # start-up, from 4,096 tokens), NCCL at world size 1 (issue 22), decode graphs per
       # split count -- their GPU tests; the 8k TTFT bf16 and FP8; batch-1 FP8 decode and
       # where its GPU time goes
  step 240 tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_dense_prefill.py tests/gpu/test_cuda_graphs.py \
      tests/gpu/test_gpu_nccl_single_rank.py tests/gpu/test_gpu_quant.py \
      -k "dense or graph or nccl or silu_and_mul_quantized or engine_fp8"
  tail -8 "$OUT/tests.log" | cut -c1-300
  step 130 ttft_bf16 $TTFT --output-json "$OUT/ttft_bf16.json"
  step 110 ttft_fp8 $TTFT --quantization fp8 --output-json "$OUT/ttft_fp8.json"
  grep -hE "ready|warm|captured" "$OUT"/ttft_*.log | head -6
  step 100 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  step 120 prof_fp8 python3 tools/gpu_profile_batch_kernels.py 1 128 128 --config llama3-8b \
      --quantization fp8
  cut -c1-200 "$OUT/prof_fp8.log" | tail -32 ;;
s13e)  # session 13, fifth call: one-block activation quantization (the row kept in
       # registers), the one-prompt dense step without the output copy; tests, 8k TTFT
  step 200 tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_dense_prefill.py tests/gpu/test_gpu_quant.py \
      -k "dense or silu_and_mul_quantized or activation_quantization or engine_fp8"
  tail -8 "$OUT/tests.log" | cut -c1-300
  step 130 ttft_bf16 $TTFT --output-json "$OUT/ttft_bf16.json"
  step 110 ttft_fp8 $TTFT --quantization fp8 --output-json "$OUT/ttft_fp8.json" ;;
s13d)  # session 13, fourth call: grouped heads read in place by the dense prefill, SiLU-and-mul
       # writing the FP8 down projection's codes; their GPU tests, the 8k TTFT bf16 and FP8,
       # and the FP8 TTFT's kernels
  step 240 tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_dense_prefill.py tests/gpu/test_gpu_quant.py \
      -k "dense or silu_and_mul_quantized or engine_fp8 or eight_bit"
  tail -8 "$OUT/tests.log" | cut -c1-300
  step 130 ttft_bf16 $TTFT --output-json "$OUT/ttft_bf16.json"
  step 110 ttft_fp8 $TTFT --quantization fp8 --output-json "$OUT/ttft_fp8.json"
  step 150 prof_ttft_fp8 python3 tools/gpu_profile_batch_kernels.py 1 8000 2 \
      --config llama3-8b --quantization fp8 --max-model-len 8192 --max-num-batched-tokens 8192
  head -24 "$OUT/prof_ttft_fp8.log" | cut -c1-70,150-200 ;;
s13c)  # session 13, third call: long fresh prefills through torch's fused attention
       # (dense_prefill.py) -- the kernels, the GPU tests, then the 8k TTFT bf16 and FP8
  step 150 attn python3 tools/gpu_bench_attention.py --json "$OUT/attn.json"
  cut -c1-600 "$OUT/attn.log" | grep -E "prefill|decode|Error"
  step 200 dense_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_dense_prefill.py tests/gpu/test_cuda_graphs.py
  tail -30 "$OUT/dense_tests.log" | cut -c1-300
  step 130 ttft_bf16 $TTFT --output-json "$OUT/ttft_bf16.json"
  step 110 ttft_fp8 $TTFT --quantization fp8 --output-json "$OUT/ttft_fp8.json" ;;
s13a)  # session 13, first call: the paged attention kernels (unmasked full tiles, longest
       # tiles first) against the committed ones (carried as .old/triton_kernels.py) and
       # torch's SDPA backends; then the 8k TTFT, bf16 and FP8, on the new kernels
  step 200 attn python3 tools/gpu_bench_attention.py --kernel-file .old/triton_kernels.py \
      --json "$OUT/attn.json"
  cut -c1-400 "$OUT/attn.log" | grep -E "prefill|decode|Error"
  step 120 attn_fp8 python3 tools/gpu_bench_attention.py --kernel-file .old/triton_kernels.py \
      --kv-dtype fp8 --json "$OUT/attn_fp8.json"
  cut -c1-400 "$OUT/attn_fp8.log" | grep -E "prefill|decode|Error"
  step 130 ttft_bf16 $TTFT --output-json "$OUT/ttft_bf16.json"
  step 110 ttft_fp8 $TTFT --quantization fp8 --output-json "$OUT/ttft_fp8.json" ;;
s13b)  # session 13, second call: where the 8k prefill's GPU time goes, bf16 and FP8, and
       # batch-1 FP8 decode per kernel (PDL off, so each kernel's time is its own)
  P="python3 tools/gpu_profile_batch_kernels.py"
  step 150 prof_ttft_fp8 $P 1 8000 2 --config llama3-8b --quantization fp8 \
      --max-model-len 8192 --max-num-batched-tokens 8192
  head -40 "$OUT/prof_ttft_fp8.log" | cut -c1-170
  step 150 prof_ttft_bf16 $P 1 8000 2 --config llama3-8b \
      --max-model-len 8192 --max-num-batched-tokens 8192
  head -30 "$OUT/prof_ttft_bf16.log" | cut -c1-170
  FOLIO_PDL=0 step 130 prof_fp8_b1 $P 1 128 128 --config llama3-8b --quantization fp8
  head -40 "$OUT/prof_fp8_b1.log" | cut -c1-170 ;;
s12e)  # session 12, last call: the GPU tests of this session's changes (speculation's verify
       # step, the FP8 product's engine test at its new bar, the MoE few-token form)
  step 300 spec_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_spec_decode.py
  step 150 quant_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf -s \
      tests/gpu/test_gpu_quant.py -k "engine_fp8 or fp8_matmul"
  grep -E "before the first" "$OUT/quant_tests.log" ;;
s12d)  # session 12, fourth call: the few-token MoE form (issue 18) against the grouped GEMMs
       # and the torch path, its GPU tests; .smolA for issue 17's batch-64 call after it
  mkdir -p /tmp/smol && cp .smolA/part /tmp/smol/partA 2>/dev/null
  step 100 moe_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_moe.py
  step 120 moe_layer python3 tools/gpu_bench_moe.py --out "$OUT/moe_layer.json"
  cut -c1-400 "$OUT/moe_layer.log" | grep batch ;;
s12c)  # session 12, third call: the FP8 product's exactness against torch._scaled_mm on the
       # same operands; the engine test with and without the product at 2-64 rows
  step 120 diag python3 tools/gpu_diag_fp8_mm.py
  cut -c1-260 "$OUT/diag.log" | grep -v "^N=.*std=0.02 M=  2" | head -60
  step 150 engine_fp8 python3 -m pytest -q -p no:cacheprovider --noconftest -rf -s \
      tests/gpu/test_gpu_quant.py -k "engine_fp8"
  grep -E "before the first|passed|failed" "$OUT/engine_fp8.log"
  step 150 engine_fp8_off python3 -c "import sys, pytest
from folio.model.quant.eight_bit_linear import EightBitLinear
EightBitLinear._fp8_kernel_wanted = lambda self, x, bias: False   # the old path: cuBLASLt
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--noconftest', '-rf', '-s',
                      'tests/gpu/test_gpu_quant.py', '-k', 'engine_fp8']))"
  grep -E "before the first|passed|failed" "$OUT/engine_fp8_off.log" ;;
s12b)  # session 12, second call: the FP8 product's GPU tests, the engine on FP8 checkpoints,
       # then offline throughput bf16 against FP8 weights + FP8 KV cache (the product now
       # serves 2-64 rows), and batch-1 decode of both
  step 200 gpu_fp8_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_quant.py -k "fp8_matmul or eight_bit or engine_fp8"
  step 110 thr_bf16 $THR --output-json "$OUT/thr_bf16.json"
  step 100 thr_fp8 $THR --quantization fp8 --kv-cache-dtype fp8 --output-json "$OUT/thr_fp8.json"
  step 100 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  step 100 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json" ;;
s12a)  # session 12, first call: the Triton FP8 product at decode batch sizes (every config,
       # W8A8 and W8A16, against torch._scaled_mm), where batch-1 FP8 decode spends its GPU
       # time, the MoE layer (issue 18) with its one-program alignment; .smolA for issue 17
  mkdir -p /tmp/smol && cp .smolA/part /tmp/smol/partA 2>/dev/null
  step 330 fp8mm python3 tools/gpu_sweep_fp8_mm.py --m 2,8,16,32,64,128,256 --json "$OUT/fp8mm.json"
  grep -E "best|bf16|fp8-now|scaled-mm|quant|auto|WRONG|ERR" "$OUT/fp8mm.log" | cut -c1-90
  step 130 prof_fp8_b1 python3 tools/gpu_profile_batch_kernels.py 1 128 128 --config llama3-8b --quantization fp8
  head -45 "$OUT/prof_fp8_b1.log" | cut -c1-170
  step 120 moe_layer python3 tools/gpu_bench_moe.py --out "$OUT/moe_layer.json"
  grep -E "batch|fused" "$OUT/moe_layer.log" | cut -c1-200 | head -20 ;;
first)  # the quantized linears' GPU tests, then batch-1 decode bf16 / FP8 / W4A16
  step 270 gpu_quant_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_quant.py
  step 170 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json"
  step 120 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json" ;;
second)  # the engine tests again, the FP8 KV cache's GPU tests, W4A16 decode, offline
         # throughput, 8k TTFT, the copy-bandwidth probe
  python3 - <<'PY'
import torch
for gib in (1, 4, 8):
    n = (gib << 30) // 4
    a = torch.empty(n, device="cuda").fill_(1); b = torch.empty_like(a)
    best = {}
    for kind in ("copy_", "add"):
        ts = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            b.copy_(a) if kind == "copy_" else torch.add(a, 0.0, out=b)
            e.record(); e.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
        best[kind] = 2 * n * 4 / min(ts) / 1e12
    print(f"copy bandwidth {gib} GiB: " + ", ".join(f"{k} {v:.3f} TB/s" for k, v in best.items()))
    del a, b
PY
  step 80 gpu_fp8_kv_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      $(ls tests/gpu/test_fp8_kv_cache*.py 2>/dev/null)
  step 100 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 110 thr_bf16 $THR --output-json "$OUT/thr_bf16.json"
  step 90 thr_fp8 $THR --quantization fp8 --kv-cache-dtype fp8 --output-json "$OUT/thr_fp8.json"
  step 45 ttft_bf16 $TTFT --output-json "$OUT/ttft_bf16.json"
  step 45 ttft_fp8 $TTFT --quantization fp8 --output-json "$OUT/ttft_fp8.json"
  step 100 gpu_engine_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf -s \
      tests/gpu/test_gpu_quant.py -k engine
  grep "before the first difference" "$OUT/gpu_engine_tests.log" ;;
kernels)
  step 300 kernels python3 tools/gpu_check_quant.py --m 1,16,64,4096 --json "$OUT/kernels.json"
  cut -c1-220 "$OUT/kernels.log" ;;
final2a)  # second session, last calls: the 4-bit GEMV configs again, the GPU tests of the
         # changed paths, then every target's bench, bf16 beside each
  step 100 sweep python3 tools/gpu_check_quant.py --sweep --m 1 --json "$OUT/sweep.json"
  grep -E "int4|bf16|fp8 " "$OUT/sweep.log" | cut -c1-80
  step 130 tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_quant.py -k "gemv or gate_up or int4_linear or eight_bit"
  step 90 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 120 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json"
  step 90 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json" ;;
final2b)  # the second half: the FP8 KV cache's GPU tests (the attention tiles now fp16), 8k
          # TTFT and offline throughput
  step 110 gpu_fp8_kv_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf -x \
      tests/gpu/test_fp8_kv_cache_gpu.py
  step 45 ttft_bf16 $TTFT --output-json "$OUT/ttft_bf16.json"
  step 45 ttft_fp8 $TTFT --quantization fp8 --output-json "$OUT/ttft_fp8.json"
  step 100 thr_bf16 $THR --output-json "$OUT/thr_bf16.json"
  step 90 thr_fp8 $THR --quantization fp8 --kv-cache-dtype fp8 --output-json "$OUT/thr_fp8.json" ;;
sweep2)  # second session, second call: the reworked 4-bit GEMV, W4A16 decode, what the
         # offline throughput spends its GPU time on (bf16 against FP8 + FP8 KV)
  step 200 sweep python3 tools/gpu_check_quant.py --sweep --m 1,4096 --json "$OUT/sweep.json"
  grep -E "int4|fp8" "$OUT/sweep.log" | cut -c1-100
  step 120 gemv_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf -x \
      tests/gpu/test_gpu_quant.py -k "gemv or gate_up or int4_linear"
  step 110 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  PROF="python3 tools/gpu_profile_batch_kernels.py 256 600 48 --config llama3-8b"
  step 100 prof_bf16 $PROF
  head -40 "$OUT/prof_bf16.log" | cut -c1-160
  step 100 prof_fp8 $PROF --quantization fp8 --kv-cache-dtype fp8
  head -40 "$OUT/prof_fp8.log" | cut -c1-160 ;;
spec17)  # issue 17 (next session): speculative decoding's GPU test, then batch-1 decode with
         # and without n-gram drafts on the editing workload (random Llama-3-8B weights do not
         # copy; the acceptance there is the machinery's cost, not a speed-up)
  step 240 spec_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf -s \
      tests/gpu/test_gpu_spec_decode.py
  step 150 lat_spec_off $LAT --dataset editing --output-json "$OUT/lat_spec_off.json"
  step 150 lat_spec_ngram $LAT --dataset editing --output-json "$OUT/lat_spec_ngram.json" \
      --speculative-config '{"method":"ngram","num_speculative_tokens":4}' ;;
s31a)  # session 31: the one-row GEMVs' tensor-core form (MMA configs; mma.sync on the codes:
       # 4-bit 11.8 instructions a word against 18.6, FP8 1.6 a code against 5.9) -- GPU tests
       # with every config forced, then the one-row sweep (every config of every projection;
       # int4/...mma and fp8/mma... the new ones, fp8-mma autotuned)
  step 300 tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_gpu_quant.py \
      -k "int4_gemv or gate_up_silu or mma or fp8_gemv"
  tail -6 "$OUT/tests.log" | cut -c1-400
  STEP_PATTERN="Error|bandwidth" step 280 sweep python3 tools/gpu_check_quant.py --sweep \
      --m 1 --json "$OUT/sweep.json"
  grep -E "int4|fp8|bf16 " "$OUT/sweep.log" | grep -v "fp8/[0-9]" | sort -k1,1 -k4,4n \
      | awk '{c[$1]++} c[$1]<=10' | cut -c1-90 ;;
s32a)  # next session, one call: s31d (the forms' GPU tests with x prefetched, batch-1 W4A16
       # and FP8 with each switch off and on), then the one-row sweep of the 4-bit and FP8
       # kinds only (every config, MMA ones named ...mma)
  PART=s31d bash tools/device_issue16.sh
  STEP_PATTERN="Error|bandwidth" step 150 sweep python3 tools/gpu_check_quant.py --sweep \
      --m 1 --kinds int4,fp8 --json "$OUT/sweep.json"
  grep -E "int4|fp8" "$OUT/sweep.log" | grep -v "fp8/[0-9]" | sort -k1,1 -k4,4n \
      | awk '{c[$1]++} c[$1]<=10' | cut -c1-90 ;;
s32b)  # session 32, call 1: the tensor-core configs with more programs (one warp, K split 8
       # and 16 ways) -- the GPU tests with every config forced, then the one-row sweep of the
       # 4-bit and FP8 kinds (the best six a projection and kind, by time)
  step 240 tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_gpu_quant.py \
      -k "int4_gemv_every_config or mma or fp8_gemv"
  tail -4 "$OUT/tests.log" | cut -c1-400
  STEP_PATTERN="Error|bandwidth" step 240 sweep python3 tools/gpu_check_quant.py --sweep \
      --m 1 --kinds int4,fp8 --json "$OUT/sweep.json"
  grep -E " (int4|fp8)" "$OUT/sweep.log" | grep -v "fp8/[0-9]" \
      | awk '{split($4, a, "/"); print a[1]"-"$1, $0}' | sed 's/-mma-/-/; s/-tri-/-/' \
      | sort -k1,1 -k6,6g | awk '{c[$1]++} c[$1]<=6' | cut -d" " -f2- | cut -c1-80 ;;
s32c)  # session 32, call 2: batch-1 W4A16 as it is, then with the 4-bit tensor-core form in
       # the autotuner's choice (MMA_AUTOTUNED, switched on in this copy): the GPU tests its
       # other launches take (gate|up + SiLU, the norm epilogue, the layer) with every config,
       # then batch-1 W4A16 again
  step 90 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  sed -i 's/^MMA_AUTOTUNED = False/MMA_AUTOTUNED = True/' folio/model/kernels/int4_gemv.py
  step 220 tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_gpu_quant.py \
      -k "int4_gate_up_silu_every_config or int4_gemv_norm_epilogue_every_config or int4_linear_matches_reference"
  tail -4 "$OUT/tests.log" | cut -c1-400
  step 110 lat_w4a16_mma $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16_mma.json" ;;
s31d)  # s31c in the order that a short call leaves most of: the new forms' GPU tests, then
       # each batch-1 pair (off, then switched on in this copy) if they passed
  step 240 tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_gpu_quant.py \
      -k "int4_gemv_every_config or mma or fp8_gemv"
  tail -6 "$OUT/tests.log" | cut -c1-400
  if grep -qE "[0-9]+ passed" "$OUT/tests.log" && ! grep -qE "[0-9]+ failed" "$OUT/tests.log"; then
    step 100 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
    sed -i 's/^MMA_AUTOTUNED = False/MMA_AUTOTUNED = True/' folio/model/kernels/int4_gemv.py
    step 110 lat_w4a16_mma $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16_mma.json"
    step 90 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
    sed -i 's/^FP8_MMA_GEMV = False/FP8_MMA_GEMV = True/' folio/model/kernels/int4_gemv.py
    step 100 lat_fp8_mma $LAT --quantization fp8 --output-json "$OUT/lat_fp8_mma.json"
  fi ;;
s31c)  # session 31, one call: the tensor-core forms' GPU tests, then batch-1 W4A16 and FP8
       # with them off and switched on in this copy (only if the tests passed)
  step 300 tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_gpu_quant.py \
      -k "int4_gemv or gate_up_silu or mma or fp8_gemv"
  tail -6 "$OUT/tests.log" | cut -c1-400
  step 100 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 90 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  if grep -qE "[0-9]+ passed" "$OUT/tests.log" && ! grep -qE "[0-9]+ failed" "$OUT/tests.log"; then
    sed -i 's/^MMA_AUTOTUNED = False/MMA_AUTOTUNED = True/; s/^FP8_MMA_GEMV = False/FP8_MMA_GEMV = True/' \
        folio/model/kernels/int4_gemv.py
    step 120 lat_w4a16_mma $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16_mma.json"
    step 100 lat_fp8_mma $LAT --quantization fp8 --output-json "$OUT/lat_fp8_mma.json"
  fi ;;
s31b)  # session 31, after s31a passed: batch-1 W4A16 and FP8 with the tensor-core forms
       # switched on in this copy (MMA_AUTOTUNED, FP8_MMA_GEMV) against them off, bf16 beside
  step 100 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json"
  step 110 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 90 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  sed -i 's/^MMA_AUTOTUNED = False/MMA_AUTOTUNED = True/; s/^FP8_MMA_GEMV = False/FP8_MMA_GEMV = True/' \
      folio/model/kernels/int4_gemv.py
  grep -n "^MMA_AUTOTUNED\|^FP8_MMA_GEMV" folio/model/kernels/int4_gemv.py
  step 130 lat_w4a16_mma $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16_mma.json"
  step 110 lat_fp8_mma $LAT --quantization fp8 --output-json "$OUT/lat_fp8_mma.json" ;;
s30a)  # next session: the decode kernel over an FP8 cache against a bf16 one, every split
       # and tile (256-key tiles too), at the offline workload's batches (issue 16's 1.4x:
       # session 29's throughput runs with an FP8 cache reached 73 % of roofline, bf16's 83 %)
  S="python3 tools/gpu_sweep_decode_splits.py --batches 64,256 --ctx 512,1024"
  STEP_PATTERN="b=|Error" step 200 sweep_bf16 $S --json "$OUT/sweep_bf16.json"
  STEP_PATTERN="b=|Error" step 200 sweep_fp8 $S --kv-dtype fp8 --json "$OUT/sweep_fp8.json"
  STEP_PATTERN="decode|prefill|Error" step 100 attn_fp8 python3 tools/gpu_bench_attention.py \
      --kv-dtype fp8 ;;
s30b)  # session 30: the FP8 cache read as int16 pairs (the decode kernel's float8 K tile went
       # through shared memory a byte at a time): its GPU tests, the attention kernels against
       # KERNEL_FILE (the previous triton_kernels.py, e.g. from `git show`), the decode sweep,
       # then issue 16's throughput bf16 and FP8 + FP8 KV in one run
  step 300 tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_fp8_kv_cache_gpu.py \
      tests/gpu/test_gpu_engine.py tests/gpu/test_cuda_graphs.py \
      -k "fp8 or greedy_matches_transformers or kv_write_in_rotary or graphs_match_eager"
  tail -4 "$OUT/tests.log" | cut -c1-300
  STEP_PATTERN="decode|prefill|Error" step 100 attn_fp8 python3 tools/gpu_bench_attention.py \
      --kv-dtype fp8 ${KERNEL_FILE:+--kernel-file $KERNEL_FILE}
  STEP_PATTERN="b=|Error" step 120 sweep_fp8 python3 tools/gpu_sweep_decode_splits.py \
      --batches 64,256 --ctx 1024 --kv-dtype fp8 --json "$OUT/sweep_fp8.json"
  step 130 thr_bf16 $THR --output-json "$OUT/thr_bf16.json"
  step 120 thr_fp8 $THR --quantization fp8 --kv-cache-dtype fp8 --output-json "$OUT/thr_fp8.json" ;;
s29c)  # session 29, on an H200 only (the issues' card): issue 17's verify cost first, then
       # issue 16's batch-1 targets with bf16 beside them (s27h in the other order)
  STEP_PATTERN="verify|plain|Error" step 120 verify python3 tools/gpu_verify_cost.py \
      --config llama3-8b --k 4 --gaps
  step 110 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json"
  step 100 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  step 110 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json" ;;
s35)  # session 35: s34, then the FP8 cache's GPU test of scales set at start-up (the engine's
       # calibration step, session 35) beside CUDA graphs
  PART=s34 bash tools/device_issue16.sh
  STEP_PATTERN="passed|failed|Error" step 150 fp8kv_tests python3 -m pytest -q \
      -p no:cacheprovider --noconftest -rf tests/gpu/test_fp8_kv_cache_gpu.py \
      -k "calculated_scales" ;;
s34c)  # s34 for a call of ~220 s: on an H200 issue 17's verify cost alone (its last target),
        # else the speculative-decoding GPU tests (the resting draft model beside async graphs)
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    STEP_PATTERN="verify|plain|Error" step 150 verify python3 tools/gpu_verify_cost.py \
        --config llama3-8b --k 4 --gaps
  else
    STEP_PATTERN="passed|failed|Error" step 200 spec_tests python3 -m pytest -q \
        -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_spec_decode.py
  fi ;;
s34b)  # s34 for a call of ~500 s (device time short): on an H200 s33h's targets alone, else
        # the two GPU tests not yet run
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    PART=s33h bash tools/device_issue16.sh
  else
    step 150 lead_test python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
        tests/gpu/test_gpu_quant.py -k "behind_a_lead"
    STEP_PATTERN="passed|failed|Error" step 240 spec_tests python3 -m pytest -q \
        -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_spec_decode.py
  fi ;;
s34)  # session 34, first call on whichever card comes: on an H200 (the issues' card) s33h's
       # targets first; then the GPU tests not yet run (the resting draft model beside async
       # scheduling and graphs; on an H100 also the lead-kernel tuning and the verify cost)
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    PART=s33h bash tools/device_issue16.sh
    STEP_PATTERN="passed|failed|Error" step 160 spec_tests python3 -m pytest -q \
        -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_spec_decode.py
  else
    step 150 lead_test python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
        tests/gpu/test_gpu_quant.py -k "behind_a_lead"
    STEP_PATTERN="passed|failed|Error" step 240 spec_tests python3 -m pytest -q \
        -p no:cacheprovider --noconftest -rf tests/gpu/test_gpu_spec_decode.py
    STEP_PATTERN="verify|plain|Error" step 120 verify python3 tools/gpu_verify_cost.py \
        --config llama3-8b --k 4 --gaps
  fi ;;
s33a)  # next session: the one-row sweep of the 4-bit and FP8 kinds with the autotuners'
       # choices and their own timings printed (the layers' narrow rows were 9-24 % slower
       # than the best forced config in session 32: do the tuner's alone-and-flushed timings
       # rank the configs as the back-to-back PDL graph does?), then batch-1 W4A16 / FP8
  STEP_PATTERN="Error|bandwidth" step 200 sweep python3 tools/gpu_check_quant.py --sweep \
      --m 1 --kinds int4,fp8 --json "$OUT/sweep.json"
  grep -E "^(chosen|tuned)" "$OUT/sweep.log" | cut -c1-400
  best_rows 4
  step 150 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 120 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json" ;;
s33b)  # session 33: the one-row autotuners timing configs behind a lead kernel (PDL): its
       # GPU test, the sweep (do the tuner's choices now match the best forced rows?), then
       # batch 1 FP8, issue 17's verify cost (the bf16 skinny GEMV's tuning moved too),
       # batch 1 W4A16
  step 150 lead_test python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_quant.py -k "behind_a_lead"
  STEP_PATTERN="Error|bandwidth" step 150 sweep python3 tools/gpu_check_quant.py --sweep \
      --m 1 --kinds int4,fp8 --json "$OUT/sweep.json"
  grep -E "^tuned" "$OUT/sweep.log" | cut -c1-200
  best_rows 3
  step 110 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  STEP_PATTERN="verify|plain|Error" step 120 verify python3 tools/gpu_verify_cost.py \
      --config llama3-8b --k 4 --gaps
  step 110 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json" ;;
s33h)  # session 33 on an H200: s32d with the lead-kernel tuning (verify, FP8, W4A16, bf16)
  PART=s32d bash tools/device_issue16.sh ;;
s32d)  # session 32 on an H200 with little device time left: s29c's steps, bf16 last
  STEP_PATTERN="verify|plain|Error" step 120 verify python3 tools/gpu_verify_cost.py \
      --config llama3-8b --k 4 --gaps
  step 100 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  step 100 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 100 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json" ;;
s27h)  # when an H200 is lent (after PART=s27c of device_issue17.sh passed its tests): issue
       # 16's batch-1 targets with session 26's fusions (the cache write in the rotary, the
       # norms in the GEMVs), bf16 beside them, and issue 17's verify cost, in one call
  step 110 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json"
  step 100 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  step 110 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  STEP_PATTERN="verify|plain|Error" step 120 verify python3 tools/gpu_verify_cost.py \
      --config llama3-8b --k 4 --gaps ;;
s26c)  # next session: the offline workload's large-batch steps kernel by kernel, bf16 against
       # FP8 weights + FP8 KV (issue 16's 1.4x: 1.24x in session 25), PDL off
  P="python3 tools/gpu_profile_batch_kernels.py 256 600 48 --config llama3-8b"
  STEP_PATTERN="GPU|wall|Error" step 200 kernels_bf16 env FOLIO_PDL=0 $P
  STEP_PATTERN="GPU|wall|Error" step 200 kernels_fp8 env FOLIO_PDL=0 $P --quantization fp8 \
      --kv-cache-dtype fp8
  head -30 "$OUT/kernels_bf16.log" "$OUT/kernels_fp8.log" | cut -c1-150 ;;
s26b)  # next session: batch 1 after the argmax change (bf16, FP8, W4A16), then the FP8 and
       # W4A16 steps kernel by kernel on the H200 (PDL off: each kernel's own time)
  step 110 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json"
  step 100 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  step 110 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  STEP_PATTERN="kernels/token|Error" step 120 census_fp8 env FOLIO_PDL=0 python3 \
      tools/gpu_kernel_census.py 64 --config llama3-8b --quantization fp8 --graphs-only
  STEP_PATTERN="kernels/token|Error" step 120 census_w4a16 env FOLIO_PDL=0 python3 \
      tools/gpu_kernel_census.py 64 --config llama3-8b --random-quantization w4a16 --graphs-only
  grep -h -A14 "=== eager" "$OUT/census_fp8.log" "$OUT/census_w4a16.log" | cut -c1-150 ;;
s25b)  # next session, when an H200 is lent (the issue's card; only H100s since session 16):
       # every batch-1 target in one call, bf16 beside them, then the 8k TTFT both ways
  step 110 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json"
  step 100 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  step 110 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 130 ttft_bf16 $TTFT --output-json "$OUT/ttft_bf16.json"
  step 110 ttft_fp8 $TTFT --quantization fp8 --output-json "$OUT/ttft_fp8.json" ;;
s24d)  # session 24, third call: the 4-bit GEMV's split configs for narrow outputs (batch-1
       # W4A16, then their GPU tests); issue 17's verify step in the new 8-token mixed graph,
       # with the skinny kernel's tl.dot path (x's padding rows masked, narrower tiles) and
       # with cuBLAS, the device's idle gaps; the skinny kernel against cuBLAS at 2, 5, 8 rows
  step 110 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 170 int4_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_quant.py -k "int4_gemv_every_config or int4_gate_up_silu_every_config"
  STEP_PATTERN="verify|plain|ms/step|gap|Error" \
      step 140 verify_gemv_all env FOLIO_GEMV=all python3 tools/gpu_verify_cost.py \
      --config llama3-8b --k 4 --gaps
  STEP_PATTERN="verify|plain|ms/step|Error" \
      step 80 verify_cublas python3 tools/gpu_verify_cost.py --config llama3-8b --k 4
  STEP_PATTERN="ALL OK|FAILED|Error" \
      step 80 gemv_rows python3 tools/gpu_check_gemv.py --models llama-3-8b --m 5,8 --timings
  grep -E "^llama" "$OUT/gemv_rows.log" | cut -c1-150 ;;
s24c)  # session 24, second call: the 4-bit GEMV's GPU tests given the time their compiles take
       # (s23d's 130 s ran out after 12 passed), then issue 17's verify step with the skinny
       # kernel for its 5 rows (FOLIO_GEMV=all) profiled: where its device time goes now
  step 330 gemv_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_quant.py -k "gemv or int4"
  tail -4 "$OUT/gemv_tests.log" | cut -c1-300
  STEP_PATTERN="verify|plain|ms/step|passed|failed|Error" \
      step 220 verify_prof env FOLIO_GEMV=all python3 tools/gpu_verify_cost.py --config llama3-8b \
      --k 4 --profile ;;
s23d)  # next session's first call (session 23's device time ran out before it): the 4-bit
       # GEMV over four words a thread in one fp16 partial (2.3-2.6 instructions a code)
       # through its GPU tests, batch-1 W4A16 decode, the one-row kernels, bf16 beside them
       # (then issue 17: PART=s23b bash tools/device_issue17.sh)
  step 130 gemv_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_quant.py -k "gemv or int4"
  step 100 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 150 sweep python3 tools/gpu_check_quant.py --sweep --m 1 --json "$OUT/sweep.json"
  grep -E " int4 | int4-gu|bf16|fp8 " "$OUT/sweep.log" | cut -c1-100
  step 110 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json" ;;
s23c)  # session 23, second call: where batch-1 W4A16 decode's GPU time goes (PDL off, so each
       # kernel's time is its own), session 22's decode-merge review fix through the attention
       # GPU tests, the one-row kernels (fused 4-bit gate|up against GEMV + SiLU-and-mul)
  step 130 prof_w4a16 env FOLIO_PDL=0 python3 tools/gpu_profile_batch_kernels.py 1 128 128 \
      --config llama3-8b --random-quantization w4a16
  cut -c1-160 "$OUT/prof_w4a16.log" | tail -28
  step 250 attn_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_cuda_graphs.py tests/gpu/test_fp8_kv_cache_gpu.py
  step 150 sweep python3 tools/gpu_check_quant.py --sweep --m 1 --json "$OUT/sweep.json"
  grep -E " int4 | int4-gu|int4/|bf16|fp8 " "$OUT/sweep.log" | cut -c1-100 ;;
s23b)  # session 23 (s23a's start failed): issue 17's verify cost with the profile and the host
       # breakdown first, then s23a's GPU tests and batch-1 FP8 / W4A16 decode
  STEP_PATTERN="verify|plain|ms/step|passed|failed|Error" \
      step 200 verify_prof python3 tools/gpu_verify_cost.py --config llama3-8b --k 4 --profile
  step 130 gemv_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_quant.py -k "gemv or int4"
  step 100 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  step 100 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json" ;;
s23a)  # session 23, first call: session 22's review fixes on the GPU (the 4-bit GEMV and fused
       # gate|up), then batch-1 decode W4A16 / FP8 / bf16 in one call
  step 130 gemv_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_quant.py -k "gemv or int4"
  step 110 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  step 100 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 110 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json" ;;
s23)  # next session: what session 22 could not time -- the one-row kernels (the fused 4-bit
      # gate|up against the plain GEMV + SiLU-and-mul; the four-rows-a-thread configs), then
      # batch-1 decode W4A16 / FP8 / bf16 in one call (the decode merge fused in all three)
  step 150 sweep python3 tools/gpu_check_quant.py --sweep --m 1 --json "$OUT/sweep.json"
  grep -E " int4 | int4-gu|int4/|bf16|fp8 " "$OUT/sweep.log" | cut -c1-100
  step 100 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 100 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  step 110 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json" ;;
s22c)  # session 22, last call (device time short): s22b's GPU tests, batch-1 W4A16 decode,
       # issue 17's verify cost once, batch-1 FP8 decode
  step 120 gemv_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_quant.py -k "gemv or int4"
  step 150 attn_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_cuda_graphs.py tests/gpu/test_fp8_kv_cache_gpu.py
  step 100 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  STEP_PATTERN="verify|plain|ms/step|passed|failed|Error" \
      step 200 verify_llama8b python3 tools/gpu_verify_cost.py --config llama3-8b --k 4
  step 100 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json" ;;
s22b)  # session 22, second call: the 4-bit gate|up GEMV with SiLU fused and the decode
       # attention's merge fused into its last split -- their GPU tests; batch-1 W4A16 / bf16
       # / FP8 decode with the roofline probed before the engine too; the one-row kernels
  step 200 gemv_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_quant.py -k "gemv or int4"
  step 200 attn_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_cuda_graphs.py tests/gpu/test_fp8_kv_cache_gpu.py
  step 110 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 120 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json"
  step 110 lat_fp8 $LAT --quantization fp8 --output-json "$OUT/lat_fp8.json"
  step 150 sweep python3 tools/gpu_check_quant.py --sweep --m 1 --json "$OUT/sweep.json"
  grep -E " int4 | int4-gu|bf16|fp8 " "$OUT/sweep.log" | cut -c1-100 ;;
s22)  # session 22: the one-row 4-bit GEMV in fp16 pairs -- its configs at one row against
      # bf16 / FP8 / tinygemm, its GPU tests, batch-1 W4A16 decode with bf16 beside it
  step 150 sweep python3 tools/gpu_check_quant.py --sweep --m 1 --json "$OUT/sweep.json"
  grep -E "int4|bf16|tinygemm" "$OUT/sweep.log" | cut -c1-100
  step 200 gemv_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_quant.py -k "gemv or int4"
  step 110 lat_w4a16 $LAT --random-quantization w4a16 --output-json "$OUT/lat_w4a16.json"
  step 120 lat_bf16 $LAT --output-json "$OUT/lat_bf16.json" ;;
s21)  # session 21: profile1's kernel breakdown of batch-1 decode alone (FP8, W4A16)
  for q in "--quantization fp8" "--random-quantization w4a16"; do
    name=prof_$(echo "$q" | awk '{print $2}')
    step 120 "$name" python3 tools/gpu_profile_batch_kernels.py 1 128 128 --config llama3-8b $q
    cut -c1-200 "$OUT/$name.log" | tail -32
  done ;;
profile1)  # third session: where batch-1 decode's GPU time goes (FP8, W4A16), then
           # speculative decoding's GPU test
  for q in "--quantization fp8" "--random-quantization w4a16"; do
    name=prof_$(echo "$q" | awk '{print $2}')
    step 120 "$name" python3 tools/gpu_profile_batch_kernels.py 1 128 128 --config llama3-8b $q
    cut -c1-200 "$OUT/$name.log" | tail -32
  done
  step 240 spec_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf -s \
      tests/gpu/test_gpu_spec_decode.py ;;
sweep)  # the one-row GEMV configs forced (second session), the new kernels' GPU tests
  step 330 sweep python3 tools/gpu_check_quant.py --sweep --m 1,16,256 --json "$OUT/sweep.json"
  cut -c1-120 "$OUT/sweep.log"
  step 150 gemv_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf -x \
      tests/gpu/test_gpu_quant.py -k "gemv or gate_up or int4_linear or eight_bit" ;;
esac
