"""GGUF files with the K-quant mix of llama.cpp's Q4_K_M, end to end (folio/model/quant): the
default model (SmolLM2-135M, a Q4_1 file) re-quantized by tests/model/gguf_requant.py, loaded
with its matrices kept packed (quantization "gguf") against the same file dequantized
(quantization "none").

Two files, built once per session: `q4_k_m`, as llama.cpp would write SmolLM2-135M (hidden size
576: only ffn_down's rows are whole 256-element super-blocks, so Q4_K / Q5_K / Q6_K there and
llama.cpp's fallbacks Q5_0 / Q5_1 / Q8_0 elsewhere), and `q4_k_m_wide`, the same model widened
to hidden size 768 and 12 heads (an exact transformation) so that every projection is a
K-quant, as in the Q4_K_M files of larger models: Q4_K q/k with a Q6_K v in one qkv."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import gguf_requant
from gguf_cases import CHAT_PROMPTS, license_ids, load_pair, perplexity, prefill_logits

VARIANTS = {"q4_k_m": None, "q4_k_m_wide": (768, 12)}
# Perplexity of the first 384 tokens of CPython's LICENSE.txt under the source Q4_1 file's
# float path (tests/model/test_gguf_packed.py measures it: 15.27).
SOURCE_PERPLEXITY = 15.27


def _default_gguf() -> str:
    from folio.model.default_model import default_gguf_path
    try:
        return default_gguf_path()
    except Exception as exc:  # noqa: BLE001 - the package is a test requirement
        pytest.fail(f"the default model package is missing: {exc}")


@pytest.fixture(scope="session")
def default_reader():
    from gguf import GGUFReader
    return GGUFReader(_default_gguf())


@pytest.fixture(scope="session")
def kquant_files(tmp_path_factory, default_reader):
    """Factory: variant name -> (path of the re-quantized file, {tensor: type written}),
    written on first request (~5-10 s each)."""
    root = tmp_path_factory.mktemp("gguf_kquants")
    built: dict[str, tuple[str, dict[str, str]]] = {}

    def get(variant: str) -> tuple[str, dict[str, str]]:
        if variant not in built:
            path = str(root / f"SmolLM2-135M-Instruct.{variant}.gguf")
            types = gguf_requant.write_requantized(default_reader, path,
                                                   widen=VARIANTS[variant])
            built[variant] = path, types
        return built[variant]

    return get


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def kquant_models(request, kquant_files):
    """(variant, its types, packed model, float model); one variant's models at a time."""
    path, types = kquant_files(request.param)
    packed, plain = load_pair(path)
    yield request.param, types, packed, plain
    del packed, plain


# --------------------------------------------------------------------------- #
# The helper's encoders and file
# --------------------------------------------------------------------------- #


