"""The wire protocol between engine processes and their clients: typed msgpack, no pickle.

Sockets (addresses in the connection file, see `connection.py`):

- requests: the engine binds a ROUTER, each client connects a DEALER (one per client, owned by
  the client's IO thread). Every message is two frames, ``[HEADER, body]`` (the ROUTER adds the
  client's routing id in front). ``HEADER`` is ``b"WB"`` plus one byte of protocol version;
  ``body`` is one msgpack-encoded tagged struct from the unions below.
- events: the engine binds a PUB, clients connect a SUB. Every event is three frames,
  ``[kind, HEADER, body]`` (``kind`` first so SUB prefix filters work), body an `EventMsg`.

Client -> engine: `Call` (an RPC: ``configure``, ``metrics``, ``timeline`` ...), `Submit`
(new requests, validated as a batch), `Abort`, `Stop` (a stop string the client's output
processor found), `Ping` (heartbeat) and `Bye`.
Engine -> client: `Result` / `Failure` (answer a `Call` by ``call_id``), `Outputs` (each step's
new token ids per request, sent only to the requester: the client turns them into text),
`Rejected` (a `Submit` that failed validation), `Pong` and `ProtocolError` (a message that could
not be understood).

Errors keep their type: a ValueError raised in the engine travels as ``("ValueError", message)``
and is raised again as ValueError with the same message by the client (`error_from_wire`).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ..errors import (  # carried over the wire by name (error_to_wire / error_from_wire)
    EngineBusyError,
    EngineConnectError,
    EngineDeadError,
    EngineDrainingError,
    EngineError,
    EngineStartError,
    ProtocolMismatchError,
    WorkbenchIPCError,
)
from ..events import EVENT_KINDS, METRICS_EVERY_S, Event
from ..outputs import CoreOutput
from ..sampling_params import SamplingParams
from ..settings import DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MAX_QUEUED_CHARS, DEFAULT_MAX_QUEUED_TOKENS

PROTOCOL_VERSION = 2  # 2: outputs are token ids, detokenized by the client
MAGIC = b"WB"
HEADER = MAGIC + bytes([PROTOCOL_VERSION])
# Decoding a message holds the GIL (a 16 MiB list of token ids takes ~70 ms, every thread of the
# engine waiting), so the default stays at the HTTP front's body limit; larger batches: split them.
DEFAULT_MAX_MESSAGE_MB = 16
START_FAILED = "ENGINE START FAILED:"  # the log line start_engine quotes when the engine cannot start


# -- client -> engine ---------------------------------------------------------------------------
class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams | None = None
    chat: bool = False
    # False: the client wants only the final output (which carries every id); the engine still
    # sends each step's ids where the client's output processor needs them (stop strings, logprobs)
    stream: bool = True


class Call(msgspec.Struct, tag="call", array_like=True, omit_defaults=True):
    call_id: int
    method: str
    kwargs: dict[str, Any] = {}


class Submit(msgspec.Struct, tag="submit", array_like=True):
    requests: list[NewRequest]


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Stop(msgspec.Struct, tag="stop", array_like=True):
    """A stop string ended `request_id` within its first `keep` output tokens (the client found it;
    the engine may have run one step past it, whose tokens it drops)."""

    request_id: str
    keep: Annotated[int, msgspec.Meta(ge=0)]  # a negative count is refused as undecodable (ProtocolError)


class Ping(msgspec.Struct, tag="ping", array_like=True):
    pass


class Bye(msgspec.Struct, tag="bye", array_like=True):
    pass


ClientMessage = Call | Submit | Abort | Stop | Ping | Bye


# -- engine -> client ---------------------------------------------------------------------------
class ErrorInfo(msgspec.Struct, array_like=True):
    type: str
    message: str


class Result(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    value: msgspec.Raw  # msgpack of the return value; decoded by the caller with the right type


class Failure(msgspec.Struct, tag="failure", array_like=True):
    call_id: int
    error: ErrorInfo


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[CoreOutput]


class Rejected(msgspec.Struct, tag="rejected", array_like=True):
    request_ids: list[str]
    error: ErrorInfo


class Pong(msgspec.Struct, tag="pong", array_like=True):
    time: float = 0.0
    draining: bool = False  # the engine takes no new requests (it finishes what it accepted)


class ProtocolError(msgspec.Struct, tag="protocol_error", array_like=True):
    message: str


EngineMessage = Result | Failure | Outputs | Rejected | Pong | ProtocolError


# -- events (PUB) -------------------------------------------------------------------------------
class EventMsg(msgspec.Struct, array_like=True):
    kind: str  # "timeline" | "settings" | "relayout" | "metrics" | "engine" | "sync"
    time: float  # time.monotonic() in the engine
    data: msgspec.Raw


# -- codecs -------------------------------------------------------------------------------------
def _enc_hook(obj: Any) -> Any:
    # Values we do not know how to encode (a torch dtype in a status dict) travel as text.
    return str(obj)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_strict_encoder = msgspec.msgpack.Encoder()  # clients: an unencodable argument is a TypeError here
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)
_event_decoder = msgspec.msgpack.Decoder(EventMsg)
_any_decoder = msgspec.msgpack.Decoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def encode_strict(obj: Any) -> bytes:
    return _strict_encoder.encode(obj)


def encode_raw(obj: Any) -> msgspec.Raw:
    return msgspec.Raw(_encoder.encode(obj))


def encode_raw_in_pieces(obj: msgspec.Struct, piece: int = 256) -> msgspec.Raw:
    """`encode_raw(obj)`, byte for byte, for a struct whose fields hold long lists (a timeline of
    20,000 steps): encoded a few hundred items at a time, so another thread (the step loop) gets
    the GIL between pieces instead of waiting out one call of hundreds of milliseconds."""
    fields = [(name, getattr(obj, name)) for name in obj.__struct_fields__]
    if obj.__struct_config__.omit_defaults or obj.__struct_config__.array_like:
        return encode_raw(obj)  # the layout below is a plain map of every field
    out = bytearray(_container_header(len(fields), 0x80, 0xDE))
    for name, value in fields:
        out += _encoder.encode(name)
        if isinstance(value, list):
            out += _container_header(len(value), 0x90, 0xDC)
            for i in range(0, len(value), piece):
                part = value[i : i + piece]
                out += _encoder.encode(part)[len(_container_header(len(part), 0x90, 0xDC)) :]
        else:
            out += _encoder.encode(value)
    return msgspec.Raw(bytes(out))


def _container_header(n: int, fix: int, code16: int) -> bytes:
    """msgpack's shortest header of an array (fix 0x90, 0xDC) or map (fix 0x80, 0xDE) of n items."""
    if n < 16:
        return bytes([fix | n])
    if n < 1 << 16:
        return bytes([code16]) + n.to_bytes(2, "big")
    return bytes([code16 + 1]) + n.to_bytes(4, "big")


