"""GGUF weights kept quantized on the CPU (folio/model/quant): the 4-bit planes and int8 codes of
each type equal gguf-py's dequantization (random blocks and the default model's real ones), the
packed matmuls equal dequantize-then-matmul within float32 error, and the default model loads
with every projection packed and gives the float path's logits."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from folio.model.quant.gguf_int8 import INT8_BLOCKS, Int8Rows, int8_from_blocks
from folio.model.quant.gguf_planes import BLOCKS, PlaneSum, planes_from_blocks
from folio.model.quant.gguf_install import packed_module
from folio.model.quant.int4_packed import PackedInt4Weight
from folio.model.quant.int8_packed import PackedInt8Weight, quantize_per_channel
from folio.model.quant.packed import PackedConcat
from gguf_cases import CHAT_PROMPTS, license_ids, load_pair, perplexity, prefill_logits

ALL_BLOCKS = {**BLOCKS, **INT8_BLOCKS}
# (byte offset, count) of the fp16 fields of each block: d; d and m / d and dmin (at the start),
# Q6_K's d at the end.
_F16_FIELDS = {"Q4_0": (0, 1), "Q5_0": (0, 1), "Q8_0": (0, 1), "Q4_1": (0, 2), "Q5_1": (0, 2),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1)}


def _random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes for every code and scale field, with finite fp16 block scales."""
    elems, nbytes = ALL_BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    offset, f16 = _F16_FIELDS[type_name]
    scales = (rng.standard_normal((n, k // elems, f16)) * 0.02).astype(np.float16)
    raw[..., offset:offset + 2 * f16] = scales.view(np.uint8).reshape(n, k // elems, 2 * f16)
    return raw


def _decode(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> PlaneSum | Int8Rows:
    if type_name in INT8_BLOCKS:
        return int8_from_blocks(type_name, raw, shape)
    return PlaneSum(planes_from_blocks(type_name, raw, shape))


def _reference(type_name: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    qtype = getattr(GGMLQuantizationType, type_name)
    return dequantize(raw.reshape(n, -1), qtype).reshape(n, k).astype(np.float32)


@pytest.mark.parametrize("type_name", sorted(ALL_BLOCKS))
def test_quantized_forms_equal_gguf_dequantization(type_name: str) -> None:
    n, k = 7, 512
    raw = _random_blocks(type_name, n, k, seed=len(type_name))
    matrix = _decode(type_name, raw, (n, k))
    if isinstance(matrix, PlaneSum):
        assert all(p.codes.max() <= 15 for p in matrix.planes)
    else:
        assert matrix.codes.dtype == np.int8 and matrix.group == (32 if type_name == "Q8_0" else 16)
        if type_name == "Q6_K":
            assert matrix.codes.min() >= -32 and matrix.codes.max() <= 31
    ref = _reference(type_name, raw, n, k)
    if type_name in INT8_BLOCKS:
        # Rebuilt in gguf-py's order, one float32 rounding per value: bit for bit.
        assert np.array_equal(matrix.dequantize(), ref)
    np.testing.assert_allclose(matrix.dequantize(), ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("type_name", sorted(ALL_BLOCKS))
@pytest.mark.parametrize("rows", [1, 3, 9, 16, 40])
def test_packed_matmul_equals_dequantized_matmul(type_name: str, rows: int) -> None:
    """Each of the kernels' paths: the register-blocked kernel at 1, 3, 9 (a block of 8 and
    one row over) and 16 rows of x (W's 42 rows leave rows over each block of 2 or 4), and
    many rows (tiles of W rebuilt in float32 and multiplied by torch's GEMM)."""
    n, k = 42, 256
    raw = _random_blocks(type_name, n, k, seed=rows)
    weight = torch.from_numpy(_reference(type_name, raw, n, k))
    packed = packed_module([_decode(type_name, raw, (n, k))])
    assert isinstance(packed, PackedInt8Weight if type_name in INT8_BLOCKS else PackedInt4Weight)
    if type_name in ("Q4_0", "Q4_1"):   # float16 d (and m) in the file: kept as such
        assert packed.scale.dtype == packed.zero.dtype == torch.float16
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(n)
    ref = (x.double() @ weight.double().t() + bias.double())
    out = packed(x, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # Other activation dtypes come back in their dtype; rows are rebuilt exactly (two planes'
    # sum, Q5_x, rounds once more than gguf-py's formula: within float32 error there).
    assert packed(x.bfloat16()).dtype == torch.bfloat16
    ids = torch.tensor([[0, n - 1], [5, 5]])
    if type_name.startswith("Q5"):
        torch.testing.assert_close(packed.lookup(ids), weight[ids], rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(packed.lookup(ids), weight[ids])


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_float16_group_parameters_change_no_weight(rows: int) -> None:
    """Planes whose scale and weight at code 0 are float16 values keep them as float16
    (ggml's d and m: 5 bits a weight instead of 6), and every product and row is the float32
    form's bit for bit; planes where either is not (a K-quant's products of two scales, or
    a zero whose m is not exact) keep float32."""
    from folio.model.quant.gguf_planes import Plane
    from folio.model.quant.int4_packed import _half_params
    rng = np.random.default_rng(rows)
    n, k = 37, 128
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    d = (rng.standard_normal((n, k // 32)) * 0.02).astype(np.float16).astype(np.float32)
    m = (rng.standard_normal((n, k // 32)) * 0.1).astype(np.float16).astype(np.float32)
    plane = Plane(codes, d, m + 8 * d)            # a Q4_1 group: scale d, zero m + 8 d
    half = PackedInt4Weight([plane])
    assert half.scale.dtype == torch.float16
    assert torch.equal(half.scale.float()[0], torch.from_numpy(d))
    assert torch.equal(half.zero.float()[0], torch.from_numpy(m))
    full = PackedInt4Weight([plane])
    full.scale = torch.from_numpy(plane.scale[None].copy())     # the float32 form, by hand
    full.zero = torch.from_numpy(plane.zero[None].copy())
    full._matmul = functools.partial(full._matmul.func, codes=full.codes, scale=full.scale,
                                     zero=full.zero)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(half(x), full(x))
    ids = torch.arange(n)
    assert torch.equal(half.lookup(ids), torch.from_numpy(plane.dequantize()))
    assert torch.equal(half.lookup(ids), full.lookup(ids))
    # not float16 values: float32 kept
    k_scale = d * np.float32(37.0 / 64.0) + np.float32(1e-9)
    assert _half_params(k_scale[None], (m + 8 * d)[None]) is None
    assert PackedInt4Weight([Plane(codes, k_scale, m + 8 * d)]).scale.dtype == torch.float32
    # a weight at code 0 that is not a float16 value
    assert _half_params(d[None], (m + 8 * d + np.float32(1e-7) * d)[None]) is None


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q8_0"])
def test_a_rows_product_does_not_depend_on_the_other_rows(type_name: str) -> None:
    """Below the tiled path (decode and batched decode, speculative verify steps), each row of
    x gets the same float32 result whatever rows share its call: a greedy answer must not
    change with the batch it decodes in (a one-row kernel that factored the group parameters
    out was tried and dropped for breaking this)."""
    n, k = 42, 256
    packed = packed_module([_decode(type_name, _random_blocks(type_name, n, k, seed=5),
                                    (n, k))])
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([packed(x[i:i + 1]) for i in range(32)])
    for rows in (2, 5, 8, 9, 32):
        assert torch.equal(packed(x[:rows]), alone[:rows]), rows


def test_bad_shapes_are_refused() -> None:
    raw = _random_blocks("Q4_0", 2, 64, seed=0)
    with pytest.raises(ValueError, match="whole Q4_0 blocks"):
        planes_from_blocks("Q4_0", raw, (2, 48))
    with pytest.raises(ValueError, match="no 4-bit plane form"):
        planes_from_blocks("Q6_K", raw, (2, 64))
    with pytest.raises(ValueError, match="no int8 form"):
        int8_from_blocks("Q4_0", raw, (2, 64))
    with pytest.raises(ValueError, match="whole Q6_K blocks"):
        int8_from_blocks("Q6_K", np.zeros((2, 210), np.uint8), (2, 128))
    with pytest.raises(ValueError, match="multiple of 16"):
        PackedInt8Weight(Int8Rows(np.zeros((2, 40), np.int8), np.ones((2, 5), np.float32)))


def test_mixed_shards_are_concatenated() -> None:
    """A merged projection whose shards come in different forms (Q4_K q and k, Q6_K v)
    multiplies each run of one form with its own kernel, outputs in the module's row order."""
    k = 256
    parts = [("Q4_K", 8), ("Q4_1", 4), ("Q6_K", 5), ("Q8_0", 3)]
    shards = [_decode(t, _random_blocks(t, n, k, seed=n), (n, k)) for t, n in parts]
    packed = packed_module(shards)
    assert isinstance(packed, PackedConcat) and packed.out_features == 20
    assert [type(p) for p in packed.parts] == [PackedInt4Weight, PackedInt8Weight,
                                              PackedInt8Weight]   # Q4_K+Q4_1 stacked
    weight = torch.from_numpy(np.concatenate([s.dequantize() for s in shards]))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ weight.double().t()
    assert ((packed(x).double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert torch.equal(packed.dequantize(), weight)
    # Two int8 shards of one group size stack into one weight; different sizes do not.
    assert isinstance(packed_module(shards[2:3] * 2), PackedInt8Weight)
    assert isinstance(packed_module(shards[2:]), PackedConcat)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_per_channel_int8(rows: int) -> None:
    """`--quantization int8`: symmetric per output channel; the matmul equals the
    dequantized weight's, and the weight is within half a step of the float one."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 96, generator=gen)
    weight[3] = 0.0                                   # an all-zero row: scale 0, no NaN
    q = quantize_per_channel(weight)
    assert q.scale.shape == (37, 1) and q.codes.dtype == np.int8
    assert np.abs(q.codes).max() <= 127
    packed = PackedInt8Weight(q)
    deq = packed.dequantize()
    step = torch.from_numpy(q.scale)
    assert torch.all((deq - weight).abs() <= step / 2 + 1e-7)
    assert torch.equal(deq[3], torch.zeros(96))
    x = torch.randn(rows, 96, generator=gen)
    ref = x.double() @ deq.double().t()
    assert ((packed(x).double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def _default_gguf() -> str:
    from folio.model.default_model import default_gguf_path
    try:
        return default_gguf_path()
    except Exception as exc:  # noqa: BLE001 - the package is a test requirement
        pytest.fail(f"the default model package is missing: {exc}")


def test_real_blocks_of_the_default_model() -> None:
    """The default model's Q4_1 projections and its Q8_0 embedding, as the file has them."""
    from gguf import GGUFReader
    reader = GGUFReader(_default_gguf())
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        k, n = int(t.shape[0]), int(t.shape[1])
        rows = min(n, 256)
        raw = np.asarray(t.data)[:rows]
        ref = dequantize(raw, t.tensor_type).reshape(rows, k)
        matrix = _decode(t.tensor_type.name, raw, (rows, k))
        np.testing.assert_allclose(matrix.dequantize(), ref, rtol=1e-6, atol=1e-5, err_msg=name)


@pytest.fixture(scope="module")
def default_models():
    return load_pair(None)


def test_default_model_loads_packed(default_models) -> None:
    from folio.model.layers import Linear
    packed, plain = default_models
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    assert packed.lm_head_packed is not None  # tied: the packed embedding
    float_bytes = sum(p.numel() * p.element_size() for p in packed.parameters())
    packed_bytes = sum(b.numel() * b.element_size() for b in packed.buffers())
    plain_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    # Q4_1 projections (two 4-bit planes' worth at most) and the Q8_0 embedding: far below
    # the float32 model.
    assert float_bytes + packed_bytes < plain_bytes / 4
    ids = torch.tensor([1, 5, 300, 49151])
    assert torch.equal(packed.embed_tokens(ids), plain.embed_tokens(ids))


def test_default_model_logits_match_the_float_path(default_models) -> None:
    packed, plain = default_models
    ids = torch.tensor([1, 504, 3120, 314, 2744, 28, 6394, 30])
    a, b = prefill_logits(packed, ids), prefill_logits(plain, ids)
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_perplexity_on_an_english_text_matches_the_float_path(default_models) -> None:
    """Perplexity of the first 384 tokens of CPython's LICENSE.txt (a text that ships with
    every Python): the packed path within 1 % of the float path (the issue's Q8_0 bound; the
    Q4 one is 5 %), and a sane value (an English legal text, not noise). The packed model
    reads the text 16 tokens a step, as a batch of decodes would, so its register-blocked
    kernels run (a whole 384-token prefill would take the tiles rebuilt for torch's GEMM)."""
    packed, plain = default_models
    ids = license_ids(384)
    q, f = perplexity(packed, ids, chunk=16), perplexity(plain, ids)
    assert 1.5 < f < 50, f
    assert abs(q / f - 1) < 0.01, (q, f)


def test_quantization_choice(tmp_path) -> None:
    import shutil

    from folio.config import ModelConfig
    from folio.model.discovery import ModelSource, resolve_model_source, resolve_quantization
    default = resolve_model_source(None)
    assert resolve_quantization(None, default, "cpu") == "gguf"
    # CUDA keeps the projections quantized too (folio.model.quant.gguf_gpu)
    assert resolve_quantization(None, default, "cuda") == "gguf"
    assert resolve_quantization("gguf", default, "cuda") == "gguf"
    assert resolve_quantization("none", default, "cpu") == "none"
    plain_dir = ModelSource("hf_dir", "/nonexistent-model-dir")
    assert resolve_quantization(None, plain_dir, "cpu") == "none"
    with pytest.raises(ValueError, match="quantization 'gguf' needs a GGUF model"):
        resolve_quantization("gguf", plain_dir, "cpu")
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int3")
    # A copy of the converted directory outside folio's cache is a user's HF directory: its
    # own weight files count, not the GGUF its marker names.
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "folio_source.json"):
        shutil.copy(f"{default.path}/{name}", copy / name)
    assert resolve_quantization(None, ModelSource("hf_dir", str(copy)), "cpu") == "none"


@pytest.mark.slow
def test_default_model_greedy_answers_match_the_float_path() -> None:
    """The issue's bar: the first 16 greedy tokens of 15 chat prompts equal the dequantized
    float32 path's on at least 13 (the packed float32 kernel gives all 15 here), through the
    whole engine (LLM.chat)."""
    from folio import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    chats = [[{"role": "user", "content": text}] for text in CHAT_PROMPTS]
    answers = {}
    for quantization in ("none", "gguf"):
        llm = LLM(quantization=quantization, max_model_len=512, device="cpu")
        try:
            worker = llm.llm_engine.engine_core.executor.worker
            assert worker.quantization == quantization
            # The packed path's KV cache defaults to float16 (llama.cpp's), the float path's
            # to the model's float32: the answers below compare the two as users get them.
            assert worker.kv_cache_dtype == (torch.float16 if quantization == "gguf"
                                             else torch.float32)
            answers[quantization] = [o.outputs[0].token_ids
                                     for o in llm.chat(chats, params, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()
    same = sum(a == b for a, b in zip(answers["none"], answers["gguf"]))
    assert same >= 13, f"{same} of {len(CHAT_PROMPTS)}"