def _hard_rows(k: int, seed: int) -> np.ndarray:
    """Gaussian rows with the cases an encoder gets wrong: an all-zero row, sub-blocks of one
    sign only, a constant sub-block, an outlier, one tiny sub-block beside large ones."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((24, k)) * 0.05).astype(np.float32)
    w[1] = 0.0
    w[2, :256] = np.abs(w[2, :256])
    w[3, :256] = -np.abs(w[3, :256])
    w[4, :32] = 0.3
    w[5, 7] = 2.0
    w[6, :16] *= 1e-4
    return w


@pytest.mark.parametrize("type_name,group", [("Q4_K", 32), ("Q5_K", 32), ("Q6_K", 16)])
def test_k_quant_encoders_round_trip(type_name: str, group: int) -> None:
    """The helper's encoders: gguf-py's dequantize of the blocks is within half a step of w
    everywhere, each step near the least that covers its sub-block's values (Q4_K / Q5_K: an
    RMS error within 1.25x of gguf-py's own Q4_1 / Q5_1 on the same weights), and folio
    decodes the blocks as gguf-py does."""
    from folio.model.quant.gguf_int8 import int8_from_blocks
    from folio.model.quant.gguf_planes import PlaneSum, planes_from_blocks
    from gguf.quants import quantize as gguf_quantize
    w = _hard_rows(768, seed=group)
    blocks, step = gguf_requant.quantize_k(w, type_name)
    elems, nbytes = gguf_requant.QK_K, {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[type_name]
    assert blocks.dtype == np.uint8 and blocks.shape == (24, 768 // elems * nbytes)
    deq = dequantize(blocks, getattr(GGMLQuantizationType, type_name)).reshape(w.shape)
    bound = np.repeat(step, group, axis=1) * 0.5 * (1 + 1e-5) + 1e-8
    assert np.all(np.abs(deq - w) <= bound)
    assert np.array_equal(deq[1], np.zeros(768))
    if type_name == "Q6_K":   # signed scales, negative ones too (as llama.cpp's)
        scales = blocks.reshape(-1, 210)[:, 192:208].view(np.int8)
        assert (scales < 0).any() and (scales > 0).any()
    np.testing.assert_allclose(deq[4, :32], 0.3, rtol=1e-3)
    # Each step exceeds the least covering its sub-block's values (`need`) by at most one step
    # of the super-block's scale d (its scale code rounded up; d covers the largest need in
    # 127 (Q6_K) or 63 codes) and, Q4_K / Q5_K, the min code's rounding up (one step of dmin,
    # over `levels` codes: at most another d).
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 31}[type_name]
    x = w.reshape(24, -1, group)
    low = np.minimum(x.min(-1), 0)
    need = np.abs(x).max(-1) / 31 if type_name == "Q6_K" else (x.max(-1) - low) / levels
    per_block = gguf_requant.QK_K // group
    top = np.repeat(need.reshape(24, -1, per_block).max(-1), per_block, axis=-1)
    slack = top / 127 if type_name == "Q6_K" else top / 63 * 2
    assert np.all(step <= need + slack * 1.01 + 1e-7)
    rms = float(np.sqrt(np.mean((deq - w) ** 2)))
    if type_name in ("Q4_K", "Q5_K"):
        ref_type = getattr(GGMLQuantizationType, "Q4_1" if type_name == "Q4_K" else "Q5_1")
        ref = dequantize(gguf_quantize(w, ref_type), ref_type).reshape(w.shape)
        assert rms < 1.25 * float(np.sqrt(np.mean((ref - w) ** 2)))
    # folio reads the blocks as gguf-py does.
    matrix = (int8_from_blocks(type_name, blocks, w.shape) if type_name == "Q6_K"
              else PlaneSum(planes_from_blocks(type_name, blocks, w.shape)))
    np.testing.assert_allclose(matrix.dequantize(), deq, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="whole 256-element super-blocks"):
        gguf_requant.quantize_k(w[:, :576], type_name)


def test_type_plan_is_llama_cpps_q4_k_m() -> None:
    more = [i for i in range(30) if gguf_requant.use_more_bits(i, 30)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    plan = gguf_requant.q4_k_m_type
    assert plan("blk.5.attn_v.weight", 30) == plan("blk.5.ffn_down.weight", 30) == "Q6_K"
    assert plan("blk.6.attn_v.weight", 30) == plan("blk.6.attn_q.weight", 30) == "Q4_K"
    assert plan("blk.4.ffn_down.weight", 30) == plan("blk.3.ffn_up.weight", 30) == "Q5_K"
    assert plan("token_embd.weight", 30) == "Q8_0"
    assert plan("blk.0.attn_norm.weight", 30) is None
    assert [gguf_requant.stored_type(t, 576) for t in ("Q4_K", "Q5_K", "Q6_K", "Q8_0")] == [
        "Q5_0", "Q5_1", "Q8_0", "Q8_0"]
    assert gguf_requant.stored_type("Q4_K", 1536) == "Q4_K"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_requantized_file_is_the_same_model(variant: str, kquant_files, default_reader) -> None:
    """folio reads the written file as the source's model (widened: its hidden size, heads and
    eps), every metadata key copied with its value and GGUF type, the tokenizer the same, and
    each tensor of the type the plan says, re-encoded within the type's error."""
    from gguf import GGUFReader

    from folio.model.gguf_metadata import load_gguf_tokenizer, read_gguf_metadata
    path, types = kquant_files(variant)
    src = read_gguf_metadata(_default_gguf())
    new = read_gguf_metadata(path)
    widen = VARIANTS[variant]
    expected = dict(src.hf_config)
    if widen is not None:
        expected.update(hidden_size=widen[0], num_attention_heads=widen[1],
                        rms_norm_eps=new.hf_config["rms_norm_eps"])
        assert math.isclose(new.hf_config["rms_norm_eps"],
                            src.hf_config["rms_norm_eps"] * 576 / widen[0], rel_tol=1e-6)
    assert new.hf_config == expected
    assert (new.chat_template, new.extra_eos_token_ids, new.name) == (
        src.chat_template, src.extra_eos_token_ids, src.name)

    reader = GGUFReader(path)
    changed = {"general.file_type", "llama.embedding_length", "llama.attention.head_count",
               "llama.attention.layer_norm_rms_epsilon"}
    for key, field in default_reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out = reader.fields[key]
        assert out.types == field.types, key
        if key not in changed or (widen is None and key != "general.file_type"):
            assert out.contents() == field.contents(), key
    assert reader.fields["general.file_type"].contents() == 15      # MOSTLY_Q4_K_M
    assert set(reader.fields) == set(default_reader.fields)
    if widen is None:   # (the widened file's tokenizer fields are the same bytes)
        from transformers import AutoTokenizer

        from folio.model.default_model import default_model_path
        text = "The capital of France is Paris. <|im_start|>user\nHi!<|im_end|>"
        assert (load_gguf_tokenizer(path)(text)["input_ids"]
                == AutoTokenizer.from_pretrained(default_model_path())(text)["input_ids"])

    source_tensors = {t.name: t for t in default_reader.tensors}
    assert [t.name for t in reader.tensors] == list(source_tensors)
    counts = Counter(types.values())
    for t in reader.tensors:
        assert t.tensor_type.name == types[t.name]
        wanted = gguf_requant.q4_k_m_type(t.name, 30)
        if wanted is None:
            assert t.tensor_type.name == "F32"
            continue
        k = int(t.shape[0])
        assert types[t.name] == gguf_requant.stored_type(wanted, k)
    if widen is None:
        # llama.cpp's Q4_K_M choices and fallbacks for SmolLM2-135M: K-quants in ffn_down only.
        assert counts == {"Q5_0": 30 * 4 + 16 + 26, "Q5_1": 4, "Q8_0": 14 + 1, "Q4_K": 12,
                          "Q5_K": 4, "Q6_K": 14, "F32": 61}
        assert all(types[n] in ("Q4_K", "Q5_K", "Q6_K")
                   for n in types if n.endswith("ffn_down.weight"))
    else:
        assert counts == {"Q4_K": 30 * 4 + 16 + 26 + 12, "Q5_K": 8, "Q6_K": 28, "Q8_0": 1,
                          "F32": 61}
    # One tensor of each kind re-encoded within its type's error of the source's values
    # (widened: the source's rows and columns, the new ones zero).
    for name in ("blk.3.ffn_up.weight", "blk.4.ffn_down.weight", "blk.5.ffn_down.weight",
                 "blk.5.attn_v.weight", "blk.6.ffn_down.weight", "blk.6.attn_k.weight"):
        s, o = source_tensors[name], {t.name: t for t in reader.tensors}[name]
        ref = dequantize(s.data, s.tensor_type).reshape(int(s.shape[1]), int(s.shape[0]))
        got = dequantize(o.data, o.tensor_type).reshape(int(o.shape[1]), int(o.shape[0]))
        rows, cols = ref.shape
        if widen is not None and name.endswith("ffn_down.weight"):
            assert not got[rows:].any()
        if widen is not None and cols == 576:
            assert not got[:, cols:].any()
        got = got[:rows, :cols]
        err = np.abs(got - ref).max() / np.abs(ref).max()
        bound = {"Q4_K": 0.08, "Q5_0": 0.08, "Q5_K": 0.04, "Q5_1": 0.04, "Q6_K": 0.02,
                 "Q8_0": 0.005}[types[name]]
        assert err < bound, (name, types[name], err)


