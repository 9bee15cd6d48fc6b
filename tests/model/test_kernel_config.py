"""Kernel and attention choices are resolved once, into a KernelConfig, when the model is built.

FOLIO_KERNELS / FOLIO_ATTENTION / FOLIO_GEMV are overrides of KernelConfig's defaults, read by
`resolve_kernel_config` (load_model calls it when given no config); every layer keeps the
config it was built with, and no code under folio/model reads the environment anywhere else
(checked on the sources with ast), so nothing that runs per forward pass can.
"""
from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from folio.model.kernel_config import (DEFAULT_KERNEL_CONFIG, SPECULATIVE_GEMV, KernelConfig,
                                       resolve_kernel_config)

ENV_VARS = ("FOLIO_KERNELS", "FOLIO_ATTENTION", "FOLIO_GEMV", "FOLIO_PDL", "FOLIO_LORA",
            "FOLIO_DENSE_PREFILL", "FOLIO_CPU_LAYER", "FOLIO_KV_WRITE", "FOLIO_GEMV_NORM")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_defaults() -> None:
    cfg = resolve_kernel_config({})
    assert cfg == KernelConfig() == DEFAULT_KERNEL_CONFIG
    assert (cfg.kernels, cfg.attention, cfg.gemv, cfg.pdl) == ("triton", "triton", "1", "1")
    assert cfg.fused_kernels and cfg.triton_attention and cfg.gemv_on and cfg.pdl_on


@pytest.mark.parametrize("var,value,field", [
    ("FOLIO_KERNELS", "torch", "kernels"), ("FOLIO_KERNELS", "triton", "kernels"),
    ("FOLIO_ATTENTION", "torch", "attention"),
    ("FOLIO_GEMV", "0", "gemv"), ("FOLIO_GEMV", "narrow", "gemv"), ("FOLIO_GEMV", "all", "gemv"),
    ("FOLIO_PDL", "0", "pdl"), ("FOLIO_CPU_LAYER", "0", "cpu_layer"),
    ("FOLIO_KV_WRITE", "separate", "kv_write"), ("FOLIO_GEMV_NORM", "1", "gemv_norm"),
])
def test_env_overrides_one_field(var: str, value: str, field: str) -> None:
    cfg = resolve_kernel_config({var: value})
    assert getattr(cfg, field) == value
    others = {f: getattr(DEFAULT_KERNEL_CONFIG, f)
              for f in ("kernels", "attention", "gemv", "pdl", "cpu_layer", "kv_write",
                        "gemv_norm") if f != field}
    assert all(getattr(cfg, f) == v for f, v in others.items())


def test_reads_os_environ_by_default(clean_env: pytest.MonkeyPatch) -> None:
    assert resolve_kernel_config() == DEFAULT_KERNEL_CONFIG
    clean_env.setenv("FOLIO_KERNELS", "torch")
    clean_env.setenv("FOLIO_ATTENTION", "torch")
    clean_env.setenv("FOLIO_GEMV", "narrow")
    assert resolve_kernel_config() == KernelConfig("torch", "torch", "narrow")


