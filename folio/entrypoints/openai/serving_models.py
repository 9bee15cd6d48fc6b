"""The models the server serves (vLLM's OpenAIServingModels): the base model under its
served names and the LoRA adapters on top of it. It says what a request's `model` runs (a
base name, a loaded adapter, or one the --lora-resolver-dir holds), lists them for
/v1/models, and loads and unloads adapters at run time (/v1/load_lora_adapter,
/v1/unload_lora_adapter).

Adapters are checked by the engine's front end (`engine.preparer.lora.check`: the directory
is a PEFT adapter that fits the model and --max-lora-rank) before they are listed, so a
request never reaches the engine with an adapter that cannot load."""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from folio.config import LoRAConfig
from folio.entrypoints.openai.errors import OpenAIError
from folio.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from folio.entrypoints.openai.request_params import model_not_found
from folio.lora.request import LoRARequest
from folio.model.lora.adapter_files import CONFIG_FILE, path_inside

logger = logging.getLogger("folio.server")

T = TypeVar("T")

OWNED_BY = "folio"
# The longest adapter name the resolver looks up on disk (a file name's limit on most
# file systems; longer ones cannot name a directory there anyway).
_MAX_RESOLVED_NAME_CHARS = 255


@dataclass(frozen=True)
class _Adapter:
    request: LoRARequest
    created: int  # when it was loaded: its /v1/models card's `created`