@pytest.mark.slow
def test_widening_is_exact(tmp_path, default_reader) -> None:
    """The widened model is the same function: two layers of the default model, every matrix
    Q8_0 (whose groups of 32 the widening moves whole, so both files hold the same values),
    give the same logits widened and not, through the float path."""
    from folio.model.discovery import load_hf_config, resolve_model_source
    from folio.model.loader import load_model

    def q8(name: str, n_layers: int) -> str | None:
        return "Q8_0" if gguf_requant.q4_k_m_type(name, n_layers) else None

    ids = torch.tensor([1, 504, 3120, 314, 2744, 28, 6394, 30])
    logits = []
    for widen in (None, (768, 12)):
        path = str(tmp_path / f"two-layers-{widen}.gguf")
        gguf_requant.write_requantized(default_reader, path, q8, widen=widen, layers=2)
        source = resolve_model_source(path)
        hf_config, _ = load_hf_config(source)
        model, _ = load_model(source, hf_config, torch.float32, torch.device("cpu"), 64,
                              quantization="none")
        logits.append(prefill_logits(model, ids))
    a, b = logits
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-5
    assert torch.equal(a.argmax(-1), b.argmax(-1))


# --------------------------------------------------------------------------- #
# folio on the files
# --------------------------------------------------------------------------- #


def _packed_kind(module) -> str:
    from folio.model.quant.packed import PackedConcat
    if isinstance(module, PackedConcat):
        return "concat(" + ",".join(_packed_kind(p) for p in module.parts) + ")"
    return {"PackedInt4Weight": "int4", "PackedInt8Weight": "int8"}[type(module).__name__]