def decode_client_message(body: bytes) -> ClientMessage:
    return _client_decoder.decode(body)


def _submit_with_ids(ids_type: Any, default: Any) -> type:
    """`Submit` whose requests' prompt_token_ids decode as `ids_type` (still `Submit` and
    `NewRequest` instances)."""
    request = msgspec.defstruct(
        "NewRequest",
        [("prompt_token_ids", ids_type, default)],
        bases=(NewRequest,),
        array_like=True,
        omit_defaults=True,
    )
    return msgspec.defstruct("Submit", [("requests", list[request])], bases=(Submit,), tag="submit", array_like=True)


# the ids left undecoded (msgpack's nil where there are none)
_ids_unread_decoder = msgspec.msgpack.Decoder(_submit_with_ids(msgspec.Raw, msgspec.Raw(b"\xc0")))


def token_id_counts(body: bytes) -> list[int | None]:
    """How many prompt token ids each request of a submit carries (None: a text prompt), read from
    their arrays' headers without decoding a single id."""
    out: list[int | None] = []
    for r in _ids_unread_decoder.decode(body).requests:
        raw = bytes(r.prompt_token_ids)
        if raw[0] == 0xC0:  # nil: a text prompt
            out.append(None)
        elif 0x90 <= raw[0] <= 0x9F:  # fixarray
            out.append(raw[0] & 0x0F)
        else:  # array 16 (0xdc) or array 32 (0xdd)
            out.append(int.from_bytes(raw[1 : 3 if raw[0] == 0xDC else 5], "big"))
    return out