def _permission() -> dict[str, Any]:
    """vLLM's ModelPermission, as every card of its /v1/models carries one."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
            "created": int(time.time()), "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False}


def _bad_request(message: str, type: str = "BadRequestError") -> OpenAIError:
    # vLLM's LoRA routes give the HTTP status as the error's code.
    return OpenAIError(message, status_code=400, type=type, code=400)


def _not_found(message: str) -> OpenAIError:
    return OpenAIError(message, status_code=404, type="NotFoundError", code=404)


def resolvable_name(name: str) -> bool:
    """Whether `name` may be looked up as <--lora-resolver-dir>/<name>: one plain path
    component, so a request cannot make the server read outside that directory."""
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return (0 < len(name) <= _MAX_RESOLVED_NAME_CHARS and ".." not in name
            and name != "." and "\x00" not in name
            and not any(sep in name for sep in separators))


class OpenAIServingModels:
    """The base model's names and the adapters, name -> LoRARequest.

    The server assigns the adapters' ids (a fresh one per load, never reused): the engine
    keys its adapter caches and prefix-cache blocks by id, so a name unloaded and loaded
    again, maybe from new files, must not find the old adapter's weights or blocks.
    """

    def __init__(self, engine: Any, served_model_names: Sequence[str], *,
                 created: int | None = None) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.engine = engine
        self.base_model_names = list(served_model_names)
        self.created = int(time.time()) if created is None else created
        # None when LoRA is off (stand-in engines in tests have no config either).
        self.lora_config: LoRAConfig | None = getattr(getattr(engine, "config", None),
                                                      "lora", None)
        self._adapters: dict[str, _Adapter] = {}  # in load order: /v1/models lists them so
        self._ids = itertools.count(1)
        # One load or unload at a time: a name found free stays free while the adapter's
        # files are read (off the event loop), and an unload cannot interleave with it.
        self._lock = asyncio.Lock()

    # ---- what a request's `model` runs ----------------------------------------------------

    @property
    def runtime_updating(self) -> bool:
        return self.lora_config is not None and self.lora_config.allow_runtime_lora_updating

    def adapter(self, name: str) -> LoRARequest | None:
        entry = self._adapters.get(name)
        return None if entry is None else entry.request

    async def resolve(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The model name a response carries and the adapter to run (None: the base
        model); vLLM's 404 body for a name that is neither."""
        if not requested:
            return self.base_model_names[0], None
        if requested in self.base_model_names:
            return requested, None
        lora = self.adapter(requested)
        if lora is None and self.lora_config is not None and self.lora_config.lora_resolver_dir:
            lora = await self._resolve_from_dir(requested, self.lora_config.lora_resolver_dir)
        if lora is None:
            raise model_not_found(requested)
        return requested, lora

    async def _resolve_from_dir(self, name: str, root: str) -> LoRARequest | None:
        """vLLM's filesystem resolver: <root>/<name>, when it is an adapter directory, is
        loaded under `name`; None when there is none (the caller's 404)."""
        if not resolvable_name(name):
            return None
        path = os.path.join(root, name)
        # Looked at before taking the lock: requests naming nothing pass without waiting
        # behind a load.
        if not await self._run_blocking(os.path.isfile, os.path.join(path, CONFIG_FILE)):
            return None
        async with self._lock:
            lora = self.adapter(name)  # loaded while this request waited for the lock
            if lora is not None:
                return lora
            lora = self._new_request(name, path)
            try:
                await self._run_blocking(self.engine.preparer.lora.check, lora)
            except ValueError as exc:
                raise OpenAIError(f"LoRA adapter '{name}' was found but could not be loaded: "
                                  f"{exc}", status_code=400, type="BadRequestError",
                                  param="model", code=400) from exc
            self._register(lora)
        logger.info("LoRA adapter '%s' loaded from the resolver directory (%s)", name, path)
        return lora

    # ---- /v1/models ---------------------------------------------------------------------

    def model_cards(self) -> list[dict[str, Any]]:
        """vLLM's ModelCards: the base model's names, then each adapter (parent: the base
        model)."""
        info = self.engine.model_info
        max_model_len = self.engine.max_model_len
        cards = [{"id": name, "object": "model", "created": self.created, "owned_by": OWNED_BY,
                  "root": info.source.path, "parent": None, "max_model_len": max_model_len,
                  "permission": [_permission()]}
                 for name in self.base_model_names]
        for name, entry in self._adapters.items():
            lora = entry.request
            cards.append({"id": name, "object": "model", "created": entry.created,
                          "owned_by": OWNED_BY, "root": lora.lora_path,
                          "parent": lora.base_model_name or self.base_model_names[0],
                          "max_model_len": max_model_len, "permission": [_permission()]})
        return cards

    # ---- --lora-modules -----------------------------------------------------------------

    def add_static_adapters(self) -> None:
        """The --lora-modules adapters, each checked before the server starts: a bad one
        fails the start with a ValueError naming the entry and the problem. Called before
        the event loop runs, so the files are read here directly."""
        if self.lora_config is None:
            return
        for name, path in self.lora_config.lora_modules:
            try:
                self._check_name_free(name)
                lora = self._new_request(name, path)
                self.engine.preparer.lora.check(lora)  # names a missing directory too
            except (OpenAIError, ValueError) as exc:
                raise ValueError(f"--lora-modules {name}={path}: {exc}") from None
            self._register(lora)
            logger.info("LoRA adapter '%s' served from %s", name, path)

    # ---- /v1/load_lora_adapter, /v1/unload_lora_adapter ---------------------------------

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        """Check and register an adapter; vLLM's success text, or an OpenAIError (400 for a
        bad request or adapter, 404 for a path that does not exist)."""
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise _bad_request("Both 'lora_name' and 'lora_path' must be provided.",
                               type="InvalidUserInput")
        async with self._lock:
            self._check_name_free(name)
            self._check_allowed(path)
            if not await self._run_blocking(os.path.exists, path):
                # vLLM's message for it (clients match on "No adapter found").
                raise _not_found(f"Loading lora {name} failed: No adapter found for {path}")
            lora = self._new_request(name, path)
            try:
                await self._run_blocking(self.engine.preparer.lora.check, lora)
            except ValueError as exc:
                raise _bad_request(str(exc)) from exc
            self._register(lora)
        logger.info("LoRA adapter '%s' loaded from %s", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        """Drop an adapter: new requests naming it get the 404; those already running with
        it finish (they hold its LoRARequest, and the engine its weights), then the engine
        frees its copies in host and device memory (AsyncLLM.remove_lora)."""
        name = body.lora_name
        if not name:
            raise _bad_request("'lora_name' needs to be provided to unload a LoRA adapter.",
                               type="InvalidUserInput")
        async with self._lock:
            entry = self._adapters.pop(name, None)
            if entry is None:
                raise _not_found(f"The lora adapter '{name}' cannot be found.")
            # Its checked-files record goes too (the files may change before a reload, which
            # gets a fresh id anyway), and the worker's copies once no request uses them.
            await self.engine.remove_lora(entry.request.lora_int_id)
        logger.info("LoRA adapter '%s' unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    # ---- helpers ------------------------------------------------------------------------

    def _check_name_free(self, name: str) -> None:
        # The base model's names are taken too: an adapter under one would be unreachable.
        if name in self._adapters or name in self.base_model_names:
            raise _bad_request(f"The lora adapter '{name}' has already been loaded.",
                               type="InvalidUserInput")

    def _check_allowed(self, path: str) -> None:
        """A client may load only what the operator put under an --allowed-lora-dir (links
        resolved): the path is otherwise any directory the server can read."""
        allowed = self.lora_config.allowed_lora_dirs if self.lora_config else []
        if not allowed:
            raise _bad_request(f"LoRA adapter path {path!r} refused: the server loads adapters "
                               "at run time only from inside an --allowed-lora-dir, and none "
                               "was given")
        if not path_inside(path, allowed):
            raise _bad_request(f"LoRA adapter path {path!r} is outside every --allowed-lora-dir")

    def _new_request(self, name: str, path: str) -> LoRARequest:
        return LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path)

    def _register(self, lora: LoRARequest) -> None:
        self._adapters[lora.lora_name] = _Adapter(lora, int(time.time()))

    async def _run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """File-system work off the event loop (an adapter's header can be megabytes, a
        network file system slow)."""
        runner = getattr(self.engine, "run_blocking", None)
        if runner is None:  # stand-in engines in tests
            return fn(*args)
        return await runner(fn, *args)