def test_modules_get_their_packed_forms(kquant_models) -> None:
    """Q4_K/Q5_K/Q5_0/Q5_1 shards -> 4-bit planes, Q6_K/Q8_0 shards -> int8; a merged
    projection of both -> a PackedConcat; the embedding int8 (rows by lookup, the tied lm_head
    the same weight); no float copy of any packed weight."""
    from folio.model.layers import Linear
    from folio.model.quant.gguf_install import PackedEmbedding
    from folio.model.quant.int4_packed import PackedInt4Weight
    from folio.model.quant.int8_packed import PackedInt8Weight
    variant, types, packed, plain = kquant_models
    linears = {name: m for name, m in packed.named_modules() if isinstance(m, Linear)}
    assert linears and all(m.packed is not None and m.weight.numel() == 0
                           for m in linears.values())
    int8 = ("Q6_K", "Q8_0")
    for i in range(30):
        blk = f"blk.{i}."
        qkv = _packed_kind(linears[f"layers.{i}.self_attn.qkv_proj"].packed)
        if types[blk + "attn_v.weight"] in int8:
            assert qkv == "concat(int4,int8)", (i, qkv)  # q and k stacked: one int4 part
        else:
            assert qkv == "int4"
        down = linears[f"layers.{i}.mlp.down_proj"].packed
        assert _packed_kind(down) == ("int8" if types[blk + "ffn_down.weight"] in int8
                                      else "int4")
        gate_up = linears[f"layers.{i}.mlp.gate_up_proj"].packed
        assert isinstance(gate_up, PackedInt4Weight)
        # A Q5 up beside a Q4 gate: two planes, the gate's second one zero.
        assert gate_up.num_planes == (2 if types[blk + "ffn_up.weight"].startswith("Q5")
                                      or types[blk + "ffn_gate.weight"].startswith("Q5") else 1)
        assert isinstance(linears[f"layers.{i}.self_attn.o_proj"].packed, PackedInt4Weight)
    # Q6_K down_proj (all int8, groups of 16) in the layers llama.cpp gives more bits.
    assert linears["layers.5.mlp.down_proj"].packed.group == 16
    if variant == "q4_k_m_wide":
        assert linears["layers.5.self_attn.qkv_proj"].packed.parts[1].group == 16   # Q6_K v (q and k stacked in part 0)
    else:
        assert linears["layers.5.self_attn.qkv_proj"].packed.parts[1].group == 32   # Q8_0 v
    assert isinstance(packed.embed_tokens, PackedEmbedding)
    assert isinstance(packed.embed_tokens.packed, PackedInt8Weight)
    assert packed.lm_head_packed is packed.embed_tokens.packed
    ids = torch.tensor([1, 5, 300, 49151])
    assert torch.equal(packed.embed_tokens(ids), plain.embed_tokens(ids))
    # Each packed module is the float path's weight (in the module's row order, Q/K rows
    # un-permuted like the float weight's).
    plain_linears = {name: m for name, m in plain.named_modules() if isinstance(m, Linear)}
    for name in ("layers.5.self_attn.qkv_proj", "layers.6.self_attn.qkv_proj",
                 "layers.3.mlp.gate_up_proj", "layers.4.mlp.down_proj",
                 "layers.5.mlp.down_proj", "layers.7.self_attn.o_proj"):
        torch.testing.assert_close(linears[name].packed.dequantize(), plain_linears[name].weight,
                                   rtol=1e-6, atol=1e-7, msg=name)
    float_bytes = sum(p.numel() * p.element_size() for p in packed.parameters())
    packed_bytes = sum(b.numel() * b.element_size() for b in packed.buffers())
    plain_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    # Q5_0 / Q5_1 are two planes (12 bits a weight with their scales), Q4_K one (6 bits),
    # int8 9 to 10 bits: a third of the float32 model (the fallback file), or below.
    assert float_bytes + packed_bytes < 0.35 * plain_bytes


