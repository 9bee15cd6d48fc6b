"""The wire between the front end and the engine-core process: ZMQ multipart frames
[kind, msgpack payload], encoded with msgspec into the engine's own dataclasses."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from folio.core.engine_core_outputs import EngineCoreOutput, SchedulerStats
from folio.core.request import EngineCoreRequest

# Front end -> engine core.
ADD = b"ADD"            # EngineCoreRequest
ABORT = b"ABORT"        # list[str]: child request ids to abort
FINISH = b"FINISH"      # list[str]: child ids a stop string finished
UTILITY = b"UTIL"       # UtilityCall
SHUTDOWN = b"SHUTDOWN"  # empty

# Engine core -> front end.
READY = b"READY"        # ReadyInfo
OUTPUTS = b"OUT"        # StepOutputs
UTILITY_RESULT = b"URES"  # UtilityResult
FATAL = b"FATAL"        # str (fatal_detail): the engine core is going down

# A FATAL detail that is a bad setting or model (a ValueError in the engine core) starts with
# this, so the front end raises it as one (start_error): the CLI prints it as a usage error.
_SETTING_ERROR = "ValueError: "


def fatal_detail(exc: BaseException) -> str:
    """The FATAL payload for an exception in the engine core."""
    return f"{type(exc).__name__}: {exc}"


def start_error(detail: str) -> Exception:
    """The exception a front end raises for a FATAL detail received during start-up: a
    ValueError (its message without the type) for a bad setting, else a RuntimeError."""
    if detail.startswith(_SETTING_ERROR):
        return ValueError(detail[len(_SETTING_ERROR):])
    return RuntimeError(f"the engine core failed to start: {detail}")


@dataclass
class ReadyInfo:
    num_blocks: int
    block_size: int
    max_model_len: int
    pid: int
    # The engine core's (it resolves the device, and so this default, with device "auto").
    max_num_seqs: int
    # Tokens the KV cache surely holds (its groups counted: KVCacheLayout.token_capacity).
    kv_capacity_tokens: int


@dataclass
class StepOutputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


@dataclass
class UtilityCall:
    call_id: int
    method: str               # one of EngineCore's utility methods (see core_proc.UTILITY_METHODS)
    args: list[Any] = field(default_factory=list)


@dataclass
class UtilityResult:
    call_id: int
    result: Any = None
    error: str | None = None


_encoder = msgspec.msgpack.Encoder()
_decoders = {
    ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    ABORT: msgspec.msgpack.Decoder(list[str]),
    FINISH: msgspec.msgpack.Decoder(list[str]),
    UTILITY: msgspec.msgpack.Decoder(UtilityCall),
    SHUTDOWN: msgspec.msgpack.Decoder(Any),
    READY: msgspec.msgpack.Decoder(ReadyInfo),
    OUTPUTS: msgspec.msgpack.Decoder(StepOutputs),
    UTILITY_RESULT: msgspec.msgpack.Decoder(UtilityResult),
    FATAL: msgspec.msgpack.Decoder(str),
}


def encode(kind: bytes, payload: Any) -> list[bytes]:
    return [kind, _encoder.encode(payload)]


def decode(frames: list[bytes]) -> tuple[bytes, Any]:
    kind, payload = frames
    decoder = _decoders.get(kind)
    if decoder is None:
        raise ValueError(f"unknown message kind {kind!r}")
    return kind, decoder.decode(payload)
