"""The errors every `Engine` raises, whatever carries its requests: the in-process `LLM`, the
engine-process client (`ipc`), a remote OpenAI-compatible server (`remote`), a cluster or a router.
They describe what happened to the engine, not a transport, so clients and fronts import them from
here (`ipc.protocol` carries them over the wire by name)."""

from __future__ import annotations


class WorkbenchError(RuntimeError):
    """Base of the errors about an engine itself (not about a request's values: those are
    ValueError / TypeError, as from any Python call)."""


WorkbenchIPCError = WorkbenchError  # its earlier name, kept for code that catches it


class ProtocolMismatchError(WorkbenchError):
    """The other side sent something this version of the protocol does not understand."""


class EngineError(WorkbenchError):
    """An exception raised in the engine whose type is not re-raised as itself."""


class EngineDeadError(WorkbenchError):
    """The engine process is gone (crashed, killed or shut down) or stopped answering."""


class EngineBusyError(WorkbenchError):
    """The engine's queue is full (prompt text waiting to be tokenized, or prompt tokens waiting
    to run): the request was refused, nothing else changed; retry later."""


class EngineDrainingError(WorkbenchError):
    """The engine is shutting down (draining after a signal): it finishes what it accepted and
    takes nothing new; retry on another engine, or on this one once it is back."""


class EngineConnectError(WorkbenchError, ConnectionError):
    """No engine answered the handshake."""


class EngineStartError(WorkbenchError):
    """The engine process exited, or never became ready, while starting."""


def fresh_copy(exc: BaseException) -> BaseException:
    """A fresh copy to raise in one caller's thread (one exception object raised in several
    threads would collect all their tracebacks)."""
    try:
        return type(exc)(*exc.args)
    except Exception:
        return exc
