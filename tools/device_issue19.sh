#!/usr/bin/env bash
# Issue 19 (pooling models) on the lent GPU: embeddings throughput of a BERT-large-shaped
# encoder (random weights) against sentence-transformers, same texts, dtype and device.
#   bash tools/device_issue19.sh
#   PART=bench|s21|tests|timeline|profile
# Carry `.whl19` and `device_tokenizer/`: .whl and sentence-transformers' wheels together pass
# a call's 64 MiB, so .whl19 holds the server's wheels without the grammar backends and the
# openai client, plus the peer's:
#   ../shared/tools/device-wheels.sh compressed-tensors==0.20.1 loguru==0.7.3 \
#       opentelemetry-api==1.45.3 annotated-doc sentence-transformers==6.3.0 \
#       scikit-learn==1.9.1 scipy==1.17.1 joblib==1.6.0 threadpoolctl==3.8.0 narwhals==2.29.0
#   mkdir -p .whl19 && mv .whl/{scipy,scikit_learn,sentence_transformers,joblib,threadpoolctl,narwhals}* .whl19/
#   for f in .whl/*.whl; do case $f in *llguidance*|*tvm_ffi*|*xgrammar*|*openai*|*jiter*) ;;
#       *) cp $f .whl19/;; esac; done; echo /.whl19/ >> .git/info/exclude
# (tools/device_common.sh installs .whl19 in place of .whl where it is there.) Logs and JSON go
# to $OUT.
set -uo pipefail
STEP_PATTERN="sentences/s|agreement|at its best|passed|failed|Error|error"
. tools/device_common.sh
if [ "${PART:-bench}" = bench ]; then
step 540 embed_bert_large python3 -m folio.bench.throughput --random-weights \
    --config bert-large --task embed --num-prompts 1000 --peer sentence-transformers \
    --peer-batch-sizes 32 64 128 256 --no-tqdm --output-json "$OUT/embed_bert_large.json"
fi
if [ "${PART:-bench}" = s21 ]; then   # session 21, last call: the GPU tests, the bench twice
  step 300 gpu_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_pooling.py tests/gpu/test_gpu_moe.py
  for r in 1 2; do
    step 200 embed_bert_large_$r python3 -m folio.bench.throughput --random-weights \
        --config bert-large --task embed --num-prompts 1000 --peer sentence-transformers \
        --peer-batch-sizes 32 64 128 256 --no-tqdm --output-json "$OUT/embed_bert_large_$r.json"
  done
fi
if [ "${PART:-bench}" = tests ]; then   # session 21: LLM.embed on the GPU against transformers
  step 200 pooling_tests python3 -m pytest -q -p no:cacheprovider --noconftest -rf \
      tests/gpu/test_gpu_pooling.py
fi
if [ "${PART:-bench}" = timeline ]; then   # session 21: where a pass's wall time goes
  python3 -c "from folio.bench.random_model import build_random_model; build_random_model('bert-large')"
  step 200 timeline_embed python3 tools/gpu_profile_embed.py \
      /tmp/folio-cache/random/bert-large 16384 --timeline
  grep -E "pass|kernel time" "$OUT/timeline_embed.log"
fi
if [ "${PART:-bench}" = profile ]; then
  python3 -c "from folio.bench.random_model import build_random_model; build_random_model('bert-large')"
  step 300 profile_embed python3 tools/gpu_profile_embed.py \
      /tmp/folio-cache/random/bert-large 2048 16384
fi
