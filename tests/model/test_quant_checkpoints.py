"""folio.bench.quant_checkpoints: quantized checkpoints in the formats users download, written
from a tiny random Llama. Each format's files have the published names, dtypes and shapes and its
config.json the published quantization_config; the dequantized reference directory holds exactly
the dequantized values of what was written (compressed-tensors: as transformers itself
decompresses the directory; AWQ / GPTQ / fp8: as an unpacker written here from the layout
descriptions reads it), within the method's rounding error of the float weights; everything
else is copied unchanged; bad shapes are refused; tools/make_quant_checkpoint.py drives them."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from folio.bench.quant_checkpoints import (PROJECTION_RE, write_awq, write_compressed_tensors,
                                           write_fp8, write_gptq)

ROOT = Path(__file__).resolve().parents[2]
_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")
_LAYOUT = {  # projection -> (out_features, in_features) of the tiny model
    "self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256),
    "self_attn.v_proj": (128, 256), "self_attn.o_proj": (256, 256),
    "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256), "mlp.down_proj": (256, 512),
}
_PROJECTIONS = [f"model.layers.{i}.{p}" for i in range(2) for p in _LAYOUT]
# The refusal names the tensor and the field (whichever projection is checked first).
_NOT_DIVISIBLE_96 = r"proj\.weight: in_features (256|512) is not divisible by group_size 96"


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random float32 Llama saved by transformers, with a small word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = str(tmp_path_factory.mktemp("quant_src") / "model")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 1000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return path


def _config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def _check_copies(src: str, dst: str, deq: str, quantized_names: set[str]) -> None:
    """Side files copied; every tensor but the projections' unchanged (values and dtype), in both
    directories; the reference has the source's config and keys, its projections float32."""
    for name in _SIDE_FILES:
        assert os.path.isfile(os.path.join(src, name)), name
        for out in (dst, deq):
            assert Path(out, name).read_bytes() == Path(src, name).read_bytes(), (out, name)
    source, quant, ref = _tensors(src), _tensors(dst), _tensors(deq)
    plain = {n for n in source if not PROJECTION_RE.match(n)}
    assert plain == {n for n in source if n.removesuffix(".weight") not in _PROJECTIONS}
    assert "lm_head.weight" in plain and "model.embed_tokens.weight" in plain
    for n in plain:
        for out in (quant, ref):
            assert out[n].dtype == source[n].dtype and torch.equal(out[n], source[n]), n
    assert set(ref) == set(source)
    for n in quantized_names:
        assert ref[n].dtype == torch.float32 and ref[n].shape == source[n].shape
    with_q = _config(dst)
    assert with_q.pop("quantization_config")
    assert with_q == _config(src) == _config(deq)


