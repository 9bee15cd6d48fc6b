"""Step messages on the wire: msgpack through msgspec, one encoder and a typed decoder per
message, shared by the multiprocess executor and the in-process round-trip check."""
from __future__ import annotations

from typing import Any

import msgspec

from folio.core.step_messages import GrammarBitmask, ModelRunnerOutput, SchedulerOutput

_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
_bitmask_decoder = msgspec.msgpack.Decoder(GrammarBitmask)
_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


def decode_step(data: bytes) -> SchedulerOutput:
    return _step_decoder.decode(data)


def decode_bitmask(data: bytes) -> GrammarBitmask:
    return _bitmask_decoder.decode(data)


def decode_output(data: bytes) -> ModelRunnerOutput:
    return _output_decoder.decode(data)


def round_trip(message: Any, decode) -> Any:
    """The message as a process on the other side would get it, checked equal to the original
    (a field that does not survive msgpack — a set, a tuple, an object — fails here)."""
    copy = decode(encode(message))
    if copy != message:
        raise AssertionError(f"{type(message).__name__} does not survive msgpack unchanged:\n"
                             f"sent     {message!r}\nreceived {copy!r}")
    return copy


def msgspec_decode(data: bytes, type_: type) -> Any:
    """Any other struct of the worker protocol (its start-up report)."""
    return msgspec.msgpack.decode(data, type=type_)
