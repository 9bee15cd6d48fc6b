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