def test_torch_kernels_turn_the_gemv_off() -> None:
    # As before: FOLIO_KERNELS=torch kept cuBLAS whatever FOLIO_GEMV said.
    assert not resolve_kernel_config({"FOLIO_KERNELS": "torch", "FOLIO_GEMV": "all"}).gemv_on
    assert not resolve_kernel_config({"FOLIO_GEMV": "0"}).gemv_on
    assert resolve_kernel_config({"FOLIO_GEMV": "narrow"}).gemv_on
    # ... and it never switched attention.
    assert resolve_kernel_config({"FOLIO_KERNELS": "torch"}).triton_attention
    # PDL belongs to the Triton kernels: off with them, or on its own.
    assert not resolve_kernel_config({"FOLIO_KERNELS": "torch"}).pdl_on
    assert not resolve_kernel_config({"FOLIO_PDL": "0"}).pdl_on
    # The cache write in the rotary's launch is a fused kernel's too.
    assert resolve_kernel_config({}).kv_write_in_rotary
    assert not resolve_kernel_config({"FOLIO_KERNELS": "torch"}).kv_write_in_rotary
    assert not resolve_kernel_config({"FOLIO_KV_WRITE": "separate"}).kv_write_in_rotary
    # The norm epilogue is off unless asked for (it measured slower), and belongs to the
    # skinny GEMV: off with it whatever FOLIO_GEMV_NORM says.
    assert not resolve_kernel_config({}).gemv_norm_on
    assert resolve_kernel_config({"FOLIO_GEMV_NORM": "1"}).gemv_norm_on
    assert not resolve_kernel_config({"FOLIO_GEMV": "0", "FOLIO_GEMV_NORM": "1"}).gemv_norm_on
    assert not resolve_kernel_config({"FOLIO_GEMV_NORM": "0"}).gemv_norm_on


@pytest.mark.parametrize("var", ENV_VARS)
@pytest.mark.parametrize("value", ["", "eager", "Triton", "2", " 1"])
def test_unknown_value_names_the_variable(var: str, value: str) -> None:
    with pytest.raises(ValueError, match=var):
        resolve_kernel_config({var: value})


def test_hand_built_config_is_validated() -> None:
    with pytest.raises(ValueError, match="gemv"):
        KernelConfig(gemv="yes")
    with pytest.raises(ValueError, match="attention"):
        KernelConfig(attention="flash")
    with pytest.raises(Exception):  # frozen: a live model's choice cannot be flipped in place
        DEFAULT_KERNEL_CONFIG.gemv = "0"  # type: ignore[misc]


def test_selector_follows_the_config() -> None:
    from folio.model.attention import get_attention_backend
    from folio.model.attention.cpu_backend import CpuPagedAttention
    from folio.model.attention.torch_paged import TorchPagedAttention
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # The CPU gets folio's C++ kernel (the suite's machines have a C++ compiler; the packed
    # GGUF path needs one too) unless the config asks for torch.
    assert isinstance(get_attention_backend(cpu), CpuPagedAttention)
    assert isinstance(get_attention_backend(cpu, KernelConfig(attention="torch")),
                      TorchPagedAttention)
    assert isinstance(get_attention_backend(cuda, KernelConfig(attention="torch")),
                      TorchPagedAttention)
    pytest.importorskip("triton")
    from folio.model.attention.triton_backend import TritonPagedAttention
    assert isinstance(get_attention_backend(cuda, KernelConfig()), TritonPagedAttention)
    assert get_attention_backend(cuda, KernelConfig()).pdl
    assert not get_attention_backend(cuda, KernelConfig(pdl="0")).pdl


def _kernels_of(model: torch.nn.Module) -> dict[str, KernelConfig]:
    return {name: m.kernels for name, m in model.named_modules() if hasattr(m, "kernels")}


