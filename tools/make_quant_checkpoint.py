"""Write a quantized copy of a float Hugging Face checkpoint in a format users download, with no
download (see folio/bench/quant_checkpoints.py): round-to-nearest by default, or GPTQ
calibrated on English that ships with Python (`--calibration gptq`):

    python tools/make_quant_checkpoint.py SRC DST --method METHOD [--group-size N] [--asym]
        [--desc-act] [--calibration rtn|gptq] [--act-order] [--dequantized DIR]

Methods:
  fp8             vLLM "fp8" as AutoFP8 writes it (per-tensor FP8 weights, dynamic activations)
  fp8-tensor      the same as ct-fp8-tensor
  ct-fp8          compressed-tensors FP8, per-channel weight scales, dynamic per-token FP8 inputs
  ct-fp8-tensor   compressed-tensors FP8, one weight scale per tensor, dynamic per-token inputs
  ct-w8a8-int8    compressed-tensors int8 per-channel weights, dynamic per-token int8 inputs
  ct-w4a16        compressed-tensors int4 group weights (--asym: with zero points)
  awq             AutoAWQ GEMM int4 (always with zero points)
  gptq            AutoGPTQ int4 (--asym: with zero points; --desc-act: act-order g_idx;
                  --group-size -1: one group per row; a K that G does not divide ends each
                  row in a shorter group, as AutoGPTQ writes it)

--calibration gptq runs GPTQ (gptq, ct-w4a16, ct-w8a8-int8); with it, --act-order gives
ct-w4a16 llm-compressor's actorder "weight" (static groups), and --desc-act gives gptq the real
act-order (decreasing Hessian diagonal) in place of a seeded permutation.

--kv-cache-scales tensor|attn_head (ct-* methods) adds static FP8 KV cache scales, one per layer
or one per KV head, from the float model's keys and values over the same calibration text
(compressed-tensors' kv_cache_scheme, read with --kv-cache-dtype fp8).

--dequantized DIR also writes the same model as a plain float checkpoint whose projections are
the dequantized values of what was written (a reference for comparing loaders).
"""
from __future__ import annotations

import argparse
import sys

from folio.bench.quant_checkpoints import (KV_SCALE_STRATEGIES, write_awq,
                                           write_compressed_tensors, write_fp8, write_gptq,
                                           write_kv_cache_scales)

METHODS = ("fp8", "fp8-tensor", "ct-fp8", "ct-fp8-tensor", "ct-w8a8-int8", "ct-w4a16", "awq",
           "gptq")
# Group size is a knob of the int4 methods only; --asym of ct-w4a16 and gptq.
_GROUPED = ("ct-w4a16", "awq", "gptq")
_ASYM = ("ct-w4a16", "gptq")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write a quantized checkpoint (compressed-tensors, fp8, AWQ, GPTQ) from a "
                    "float Hugging Face directory.")
    parser.add_argument("src", help="float Hugging Face model directory (safetensors)")
    parser.add_argument("dst", help="directory to write the quantized checkpoint to")
    parser.add_argument("--method", required=True, choices=METHODS)
    parser.add_argument("--group-size", type=int, default=128,
                        help="input channels per scale group (ct-w4a16, awq, gptq; default 128)")
    parser.add_argument("--asym", action="store_true",
                        help="asymmetric weights with zero points (ct-w4a16, gptq)")
    parser.add_argument("--desc-act", action="store_true",
                        help="gptq: act-order groups (a seeded permutation; g_idx not monotone)")
    parser.add_argument("--calibration", choices=("rtn", "gptq"), default="rtn",
                        help="rtn: round-to-nearest from each group's min and max (default); "
                             "gptq: GPTQ over calibration text (gptq, ct-w4a16, ct-w8a8-int8)")
    parser.add_argument("--act-order", action="store_true",
                        help="ct-w4a16 with --calibration gptq: act-order with static groups "
                             "(llm-compressor's actorder \"weight\")")
    parser.add_argument("--smoothing-strength", type=float, default=None,
                        help="ct-* methods: SmoothQuant at this strength first (llm-compressor's "
                             "W8A8 recipes; 0.6 measured best for SmolLM2 W8A8 INT8)")
    parser.add_argument("--kv-cache-scales", choices=KV_SCALE_STRATEGIES, default=None,
                        help="ct-* methods: add static FP8 KV cache scales (kv_cache_scheme), "
                             "per layer (tensor) or per KV head (attn_head)")
    parser.add_argument("--dequantized", metavar="DIR", default=None,
                        help="also write the dequantized model as a float checkpoint here")
    args = parser.parse_args(argv)

    method = "ct-fp8-tensor" if args.method == "fp8-tensor" else args.method
    if args.group_size != 128 and method not in _GROUPED:
        parser.error(f"--group-size applies to {', '.join(_GROUPED)}, not {args.method}")
    if args.asym and method not in _ASYM:
        parser.error(f"--asym applies to {', '.join(_ASYM)}, not {args.method}")
    if args.smoothing_strength is not None and not method.startswith("ct-"):
        parser.error(f"--smoothing-strength applies to the ct-* methods, not {args.method}")
    if args.kv_cache_scales is not None and not method.startswith("ct-"):
        parser.error(f"--kv-cache-scales applies to the ct-* methods, not {args.method}")
    if args.desc_act and method != "gptq":
        parser.error(f"--desc-act applies to gptq, not {args.method}")
    if args.calibration == "gptq" and method not in ("gptq", "ct-w4a16", "ct-w8a8-int8"):
        parser.error(f"--calibration gptq applies to gptq, ct-w4a16 and ct-w8a8-int8, not "
                     f"{args.method}")
    if args.act_order and (method != "ct-w4a16" or args.calibration != "gptq"):
        parser.error("--act-order applies to ct-w4a16 with --calibration gptq (gptq's own "
                     "act-order is --desc-act)")

    try:
        if method == "fp8":
            write_fp8(args.src, args.dst, dequantized_dir=args.dequantized)
        elif method.startswith("ct-"):
            write_compressed_tensors(args.src, args.dst, method.removeprefix("ct-"),
                                     group_size=args.group_size, symmetric=not args.asym,
                                     dequantized_dir=args.dequantized,
                                     smoothing_strength=args.smoothing_strength,
                                     calibration=args.calibration, act_order=args.act_order)
            if args.kv_cache_scales is not None:
                write_kv_cache_scales(args.src, args.dst, strategy=args.kv_cache_scales)
        elif method == "awq":
            write_awq(args.src, args.dst, group_size=args.group_size,
                      dequantized_dir=args.dequantized)
        else:
            write_gptq(args.src, args.dst, group_size=args.group_size, sym=not args.asym,
                       desc_act=args.desc_act, dequantized_dir=args.dequantized,
                       calibration=args.calibration)
    except ValueError as exc:
        print(f"make_quant_checkpoint: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.method} checkpoint to {args.dst}"
          + (f" (dequantized reference: {args.dequantized})" if args.dequantized else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