def test_prefill_logits_match_the_float_path(kquant_models) -> None:
    """A short prompt's prefill (the packed kernels' few-rows path) within 1e-4 of the float
    path's logits, the same argmax everywhere."""
    _, _, packed, plain = kquant_models
    ids = torch.tensor([1, 504, 3120, 314, 2744, 28, 6394, 30])
    a, b = prefill_logits(packed, ids), prefill_logits(plain, ids)
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_perplexity_matches_the_float_path(kquant_models) -> None:
    """Perplexity of the first 384 tokens of CPython's LICENSE.txt, in chunks of 32 tokens
    (each chunk through the packed kernels, not through the float32 tiles a whole prefill
    takes, which give the float path's logits bit for bit): within 5 % of the float path (the
    issue's Q4 bar), and a working model: below 3 times the source Q4_1 file's float
    perplexity."""
    variant, _, packed, plain = kquant_models
    ids = license_ids(384)
    q, f = perplexity(packed, ids, chunk=32), perplexity(plain, ids, chunk=32)
    print(f"{variant}: perplexity {q:.4f} packed, {f:.4f} float")
    assert abs(q / f - 1) < 0.05, (q, f)
    assert 1.5 < f < 3 * SOURCE_PERPLEXITY, f


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_answers_match_the_float_path(variant: str, kquant_files) -> None:
    """Through the whole engine (LLM.chat on the file): the first 16 greedy tokens of the 15
    chat prompts equal the dequantized float path's on at least 13 (the issue's bar)."""
    from folio import LLM, SamplingParams
    path, _ = kquant_files(variant)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    chats = [[{"role": "user", "content": text}] for text in CHAT_PROMPTS]
    answers = {}
    for quantization in ("none", "gguf"):
        llm = LLM(model=path, quantization=quantization, max_model_len=512, device="cpu")
        try:
            assert llm.llm_engine.engine_core.executor.worker.quantization == quantization
            answers[quantization] = [o.outputs[0].token_ids
                                     for o in llm.chat(chats, params, use_tqdm=False)]
        finally:
            llm.llm_engine.shutdown()
    same = sum(a == b for a, b in zip(answers["none"], answers["gguf"]))
    print(f"{variant}: {same} of {len(CHAT_PROMPTS)} greedy answers equal the float path's")
    assert same >= 13, f"{same} of {len(CHAT_PROMPTS)}"


# --------------------------------------------------------------------------- #
# The GPU layout (folio.model.quant.gguf_gpu), built here on CPU tensors
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("variant", ["q4_k_m", "q4_k_m_wide"])
def test_gpu_layout_is_the_files_weights(variant: str, kquant_files) -> None:
    """What a CUDA model keeps of the file, built on CPU tensors: every projection whose form
    the GPU kernel reads (one 4-bit plane: Q4_0/Q4_1/Q4_K; int8 rows: Q8_0/Q6_K) becomes a
    GroupQuantLinear (a PackedConcat where a qkv mixes Q4_K and Q6_K), and its weights are
    exactly the file's (4-bit codes with float32 scales and minimums, int8 codes with float32
    group scales); Q5's two planes, the embedding and the lm_head are left to the float path.
    The Triton kernel's arithmetic on these forms is tests/model/test_quant_kernels.py's, the
    GPU run tests/gpu/test_gpu_quant.py's."""
    from folio.model.gguf_loader import read_gguf
    from folio.model.quant import gguf_install
    from folio.model.quant.gguf_gpu import install_packed_gpu
    from folio.model.quant.gguf_planes import PlaneSum
    from folio.model.quant.group_linear import GroupQuantLinear
    from folio.model.quant.packed import PackedConcat
    path, types = kquant_files(variant)
    packed, plain = load_pair(path)   # the CPU's packed model, and the float one
    ckpt = read_gguf(path, keep_quantized=True)
    plan, consumed = gguf_install.plan_packed(packed, ckpt.quantized, gpu=True)
    assert "embed_tokens" not in plan and "lm_head" not in plan
    for shards in plan.values():
        assert all(not isinstance(q, PlaneSum) or len(q.planes) == 1 for q in shards)
    has_two_planes = any(t in ("Q5_K", "Q5_0", "Q5_1") for t in types.values())
    cpu_plan, _ = gguf_install.plan_packed(packed, ckpt.quantized)
    assert (len(plan) < len(cpu_plan) - 1) == has_two_planes   # -1: the embedding
    install_packed_gpu(plain, plan, torch.device("cpu"))
    kinds = set()
    for name in plan:
        module = plain.get_submodule(name).packed
        kinds.add(type(module).__name__)
        parts = module.parts if isinstance(module, PackedConcat) else [module]
        assert all(isinstance(p, GroupQuantLinear) for p in parts)
        # the CPU packed model holds the file's weights exactly: the GPU forms must equal them
        want = packed.get_submodule(name).packed.dequantize()
        got = module.dequantize()
        assert torch.allclose(got, want, rtol=0, atol=1e-6 * float(want.abs().max())), name
    assert "GroupQuantLinear" in kinds
    if variant == "q4_k_m_wide":
        assert "PackedConcat" in kinds   # Q4_K q/k with a Q6_K v
