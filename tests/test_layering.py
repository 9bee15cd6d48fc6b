"""Imports point down only: the layer rules of docs/architecture.md ("Layers and imports").

Every import statement in folio/ is read with `ast`: module-level and inside functions (lazy
imports count: they run too), absolute and relative. Each module belongs to a layer
(LAYER_OF, longest prefix wins) and a layer may import only itself and the layers MAY_IMPORT
names. The torch-free layers import neither torch nor triton. No import cycles either.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "folio"

# Where each module belongs: the longest matching prefix wins.
LAYER_OF = {
    "folio": "facade",                      # folio/__init__.py: the public names
    "folio.entrypoints": "entrypoints",     # LLM, the CLI, the OpenAI server
    "folio.bench": "bench",                 # `folio bench ...`: measures the layers below
    "folio.engine": "engine",
    "folio.metrics": "metrics",             # used by the engine's front end and the server
    "folio.executor": "executor",
    "folio.worker": "worker",
    # Grammar compile and match (used by the engine core and the front end's validation) and
    # the bitmask applied to the logits (used by the worker, through a model kernel).
    "folio.structured_output": "structured_output",
    "folio.model": "model",
    # What and where the model is, without weights: the front end's part of folio.model.
    "folio.model.discovery": "model_info",
    "folio.model.config_snapshot": "model_info",   # the config as JSON, read without torch
    "folio.model.families": "model_info",
    "folio.model.default_model": "model_info",
    "folio.model.cache_dir": "model_info",
    "folio.model.gguf_metadata": "model_info",
    "folio.model.gguf_reader": "model_info",   # the GGUF container, parsed with struct
    "folio.model.quant.scheme": "model_info",
    "folio.model.pooling_info": "model_info",
    "folio.model.lora": "model_info",               # the package's docstring only
    "folio.model.lora.adapter_files": "model_info", # a PEFT directory read without torch
    "folio.model.lora.weights": "model",
    "folio.model.lora.projection": "model",
    "folio.core": "core",                   # scheduler, KV cache manager, requests
    "folio.multimodal": "multimodal",       # media fetched and decoded for requests
    # The data types every layer shares.
    "folio.config": "shared",
    "folio.sampling_params": "shared",
    "folio.pooling_params": "shared",
    "folio.lora": "shared",                 # LoRARequest (vLLM's vllm.lora.request path)
    "folio.request_outputs": "shared",
    "folio.reasoning": "shared",
    "folio.structured_output.params": "shared",
}

# What each layer may import besides itself.
MAY_IMPORT = {
    "facade": {"shared"},  # the heavier public names resolve lazily, by name (folio._LAZY)
    "entrypoints": {"facade", "bench", "engine", "metrics", "structured_output", "model_info",
                    "multimodal", "core", "shared"},
    # At the entrypoints' level (the CLI registers its commands, it shares their help format),
    # and it reports what the layers below measure (the worker's start-up stages, the model's
    # roofline), so it may read any of them.
    "bench": {"facade", "entrypoints", "engine", "executor", "worker", "model",
              "structured_output", "metrics", "model_info", "core", "shared"},
    "engine": {"executor", "structured_output", "metrics", "model_info", "multimodal", "core",
               "shared"},
    "metrics": {"core", "shared"},
    "executor": {"worker", "model_info", "core", "shared"},
    "worker": {"model", "structured_output", "model_info", "core", "shared"},
    "structured_output": {"model", "shared"},
    "model": {"model_info", "shared"},
    "model_info": {"shared"},
    "core": {"shared"},
    "multimodal": {"shared"},
    "shared": set(),
}

# Layers that never import torch: the core, and what the API process runs.
TORCH_FREE = {"facade", "metrics", "model_info", "multimodal", "core", "shared"}
TORCH_MODULES = ("torch", "triton", "safetensors.torch")

# Imports the table forbids that are allowed anyway, each only inside a function, and why.
EXCEPTIONS = {
    ("folio.model.default_model", "folio.model.gguf_loader"):
        "the one-time GGUF -> HF directory conversion of a first start needs the weights",
    ("folio.model.default_model", "safetensors.torch"):
        "the one-time GGUF -> HF directory conversion writes the weights",
}


@dataclass(frozen=True)
class Import:
    importer: str    # module name
    target: str      # module name (a folio module, or a third-party one as written)
    path: str        # file, relative to the repository
    line: int
    lazy: bool       # inside a function

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str | None:
    best = None
    for prefix in LAYER_OF:
        if (module == prefix or module.startswith(prefix + ".")) and \
                (best is None or len(prefix) > len(best)):
            best = prefix
    return LAYER_OF[best] if best is not None else None


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = str(path.relative_to(ROOT))
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(module, alias.name, rel, child.lineno, lazy))
            elif isinstance(child, ast.ImportFrom):
                base = _resolve_from(module, is_package, child)
                for alias in child.names:
                    # `from pkg import sub` imports the submodule pkg.sub.
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in MODULES else base
                    found.append(Import(module, target, rel, child.lineno, lazy))
            visit(child, inner)

    visit(tree, False)
    return list(dict.fromkeys(found))  # `from m import a, b` is one import of m


ALL_IMPORTS = [imp for module, path in MODULES.items() for imp in imports_of(module, path)]


def _is_torch(target: str) -> bool:
    return any(target == m or target.startswith(m + ".") for m in TORCH_MODULES)


def _violation(imp: Import) -> str | None:
    src = layer_of(imp.importer)
    if imp.target == "folio" or imp.target.startswith("folio."):
        dst = layer_of(imp.target)
        if dst == src or dst in MAY_IMPORT[src]:
            return None
        return (f"{imp.where()}: {imp.importer} ({src}) imports {imp.target} ({dst}); "
                f"{src} may import only {', '.join(sorted(MAY_IMPORT[src] | {src}))}")
    if src in TORCH_FREE and _is_torch(imp.target):
        return f"{imp.where()}: {imp.importer} ({src}, torch-free) imports {imp.target}"
    return None


def test_every_module_has_a_layer():
    assert set(MAY_IMPORT) == set(LAYER_OF.values())
    unplaced = [m for m in MODULES if layer_of(m) is None]
    assert not unplaced, f"modules outside every layer (add them to LAYER_OF): {unplaced}"


def test_imports_point_down():
    problems = []
    for imp in ALL_IMPORTS:
        problem = _violation(imp)
        if problem is None:
            continue
        reason = EXCEPTIONS.get((imp.importer, imp.target))
        if reason is not None and imp.lazy:
            continue
        problems.append(problem + (" (an allowed exception only inside a function)"
                                   if reason is not None else ""))
    assert not problems, "imports that point up or sideways:\n" + "\n".join(problems)


def test_exceptions_are_still_needed():
    used = {(imp.importer, imp.target) for imp in ALL_IMPORTS if _violation(imp) is not None}
    stale = set(EXCEPTIONS) - used
    assert not stale, f"EXCEPTIONS no longer needed (remove them): {sorted(stale)}"


def test_folio_imports_resolve():
    """A lazy import of a module that is not there fails only when it runs."""
    missing = [f"{imp.where()}: {imp.target}" for imp in ALL_IMPORTS
               if imp.target.startswith("folio.") and imp.target not in MODULES]
    assert not missing, "imports of folio modules that do not exist:\n" + "\n".join(missing)


def test_no_import_cycles():
    graph: dict[str, dict[str, Import]] = {m: {} for m in MODULES}
    for imp in ALL_IMPORTS:
        if imp.target in MODULES and imp.target != imp.importer:
            graph[imp.importer].setdefault(imp.target, imp)
    cycles = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                loop = path[path.index(nxt):] + [nxt]
                cycles.append(" -> ".join(
                    f"{a} ({graph[a][b].where()})" for a, b in zip(loop, loop[1:])) + f" -> {nxt}")
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module)
    assert not cycles, "import cycles (lazy imports included):\n" + "\n".join(cycles)


def test_the_engine_asks_the_executor_not_its_worker():
    """`executor.worker.<...>` from the engine reaches past the executor's interface (a
    multi-process executor has no one worker to reach)."""
    reaches = []
    for module, path in MODULES.items():
        if layer_of(module) != "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "worker" and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "executor":
                reaches.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not reaches, "the engine reaches into the executor's worker:\n" + "\n".join(reaches)


def test_the_rules_catch_an_upward_import():
    """The checker itself: an engine module importing the entrypoints, a model module importing
    the worker, and the core importing torch are all reported, with file:line."""
    fake = [Import("folio.engine.grammar_manager", "folio.entrypoints.openai.reasoning_parsers",
                   "folio/engine/grammar_manager.py", 7, True),
            Import("folio.model.decoder", "folio.worker.model_runner", "folio/model/decoder.py", 3,
                   False),
            Import("folio.core.scheduler", "torch", "folio/core/scheduler.py", 9, False),
            Import("folio.config", "folio.engine.frontend", "folio/config.py", 1, True)]
    messages = [_violation(imp) for imp in fake]
    assert all(messages), messages
    assert messages[0].startswith("folio/engine/grammar_manager.py:7: ")
    assert "(engine) imports folio.entrypoints.openai.reasoning_parsers (entrypoints)" in messages[0]
    assert "torch-free" in messages[2]
    ok = Import("folio.worker.worker", "folio.model.loader", "folio/worker/worker.py", 1, False)
    assert _violation(ok) is None