def client_decoder(max_prompt_tokens: int) -> msgspec.msgpack.Decoder:
    """A decoder of client messages that refuses a token-id prompt of more than
    `max_prompt_tokens` ids before decoding any (msgspec checks an array's length first): a
    fuzzer's 500k-id prompt then costs 0.02 ms instead of 19 ms and ~14 MB of Python ints whose
    heap stayed behind. Its messages are still `Submit` and `NewRequest` instances."""
    ids = Annotated[list[int], msgspec.Meta(max_length=max_prompt_tokens)]
    return msgspec.msgpack.Decoder(Call | _submit_with_ids(ids | None, None) | Abort | Stop | Ping | Bye)


def decode_engine_message(body: bytes) -> EngineMessage:
    return _engine_decoder.decode(body)


def decode_event(body: bytes) -> EventMsg:
    return _event_decoder.decode(body)


def decode_value(raw: bytes | msgspec.Raw, type: Any = Any) -> Any:
    if type is Any:
        return _any_decoder.decode(raw)
    return msgspec.msgpack.decode(raw, type=type)


def check_header(header: bytes) -> str | None:
    """None when the header is ours and of this version, else why not."""
    if header == HEADER:
        return None
    if len(header) == 3 and header[:2] == MAGIC:
        return (
            f"protocol version mismatch: this side speaks version {PROTOCOL_VERSION}, "
            f"the message has version {header[2]}; use the same workbench version on both sides"
        )
    return "not a workbench message (bad header frame)"


def guess_refs(body: bytes) -> tuple[int | None, list[str]]:
    """Best effort for a message that failed to decode: the call id or request ids it carries,
    so the error can be routed to whoever waits for them."""
    try:
        obj = _any_decoder.decode(body)
    except Exception:
        return None, []
    if not isinstance(obj, list) or len(obj) < 2:
        return None, []
    if obj[0] == "call" and isinstance(obj[1], int) and not isinstance(obj[1], bool):
        return obj[1], []
    if obj[0] == "submit" and isinstance(obj[1], list):
        ids = [r[0] for r in obj[1] if isinstance(r, list) and r and isinstance(r[0], str)]
        return None, ids[:1000]
    return None, []


# -- errors -------------------------------------------------------------------------------------
# Exceptions re-raised as their own type; anything else becomes EngineError("Type: message").
_BUILTIN_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        LookupError,
        RuntimeError,
        NotImplementedError,
        TimeoutError,
        FileNotFoundError,
        OverflowError,
        ZeroDivisionError,
        MemoryError,  # a model, draft or quantisation that would not fit the host's memory (`host_memory_mb`)
    )
}
_IPC_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (ProtocolMismatchError, EngineError, EngineDeadError, EngineBusyError, EngineDrainingError)
}


def error_to_wire(exc: BaseException) -> ErrorInfo:
    if isinstance(exc, KeyError) and len(exc.args) == 1:
        message = str(exc.args[0])
    elif isinstance(exc, msgspec.ValidationError):
        return ErrorInfo("ValueError", str(exc))
    else:
        message = str(exc)
    return ErrorInfo(type(exc).__name__, message)


def error_from_wire(err: ErrorInfo) -> BaseException:
    cls = _BUILTIN_ERRORS.get(err.type) or _IPC_ERRORS.get(err.type)
    if cls is not None:
        return cls(err.message)
    return EngineError(f"{err.type}: {err.message}")


__all__ = [  # the shared types this module re-exports, besides its own
    "EVENT_KINDS",
    "METRICS_EVERY_S",
    "DEFAULT_DRAIN_TIMEOUT_S",
    "DEFAULT_MAX_QUEUED_CHARS",
    "DEFAULT_MAX_QUEUED_TOKENS",
    "Event",
    "EngineBusyError",
    "EngineConnectError",
    "EngineDeadError",
    "EngineDrainingError",
    "EngineError",
    "EngineStartError",
    "ProtocolMismatchError",
    "WorkbenchIPCError",
]