def test_load_model_resolves_once_and_threads_it_down(clean_env: pytest.MonkeyPatch,
                                                      tiny_model_dir) -> None:
    from folio.model.discovery import ModelSource, load_hf_config
    from folio.model.layers import GatedMLP, Linear, MergedLinear, RMSNorm, RotaryEmbedding
    from folio.model.loader import load_model
    source = ModelSource("hf_dir", tiny_model_dir("qwen3"))
    hf_config, _ = load_hf_config(source)
    cpu = torch.device("cpu")

    clean_env.setenv("FOLIO_KERNELS", "torch")
    clean_env.setenv("FOLIO_GEMV", "narrow")
    model, _ = load_model(source, hf_config, torch.float32, cpu, 64)
    expected = KernelConfig(kernels="torch", gemv="narrow")
    assert model.kernel_config == expected
    # Every projection, norm, MLP and rotary table (rebuilt after loading) got the decision.
    layers = [m for m in model.modules()
              if isinstance(m, (Linear, RMSNorm, RotaryEmbedding, GatedMLP))]
    assert {type(m) for m in layers} >= {Linear, MergedLinear, RMSNorm, RotaryEmbedding, GatedMLP}
    assert all(m.kernels == expected for m in layers)
    assert set(_kernels_of(model).values()) == {expected}

    # Changing the environment afterwards does not reach the built model.
    clean_env.setenv("FOLIO_KERNELS", "triton")
    assert set(_kernels_of(model).values()) == {expected}

    # An explicit config wins over the environment; a bad value fails the load up front.
    explicit = KernelConfig(attention="torch", gemv="0")
    model, _ = load_model(source, hf_config, torch.float32, cpu, 64, kernel_config=explicit)
    assert model.kernel_config == explicit and set(_kernels_of(model).values()) == {explicit}
    clean_env.setenv("FOLIO_GEMV", "yes")
    with pytest.raises(ValueError, match="FOLIO_GEMV"):
        load_model(source, hf_config, torch.float32, cpu, 64)


# ---- no environment reads in folio/model outside the resolver -----------------------------

MODEL_DIR = Path(__file__).resolve().parents[2] / "folio" / "model"
ALLOWED = {
    # The one place the FOLIO_* kernel overrides are read.
    "kernel_config.py",
    # TRITON_INTERPRET is Triton's own switch and must be read at import, before the kernels
    # are decorated (the interpreter gets a single autotune config).
    "kernels/_common.py",
    # $FOLIO_CACHE_DIR: where converted checkpoints and GGUF tokenizers are cached. Start-up,
    # front end (model discovery), never forward code.
    "cache_dir.py",
}


def _environment_reads(tree: ast.AST) -> list[int]:
    """Line numbers of os.environ / os.getenv / os.putenv uses, and of importing them by name
    (`from os import environ`), which would hide the later reads from a plain attribute
    check."""
    names = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(alias.name in names for alias in node.names):
            lines.append(node.lineno)
    return lines


def test_no_environment_reads_in_model_code() -> None:
    sources = sorted(MODEL_DIR.rglob("*.py"))
    assert sources
    offenders = {}
    for path in sources:
        rel = path.relative_to(MODEL_DIR).as_posix()
        lines = _environment_reads(ast.parse(path.read_text(), filename=str(path)))
        if lines and rel not in ALLOWED:
            offenders[rel] = lines
    assert not offenders, (f"os.environ read in folio/model outside {sorted(ALLOWED)}: "
                           f"{offenders}; resolve it in folio/model/kernel_config.py instead")
    for rel in ALLOWED:  # keep the allow-list honest
        assert (MODEL_DIR / rel).is_file(), rel
    assert _environment_reads(ast.parse((MODEL_DIR / "kernel_config.py").read_text()))


def test_the_checker_sees_reads() -> None:
    for snippet in ("import os\nos.environ.get('X')", "import os\nos.getenv('X')",
                    "from os import environ\nenviron['X']", "import os\nx = os.environ"):
        assert _environment_reads(ast.parse(snippet)), snippet
    assert not _environment_reads(ast.parse("import os\nos.path.join('a')"))


def test_speculative_decoding_defaults_the_gemv_to_every_row_count() -> None:
    # A batch-1 verify step is k + 1 <= 8 rows: the skinny GEMV serves them by default ...
    cfg = resolve_kernel_config({}, speculative=True)
    assert cfg.gemv == SPECULATIVE_GEMV == "all"
    assert cfg == replace(DEFAULT_KERNEL_CONFIG, gemv="all")
    # ... and FOLIO_GEMV still decides when set.
    assert resolve_kernel_config({"FOLIO_GEMV": "1"}, speculative=True).gemv == "1"
    assert not resolve_kernel_config({"FOLIO_GEMV": "0"}, speculative=True).gemv_on
    assert resolve_kernel_config({}, speculative=False) == DEFAULT_KERNEL_CONFIG