def _unsigned(words: torch.Tensor) -> torch.Tensor:
    """int32 words as their 32-bit unsigned patterns (int64)."""
    return words.to(torch.int64) & 0xFFFFFFFF


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """[..., W] int32 -> [..., W, 8]: nibble i (bits 4i..4i+3) of each word."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    return (_unsigned(words).unsqueeze(-1) >> shifts) & 0xF


# ---------------------------------------------------------------------------------------------
# compressed-tensors
# ---------------------------------------------------------------------------------------------

CT_CASES = [  # scheme, symmetric, format, weight strategy
    ("fp8", True, "float-quantized", "channel"),
    ("fp8-tensor", True, "float-quantized", "tensor"),
    ("w8a8-int8", True, "int-quantized", "channel"),
    ("w4a16", True, "pack-quantized", "group"),
    ("w4a16", False, "pack-quantized", "group"),
]


def _ct_expected_files(scheme: str, symmetric: bool, out: int, inp: int,
                       group: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    if scheme.startswith("fp8"):
        scale = (out, 1) if scheme == "fp8" else (1,)
        return {"weight": (torch.float8_e4m3fn, (out, inp)), "weight_scale": (torch.float32, scale)}
    if scheme == "w8a8-int8":
        return {"weight": (torch.int8, (out, inp)), "weight_scale": (torch.float32, (out, 1))}
    files = {"weight_packed": (torch.int32, (out, inp // 8)),
             "weight_scale": (torch.float32, (out, inp // group)),
             "weight_shape": (torch.int64, (2,))}
    if not symmetric:  # zero points packed 8 per int32 along the output dim
        files["weight_zero_point"] = (torch.int32, (out // 8, inp // group))
    return files


@pytest.mark.parametrize("scheme,symmetric,fmt,strategy", CT_CASES,
                         ids=[f"{c[0]}-{'sym' if c[1] else 'asym'}" for c in CT_CASES])
def test_compressed_tensors(src: str, tmp_path: Path, scheme: str, symmetric: bool, fmt: str,
                            strategy: str) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    group = 128
    dst, deq = str(tmp_path / "q"), str(tmp_path / "deq")
    write_compressed_tensors(src, dst, scheme, group_size=group, symmetric=symmetric,
                             dequantized_dir=deq)
    names = {p + ".weight" for p in _PROJECTIONS}
    _check_copies(src, dst, deq, names)

    # config.json: what llm-compressor's save writes through the library.
    qc = _config(dst)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == fmt and qc["quantization_status"] == "compressed"
    assert qc["ignore"] == ["lm_head"] and qc["version"] == "0.20.1"
    assert list(qc["config_groups"]) == ["group_0"]
    group_0 = qc["config_groups"]["group_0"]
    assert group_0["targets"] == ["Linear"] and group_0["format"] == fmt
    weights, inputs = group_0["weights"], group_0["input_activations"]
    assert weights["strategy"] == strategy and weights["symmetric"] == symmetric
    assert weights["num_bits"] == (4 if scheme == "w4a16" else 8)
    assert weights["type"] == ("float" if scheme.startswith("fp8") else "int")
    assert weights["group_size"] == (group if scheme == "w4a16" else None)
    if scheme == "w4a16":
        assert inputs is None
    else:
        assert inputs["strategy"] == "token" and inputs["dynamic"] is True
        assert inputs["num_bits"] == 8 and inputs["type"] == weights["type"]

    # Files: the library's names, dtypes and shapes.
    quant, ref, source = _tensors(dst), _tensors(deq), _tensors(src)
    for proj in _PROJECTIONS:
        out, inp = _LAYOUT[proj.split(".", 3)[3]]
        expected = _ct_expected_files(scheme, symmetric, out, inp, group)
        found = {k.removeprefix(proj + "."): v for k, v in quant.items()
                 if k.startswith(proj + ".")}
        assert {k: (v.dtype, tuple(v.shape)) for k, v in found.items()} == expected, proj
        if "weight_shape" in found:
            assert found["weight_shape"].tolist() == [out, inp]

    # transformers decompresses the directory to exactly the reference's weights...
    model = AutoModelForCausalLM.from_pretrained(
        dst, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32)
    loaded = model.state_dict()
    for name in names:
        torch.testing.assert_close(loaded[name], ref[name], rtol=1e-6, atol=1e-7)
    # ... and runs as the float reference does.
    plain = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32)
    ids = torch.tensor([[1, 17, 250, 999, 3, 42]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)

    # The reference is within the method's rounding error of the float weights.
    for name in names:
        w, d = source[name], ref[name]
        err = (d - w).abs()
        scale = quant[name.removesuffix("weight") + "weight_scale"].float()
        if strategy == "group":
            scale = scale.repeat_interleave(group, dim=1)
        scale = scale.expand_as(w)
        if scheme.startswith("fp8"):
            # e4m3: 3 mantissa bits (half an ulp is 2^-4 relative), subnormals below 2^-6.
            assert (err <= w.abs() * 2**-4 + scale * 2**-10 + 1e-7).all(), name
        else:
            # int: symmetric s = absmax / ((2^bits - 1) / 2) with q in [-2^(bits-1),
            # 2^(bits-1) - 1] (llm-compressor's convention: +-absmax land half a step outside
            # and round or clip back by half a step); asymmetric s = (max - min) / (2^bits - 1)
            # with a rounded zero point: every element within half a step.
            assert (err <= scale * 0.5 * (1 + 1e-4)).all(), name  # float32 rounding of w / s


def test_compressed_tensors_refuses(src: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=_NOT_DIVISIBLE_96):
        write_compressed_tensors(src, str(tmp_path / "a"), "w4a16", group_size=96)
    with pytest.raises(ValueError, match="lm_head"):
        write_compressed_tensors(src, str(tmp_path / "b"), "fp8", ignore=())
    with pytest.raises(ValueError, match="scheme"):
        write_compressed_tensors(src, str(tmp_path / "c"), "int3")
    with pytest.raises(ValueError, match="symmetric"):
        write_compressed_tensors(src, str(tmp_path / "d"), "fp8", symmetric=False)
    assert not os.listdir(tmp_path)  # refused before anything was written


# ---------------------------------------------------------------------------------------------
# vLLM fp8 (AutoFP8)
# ---------------------------------------------------------------------------------------------

def test_fp8(src: str, tmp_path: Path) -> None:
    dst, deq = str(tmp_path / "q"), str(tmp_path / "deq")
    write_fp8(src, dst, dequantized_dir=deq)
    names = {p + ".weight" for p in _PROJECTIONS}
    _check_copies(src, dst, deq, names)
    assert _config(dst)["quantization_config"] == {"quant_method": "fp8",
                                                   "activation_scheme": "dynamic"}
    quant, ref, source = _tensors(dst), _tensors(deq), _tensors(src)
    for proj in _PROJECTIONS:
        w, s = quant[proj + ".weight"], quant[proj + ".weight_scale"]
        assert w.dtype == torch.float8_e4m3fn and w.shape == _LAYOUT[proj.split(".", 3)[3]]
        assert s.dtype == torch.float32 and s.shape == ()
        assert {k for k in quant if k.startswith(proj + ".")} == {proj + ".weight",
                                                                 proj + ".weight_scale"}
        assert torch.equal(ref[proj + ".weight"], w.float() * s)
        orig = source[proj + ".weight"]
        assert w.float().abs().max() == 448.0  # the scale maps absmax to e4m3's largest value
        err = (ref[proj + ".weight"] - orig).abs()
        assert (err <= orig.abs() * 2**-4 + s * 2**-10 + 1e-7).all(), proj


# ---------------------------------------------------------------------------------------------
# AutoAWQ GEMM
# ---------------------------------------------------------------------------------------------

_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble slot i holds column _AWQ_ORDER[i] of its block


def _awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """[R, C // 8] int32 -> [R, C]: column 8c + _AWQ_ORDER[i] is nibble i of word c."""
    nib = _nibbles(words)                                   # [R, C // 8, 8] by slot
    out = torch.empty_like(nib)
    out[:, :, _AWQ_ORDER] = nib
    return out.flatten(1)


@pytest.mark.parametrize("group", [128, 64])
def test_awq(src: str, tmp_path: Path, group: int) -> None:
    dst, deq = str(tmp_path / "q"), str(tmp_path / "deq")
    write_awq(src, dst, group_size=group, dequantized_dir=deq)
    names = {p + ".weight" for p in _PROJECTIONS}
    _check_copies(src, dst, deq, names)
    assert _config(dst)["quantization_config"] == {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None}
    quant, ref, source = _tensors(dst), _tensors(deq), _tensors(src)
    for proj in _PROJECTIONS:
        n, k = _LAYOUT[proj.split(".", 3)[3]]
        qweight, qzeros, scales = (quant[f"{proj}.{x}"] for x in ("qweight", "qzeros", "scales"))
        assert {x for x in quant if x.startswith(proj + ".")} == {
            f"{proj}.qweight", f"{proj}.qzeros", f"{proj}.scales"}
        assert qweight.dtype == torch.int32 and qweight.shape == (k, n // 8)
        assert qzeros.dtype == torch.int32 and qzeros.shape == (k // group, n // 8)
        assert scales.dtype == torch.float16 and scales.shape == (k // group, n)
        q, z = _awq_unpack(qweight).float(), _awq_unpack(qzeros).float()   # [K, N], [G, N]
        s = scales.float()
        rows = torch.arange(k) // group
        w_kn = (q - z[rows]) * s[rows]
        torch.testing.assert_close(ref[proj + ".weight"], w_kn.t(), rtol=0, atol=0)
        err = (w_kn.t() - source[proj + ".weight"]).abs()
        # half a step, plus what rounding the scale to float16 can add at the top of the range
        assert (err <= 0.5 * s[rows].t() * (1 + 2**-6)).all(), proj


# ---------------------------------------------------------------------------------------------
# AutoGPTQ / GPTQModel
# ---------------------------------------------------------------------------------------------

def _gptq_unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """[K // 8, N] int32 -> [K, N]: row 8w + i is nibble i of word row w."""
    return _nibbles(words).permute(0, 2, 1).flatten(0, 1)


def _gptq_unpack_cols(words: torch.Tensor) -> torch.Tensor:
    """[G, N // 8] int32 -> [G, N]: column 8c + i is nibble i of word c."""
    return _nibbles(words).flatten(1)


GPTQ_CASES = [  # sym, desc_act, checkpoint_format, group
    (True, False, "gptq", 128),
    (False, False, "gptq", 64),
    (True, True, "gptq", 128),
    (False, True, "gptq", 64),
    (False, False, "gptq_v2", 128),
]


@pytest.mark.parametrize("sym,desc_act,fmt,group", GPTQ_CASES,
                         ids=[f"{'sym' if c[0] else 'asym'}-{'act' if c[1] else 'seq'}-{c[2]}-"
                              f"g{c[3]}" for c in GPTQ_CASES])
def test_gptq(src: str, tmp_path: Path, sym: bool, desc_act: bool, fmt: str,
              group: int) -> None:
    dst, deq = str(tmp_path / "q"), str(tmp_path / "deq")
    write_gptq(src, dst, group_size=group, sym=sym, desc_act=desc_act, dequantized_dir=deq,
               checkpoint_format=fmt, seed=3)
    names = {p + ".weight" for p in _PROJECTIONS}
    _check_copies(src, dst, deq, names)
    assert _config(dst)["quantization_config"] == {
        "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
        "sym": sym, "checkpoint_format": fmt, "static_groups": False, "true_sequential": True,
        "damp_percent": 0.01}
    quant, ref, source = _tensors(dst), _tensors(deq), _tensors(src)
    for proj in _PROJECTIONS:
        n, k = _LAYOUT[proj.split(".", 3)[3]]
        g = k // group
        parts = {x: quant[f"{proj}.{x}"] for x in ("qweight", "qzeros", "scales", "g_idx")}
        assert {x for x in quant if x.startswith(proj + ".")} == {f"{proj}.{x}" for x in parts}
        assert parts["qweight"].dtype == torch.int32 and parts["qweight"].shape == (k // 8, n)
        assert parts["qzeros"].dtype == torch.int32 and parts["qzeros"].shape == (g, n // 8)
        assert parts["scales"].dtype == torch.float16 and parts["scales"].shape == (g, n)
        g_idx = parts["g_idx"]
        assert g_idx.dtype == torch.int32 and g_idx.shape == (k,)
        assert torch.bincount(g_idx.long(), minlength=g).tolist() == [group] * g
        monotone = bool((g_idx[1:] >= g_idx[:-1]).all())
        if desc_act:
            assert not monotone
        else:
            assert torch.equal(g_idx.long(), torch.arange(k) // group)
        q = _gptq_unpack_rows(parts["qweight"]).float()                    # [K, N]
        stored = _gptq_unpack_cols(parts["qzeros"]).float()                # [G, N]
        zeros = stored + 1 if fmt == "gptq" else stored
        if sym:
            assert (zeros == 8).all() and (stored == (7 if fmt == "gptq" else 8)).all()
        s = parts["scales"].float()
        rows = g_idx.long()
        w_kn = (q - zeros[rows]) * s[rows]
        torch.testing.assert_close(ref[proj + ".weight"], w_kn.t(), rtol=0, atol=0)
        err = (w_kn.t() - source[proj + ".weight"]).abs()
        assert (err <= 0.5 * s[rows].t() * (1 + 2**-6)).all(), proj
    if desc_act:  # the seed picks the permutation
        again = str(tmp_path / "again")
        write_gptq(src, again, group_size=group, sym=sym, desc_act=True, seed=3,
                   checkpoint_format=fmt)
        other = str(tmp_path / "other")
        write_gptq(src, other, group_size=group, sym=sym, desc_act=True, seed=4,
                   checkpoint_format=fmt)
        key = _PROJECTIONS[0] + ".g_idx"
        assert torch.equal(_tensors(again)[key], quant[key])
        assert not torch.equal(_tensors(other)[key], quant[key])


# ---------------------------------------------------------------------------------------------
# Shapes the formats cannot hold, and the command line
# ---------------------------------------------------------------------------------------------

def _one_projection(path: Path, weight: torch.Tensor) -> str:
    """A checkpoint of one projection (enough for the writers, not for a model)."""
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"model.layers.0.mlp.down_proj.weight": weight}, str(path / "model.safetensors"))
    return str(path)


def _odd_model(path: Path, out_features: int, in_features: int) -> str:
    return _one_projection(path, torch.randn(out_features, in_features))


def test_one_signed_groups(tmp_path: Path) -> None:
    """Groups whose weights are all >= 0 have a min-max zero point of 0: AWQ stores it as is;
    GPTQ v1 cannot (it stores zero - 1), so the writer moves such a group to zero 1 with a
    stretched scale, and every element still dequantizes to within half a step."""
    torch.manual_seed(1)
    weight = torch.randn(16, 64)
    weight[:8, :32] = weight[:8, :32].abs()      # one-signed groups: rows 0..7 of group 0
    src = _one_projection(tmp_path / "src", weight)
    name = "model.layers.0.mlp.down_proj"

    write_awq(src, str(tmp_path / "awq"), group_size=32, dequantized_dir=str(tmp_path / "awq_d"))
    awq = _tensors(str(tmp_path / "awq"))
    z = _awq_unpack(awq[name + ".qzeros"]).float()
    assert (z[0, :8] == 0).all()
    s = awq[name + ".scales"].float().repeat_interleave(32, dim=0).t()
    err = (_tensors(str(tmp_path / "awq_d"))[name + ".weight"] - weight).abs()
    assert (err <= 0.5 * s * (1 + 2**-6)).all()

    for fmt, zero in (("gptq", 1), ("gptq_v2", 0)):
        out, deq = str(tmp_path / fmt), str(tmp_path / (fmt + "_d"))
        write_gptq(src, out, group_size=32, sym=False, checkpoint_format=fmt,
                   dequantized_dir=deq)
        gptq = _tensors(out)
        stored = _gptq_unpack_cols(gptq[name + ".qzeros"]).float()
        zeros = stored + 1 if fmt == "gptq" else stored
        assert (zeros[0, :8] == zero).all(), fmt
        q = _gptq_unpack_rows(gptq[name + ".qweight"]).float()
        s = gptq[name + ".scales"].float()
        rows = gptq[name + ".g_idx"].long()
        w = ((q - zeros[rows]) * s[rows]).t()
        assert torch.equal(w, _tensors(deq)[name + ".weight"])
        assert ((w - weight).abs() <= 0.5 * s[rows].t() * (1 + 2**-6)).all(), fmt


def test_refuses_shapes(src: str, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match=_NOT_DIVISIBLE_96):
        write_awq(src, out, group_size=96)
    # GPTQ ends a row in a shorter group (test_quantized_loading reads such files), but its
    # groups stay multiples of 8, the packed words
    with pytest.raises(ValueError, match="group_size must be -1 or a multiple of 8, got 100"):
        write_gptq(src, out, group_size=100)
    with pytest.raises(ValueError, match="group_size"):
        write_gptq(src, out, group_size=0)
    with pytest.raises(ValueError, match="checkpoint_format"):
        write_gptq(src, out, checkpoint_format="marlin")
    odd_out = _odd_model(tmp_path / "odd_out", 12, 256)
    with pytest.raises(ValueError, match="down_proj.weight: out_features 12 is not divisible by 8"):
        write_awq(odd_out, out)
    with pytest.raises(ValueError, match="out_features 12 is not divisible by 8"):
        write_gptq(odd_out, out)
    odd_in = _odd_model(tmp_path / "odd_in", 16, 12)
    with pytest.raises(ValueError, match="in_features 12 is not divisible by 8"):
        write_gptq(odd_in, out, group_size=8)
    with pytest.raises(ValueError, match="in_features 12 is not divisible by group_size 8"):
        write_compressed_tensors(odd_in, out, "w4a16", group_size=8)
    write_fp8(src, out)
    with pytest.raises(ValueError, match="already quantized"):
        write_fp8(out, str(tmp_path / "twice"))
    assert not os.path.exists(tmp_path / "twice")


def _cli() -> Any:
    spec = importlib.util.spec_from_file_location("make_quant_checkpoint",
                                                  ROOT / "tools" / "make_quant_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli(src: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli = _cli()
    dst, deq = tmp_path / "gptq", tmp_path / "deq"
    assert cli.main([src, str(dst), "--method", "gptq", "--group-size", "64", "--asym",
                     "--desc-act", "--dequantized", str(deq)]) == 0
    qc = _config(str(dst))["quantization_config"]
    assert (qc["group_size"], qc["sym"], qc["desc_act"]) == (64, False, True)
    assert os.path.isfile(deq / "model.safetensors")
    assert cli.main([src, str(tmp_path / "ct"), "--method", "ct-w4a16", "--asym"]) == 0
    group_0 = _config(str(tmp_path / "ct"))["quantization_config"]["config_groups"]["group_0"]
    assert group_0["weights"]["symmetric"] is False
    assert cli.main([src, str(tmp_path / "t"), "--method", "fp8-tensor"]) == 0
    weights = _config(str(tmp_path / "t"))["quantization_config"]["config_groups"]["group_0"]
    assert weights["weights"]["strategy"] == "tensor"
    assert "wrote" in capsys.readouterr().out
    assert cli.main([src, str(tmp_path / "bad"), "--method", "awq", "--group-size", "96"]) == 2
    assert "group_size 96" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([src, str(tmp_path / "bad"), "--method", "fp8", "--asym"])
    with pytest.raises(SystemExit):   # SmoothQuant: the compressed-tensors methods only
        cli.main([src, str(tmp_path / "bad"), "--method", "awq", "--smoothing-strength", "0.5"])
    assert "--smoothing-strength applies to" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([src, str(tmp_path / "bad"), "--method", "awq", "--calibration", "gptq"])
    with pytest.raises(SystemExit):   # act-order of compressed-tensors needs GPTQ
        cli.main([src, str(tmp_path / "bad"), "--method", "ct-w4a16", "--act-order"])
    assert "--act-order applies to ct-w4a16 with --calibration gptq" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # KV scales: into compressed-tensors checkpoints
        cli.main([src, str(tmp_path / "bad"), "--method", "gptq", "--kv-cache-scales", "tensor"])
    assert "--kv-cache-scales applies to" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad")
    assert cli.main([src, str(tmp_path / "kv"), "--method", "ct-fp8",
                     "--kv-cache-scales", "attn_head"]) == 0
    kv = _config(str(tmp_path / "kv"))["quantization_config"]["kv_cache_scheme"]
    assert (kv["type"], kv["num_bits"], kv["strategy"]) == ("float", 8, "attn_head")


def test_cli_calibrated(src: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--calibration gptq (and --act-order for compressed-tensors) reach the writers: what the
    tests' calibrated checkpoints are made with, from the command line."""
    from folio.bench import quant_checkpoints as qc
    cli = _cli()
    seen = []
    monkeypatch.setattr(cli, "write_gptq", lambda *a, **kw: seen.append(("gptq", kw)))
    monkeypatch.setattr(cli, "write_compressed_tensors",
                        lambda *a, **kw: seen.append(("ct", kw)))
    assert cli.main([src, str(tmp_path / "g"), "--method", "gptq", "--calibration", "gptq",
                     "--desc-act", "--group-size", "-1"]) == 0
    assert cli.main([src, str(tmp_path / "c"), "--method", "ct-w4a16", "--calibration", "gptq",
                     "--act-order", "--asym"]) == 0
    assert seen[0] == ("gptq", dict(group_size=-1, sym=True, desc_act=True,
                                    dequantized_dir=None, calibration="gptq"))
    assert seen[1][1]["calibration"] == "gptq" and seen[1][1]["act_order"] is True
    assert qc.CALIBRATIONS == ("rtn", "gptq")   # the CLI's choices


# ---------------------------------------------------------------------------------------------
# GPTQ calibration
# ---------------------------------------------------------------------------------------------

def _correlated_inputs(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose channels are correlated and of unequal size, as a layer's are."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(tokens, 16, generator=gen) @ torch.randn(16, k, generator=gen)
    own = torch.randn(tokens, k, generator=gen)
    return (shared + own) * torch.linspace(0.2, 3.0, k)


def _output_error(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> float:
    """||(W - Q) X^T|| / ||W X^T||: the error of the layer's outputs on the inputs X."""
    return float(((w - q) @ x.t()).norm() / (w @ x.t()).norm())


def _grids() -> dict[str, Any]:
    from compressed_tensors.quantization import QuantizationArgs

    from folio.bench.quant_checkpoints import _CtGrid, _GptqGrid
    ct_args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32,
                               symmetric=False)
    return {"gptq-sym": (_GptqGrid(True, "gptq"), 0, 15),
            "gptq-asym-v1": (_GptqGrid(False, "gptq"), 0, 15),
            "ct-asym": (_CtGrid(ct_args, torch.float32), -8, 7)}


@pytest.mark.parametrize("grid_name", ["gptq-sym", "gptq-asym-v1", "ct-asym"])
@pytest.mark.parametrize("order", ["seq", "act", "act-static"])
def test_gptq_solve(grid_name: str, order: str) -> None:
    """GPTQ on one weight: the outputs' error on the inputs H comes from is well below
    round-to-nearest's, the codes are on the grid, g_idx is the act-order's (or k // G)."""
    from folio.bench.quant_checkpoints import _gptq_solve, _groups_of, _rtn_solve

    grid, qmin, qmax = _grids()[grid_name]
    group, k = 32, 256
    x = _correlated_inputs(2048, k)
    h = 2 * x.t() @ x / len(x)
    w = torch.randn(48, k, generator=torch.Generator().manual_seed(1)) * 0.05
    act, static = order != "seq", order == "act-static"
    solved = _gptq_solve(w, h, grid, group, act_order=act, damp_percent=0.01,
                         static_groups=static)
    rtn = _rtn_solve(w, grid, group, torch.arange(k))
    codes = solved.codes
    assert codes.shape == (48, k) and torch.equal(codes, codes.round())
    assert codes.min() >= qmin and codes.max() <= qmax
    assert solved.scale.shape == solved.zero.shape == (48, k // group)
    if act and not static:   # groups formed in decreasing order of diag(H)
        expected = _groups_of(torch.argsort(h.double().diagonal(), descending=True,
                                            stable=True), group)
        assert torch.equal(solved.g_idx, expected)
        assert not bool((solved.g_idx[1:] >= solved.g_idx[:-1]).all())
    else:
        assert torch.equal(solved.g_idx, torch.arange(k) // group)
    if static:  # the scales of the weight before any update: round-to-nearest's
        assert torch.equal(solved.scale, rtn.scale) and torch.equal(solved.zero, rtn.zero)
    gptq_err = _output_error(w, solved.dequantize(), x)
    rtn_err = _output_error(w, rtn.dequantize(), x)
    assert gptq_err < 0.6 * rtn_err, (gptq_err, rtn_err)
    # Deterministic.
    again = _gptq_solve(w, h, grid, group, act_order=act, damp_percent=0.01,
                        static_groups=static)
    assert torch.equal(again.codes, codes)


def test_gptq_solve_uncorrelated_inputs_is_rtn() -> None:
    """With a diagonal H nothing is fed back (no column's error can be compensated by
    another's): GPTQ gives round-to-nearest's codes. A channel the calibration never saw
    (H[c, c] = 0) is quantized like the others."""
    from folio.bench.quant_checkpoints import _gptq_solve, _GptqGrid, _rtn_solve

    grid = _GptqGrid(False, "gptq")
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    h = torch.diag(torch.rand(128, generator=torch.Generator().manual_seed(3)) + 0.5)
    h[5, 5] = 0.0
    solved = _gptq_solve(w, h, grid, 64, act_order=False, damp_percent=0.01)
    assert torch.equal(solved.codes, _rtn_solve(w, grid, 64, torch.arange(128)).codes)


def _calibration_ids(samples: int = 16, seq_len: int = 64) -> torch.Tensor:
    """Random tokens: the tiny model's word-level tokenizer knows no English."""
    return torch.randint(3, 1000, (samples, seq_len), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def projection_inputs(src: str) -> dict[str, torch.Tensor]:
    """The float model's input [tokens, K] to each projection on _calibration_ids()."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    inputs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            inputs[name] = args[0].reshape(-1, args[0].shape[-1]).detach().clone()
        return hook

    handles = [model.get_submodule(p).register_forward_pre_hook(keep(p + ".weight"))
               for p in _PROJECTIONS]
    with torch.no_grad():
        model.model(input_ids=_calibration_ids())
    for handle in handles:
        handle.remove()
    return inputs


def _check_output_errors(source: dict[str, torch.Tensor], gptq: dict[str, torch.Tensor],
                         rtn: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    """Every projection's output error on the calibration inputs below round-to-nearest's."""
    for name, x in inputs.items():
        w = source[name]
        gptq_err, rtn_err = _output_error(w, gptq[name], x), _output_error(w, rtn[name], x)
        assert gptq_err < 0.95 * rtn_err, (name, gptq_err, rtn_err)


GPTQ_CALIBRATED_CASES = [  # sym, desc_act, static_groups, checkpoint_format, group
    (True, False, False, "gptq", 64),
    (False, True, False, "gptq", 128),
    (True, True, True, "gptq_v2", 64),
]


@pytest.mark.parametrize("sym,desc_act,static,fmt,group", GPTQ_CALIBRATED_CASES,
                         ids=[f"{'sym' if c[0] else 'asym'}-{'act' if c[1] else 'seq'}"
                              f"{'-static' if c[2] else ''}-{c[3]}-g{c[4]}"
                              for c in GPTQ_CALIBRATED_CASES])
def test_gptq_calibrated(src: str, tmp_path: Path, projection_inputs: dict[str, torch.Tensor],
                         sym: bool, desc_act: bool, static: bool, fmt: str, group: int) -> None:
    """write_gptq(calibration="gptq"): the files stay valid (names, dtypes, shapes, the
    reference equal to what they hold), the config says what was done, act-order's g_idx is
    layer 0's decreasing diag(X^T X) (nothing before q/k/v is quantized), and every projection's
    output error on the calibration inputs is below round-to-nearest's."""
    from folio.bench.quant_checkpoints import _groups_of

    dst, deq = str(tmp_path / "q"), str(tmp_path / "deq")
    write_gptq(src, dst, group_size=group, sym=sym, desc_act=desc_act, static_groups=static,
               checkpoint_format=fmt, calibration="gptq", calibration_ids=_calibration_ids(),
               damp_percent=0.02, dequantized_dir=deq)
    names = {p + ".weight" for p in _PROJECTIONS}
    _check_copies(src, dst, deq, names)
    assert _config(dst)["quantization_config"] == {
        "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
        "sym": sym, "checkpoint_format": fmt, "static_groups": static,
        "true_sequential": True, "damp_percent": 0.02}
    quant, ref, source = _tensors(dst), _tensors(deq), _tensors(src)
    for proj in _PROJECTIONS:
        n, k = _LAYOUT[proj.split(".", 3)[3]]
        g = k // group
        parts = {x: quant[f"{proj}.{x}"] for x in ("qweight", "qzeros", "scales", "g_idx")}
        assert {x for x in quant if x.startswith(proj + ".")} == {f"{proj}.{x}" for x in parts}
        assert parts["qweight"].dtype == torch.int32 and parts["qweight"].shape == (k // 8, n)
        assert parts["qzeros"].dtype == torch.int32 and parts["qzeros"].shape == (g, n // 8)
        assert parts["scales"].dtype == torch.float16 and parts["scales"].shape == (g, n)
        g_idx = parts["g_idx"].long()
        assert torch.bincount(g_idx, minlength=g).tolist() == [group] * g
        monotone = bool((g_idx[1:] >= g_idx[:-1]).all())
        assert monotone == (not desc_act or static), proj
        q = _gptq_unpack_rows(parts["qweight"]).float()
        stored = _gptq_unpack_cols(parts["qzeros"]).float()
        zeros = stored + 1 if fmt == "gptq" else stored
        if sym:
            assert (zeros == 8).all()
        s = parts["scales"].float()
        w_kn = (q - zeros[g_idx]) * s[g_idx]
        torch.testing.assert_close(ref[proj + ".weight"], w_kn.t(), rtol=0, atol=0)
    if desc_act and not static:
        x = projection_inputs["model.layers.0.self_attn.q_proj.weight"]
        diag = ((x.t() @ x) * (2.0 / x.shape[0])).double().diagonal()
        expected = _groups_of(torch.argsort(diag, descending=True, stable=True), group)
        for p in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(quant[f"model.layers.0.self_attn.{p}.g_idx"].long(), expected)
    rtn = str(tmp_path / "rtn")
    write_gptq(src, str(tmp_path / "rtn_q"), group_size=group, sym=sym, checkpoint_format=fmt,
               dequantized_dir=rtn)
    _check_output_errors(source, ref, _tensors(rtn), projection_inputs)


@pytest.mark.parametrize("scheme,symmetric,act_order", [
    ("w4a16", True, False), ("w4a16", False, True), ("w8a8-int8", True, False)])
def test_compressed_tensors_gptq(src: str, tmp_path: Path,
                                 projection_inputs: dict[str, torch.Tensor], scheme: str,
                                 symmetric: bool, act_order: bool) -> None:
    """write_compressed_tensors(calibration="gptq"): the library packs GPTQ's values
    (transformers decompresses the directory to exactly the reference), act-order is recorded
    as actorder "weight", and every projection's output error on the calibration inputs is
    below round-to-nearest's."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    dst, deq = str(tmp_path / "q"), str(tmp_path / "deq")
    write_compressed_tensors(src, dst, scheme, group_size=64, symmetric=symmetric,
                             calibration="gptq", calibration_ids=_calibration_ids(),
                             act_order=act_order, dequantized_dir=deq)
    names = {p + ".weight" for p in _PROJECTIONS}
    _check_copies(src, dst, deq, names)
    weights = _config(dst)["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert weights.get("actorder") == ("weight" if act_order else None)
    assert weights["symmetric"] == symmetric
    quant, ref, source = _tensors(dst), _tensors(deq), _tensors(src)
    if scheme == "w4a16":
        assert quant[_PROJECTIONS[0] + ".weight_packed"].dtype == torch.int32
        assert not any(k.endswith("g_idx") for k in quant)
    else:
        assert quant[_PROJECTIONS[0] + ".weight"].dtype == torch.int8
    model = AutoModelForCausalLM.from_pretrained(
        dst, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32)
    loaded = model.state_dict()
    for name in names:
        torch.testing.assert_close(loaded[name], ref[name], rtol=1e-6, atol=1e-7)
    rtn = str(tmp_path / "rtn")
    write_compressed_tensors(src, str(tmp_path / "rtn_q"), scheme, group_size=64,
                             symmetric=symmetric, dequantized_dir=rtn)
    _check_output_errors(source, ref, _tensors(rtn), projection_inputs)


def test_calibration_refusals(src: str, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match="calibration must be one of"):
        write_gptq(src, out, calibration="awq")
    with pytest.raises(ValueError, match="calibration must be one of"):
        write_compressed_tensors(src, out, "w4a16", calibration="GPTQ")
    with pytest.raises(ValueError, match="calibration 'gptq' is offered for"):
        write_compressed_tensors(src, out, "fp8", calibration="gptq")
    with pytest.raises(ValueError, match="act_order"):
        write_compressed_tensors(src, out, "w4a16", act_order=True)
    with pytest.raises(ValueError, match="act_order"):
        write_compressed_tensors(src, out, "w8a8-int8", calibration="gptq", act_order=True)
    with pytest.raises(ValueError, match="int64"):
        write_gptq(src, out, calibration="gptq", calibration_ids=torch.zeros(4, 8))
    with pytest.raises(ValueError, match="int64"):
        write_gptq(src, out, calibration="gptq", calibration_ids=torch.zeros(8, dtype=torch.int64))
    assert not os.path.exists(out)


def test_calibration_tokens(smollm2_dir: str) -> None:
    """GPTQ's default calibration set: 64 windows of 256 tokens, half spread over the pydoc
    topics and half over IDLE's documentation (English that ships with Python), none of
    CPython's LICENSE.txt (the perplexity text), the same every time."""
    import sysconfig

    from transformers import AutoTokenizer

    from folio.bench.quant_checkpoints import _calibration_texts, calibration_tokens

    ids = calibration_tokens(smollm2_dir)
    assert ids.dtype == torch.int64 and ids.shape == (64, 256)
    assert torch.equal(ids, calibration_tokens(smollm2_dir))
    assert len({tuple(row.tolist()) for row in ids}) == 64
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    pydoc, idle = _calibration_texts()
    assert "assert_stmt ::=" in pydoc                    # the language reference's topics
    assert "IDLE" in idle and "<div" not in idle          # help.html's text, without the tags
    assert pydoc.startswith(tokenizer.decode(ids[0]))
    assert pydoc.endswith(tokenizer.decode(ids[31]))
    assert idle.startswith(tokenizer.decode(ids[32]))
    assert idle.endswith(tokenizer.decode(ids[63]))
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt"),
              encoding="utf-8") as f:
        license_start = f.read(2000)
    assert license_start not in pydoc and license_start not in idle
    assert calibration_tokens(smollm2_dir, 3, 10).shape == (3, 10)
