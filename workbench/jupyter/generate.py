"""What `%%generate` does: submit prompts concurrently, stream them into one display, report.

`GenerateRun` holds one `Section` per request (prompt x sample). `arun(client)` submits every
request in one message (so the engine has them all before its next step), merges the token streams, and redraws one
display handle at most `hz` times a second: a 16-prompt cell costs ~10 IOPub messages a
second however fast tokens come. Cancelling it (a kernel interrupt) aborts the requests in the
engine. `run(client)` is the blocking twin for callers without a running event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import html
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..sampling_params import SamplingParams

SEPARATOR = "---"
EARLY_STOP_TOKENS = 2  # a completion this short ended by the model gets a hint about --chat


_OVERRIDABLE = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int,
    "ignore_eos": bool,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "min_tokens": int,
}


def parse_prompts(body: str) -> list[tuple[str, dict[str, Any]]]:
    """Prompts of a cell body with their per-prompt overrides.

    Prompts are separated by lines holding only `---`; a separator may carry sampling overrides
    for the prompt after it (``--- max_tokens=32 temperature=0.7``; a leading separator sets
    the first prompt's). Blank prompts are dropped."""
    out: list[tuple[str, dict[str, Any]]] = []
    cur: list[str] = []
    overrides: dict[str, Any] = {}
    for line in body.splitlines():
        words = line.split()
        if words and words[0] == SEPARATOR:
            out.append(("\n".join(cur), overrides))
            cur, overrides = [], _overrides(words[1:])
        else:
            cur.append(line)
    out.append(("\n".join(cur), overrides))
    return [(p.strip("\n"), o) for p, o in out if p.strip()]


def split_prompts(body: str) -> list[str]:
    """Just the prompts of a cell body (see `parse_prompts`)."""
    return [p for p, _ in parse_prompts(body)]


def _overrides(words: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for w in words:
        key, eq, text = w.partition("=")
        key = key.replace("-", "_")
        if not eq or key not in _OVERRIDABLE:
            raise ValueError(
                f"bad per-prompt option {w!r} after ---: use key=value with keys {', '.join(_OVERRIDABLE)}"
            )
        kind = _OVERRIDABLE[key]
        try:
            out[key] = (text.lower() in ("1", "true", "yes", "on")) if kind is bool else kind(text)
        except ValueError:
            raise ValueError(f"bad value in per-prompt option {w!r}: expected {kind.__name__}") from None
    return out


@dataclass
class Section:
    index: int  # prompt number (0-based)
    sample: int  # sample number for --n
    prompt: str
    params: SamplingParams
    request_id: str | None = None
    parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    submitted: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    finish_reason: str | None = None
    output: Any = None
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def stats(self) -> dict[str, Any]:
        """TTFT (engine-side when known), decode tok/s, tokens, finish reason."""
        m = getattr(self.output, "metrics", None)
        ttft = (
            m.ttft
            if m is not None and m.ttft is not None
            else (None if self.first_token is None else self.first_token - self.submitted)
        )
        times = list(getattr(m, "token_times", None) or [])
        n = len(self.output.token_ids) if self.output is not None else self.num_tokens
        if len(times) > 1 and times[-1] > times[0]:
            rate = (len(times) - 1) / (times[-1] - times[0])
        elif self.first_token is not None and self.last_token is not None and self.last_token > self.first_token:
            rate = (n - 1) / (self.last_token - self.first_token)
        else:
            rate = None
        return {
            "ttft_ms": None if ttft is None else ttft * 1e3,
            "tok_s": rate,
            "tokens": n,
            "finish_reason": self.finish_reason,
        }


def _fmt_stats(st: dict[str, Any]) -> str:
    parts = []
    if st["ttft_ms"] is not None:
        parts.append(f"TTFT {st['ttft_ms']:.0f} ms")
    parts.append(f"{st['tokens']} tokens")
    if st["tok_s"] is not None:
        parts.append(f"{st['tok_s']:.1f} tok/s")
    parts.append(f"finish: {st['finish_reason']}")
    return " · ".join(parts)


_CSS = (
    "font-family: var(--jp-code-font-family, monospace); font-size: var(--jp-code-font-size, 13px); "
    "white-space: pre-wrap; margin: 0;"
)


class GenerateInterrupted(KeyboardInterrupt):
    """The user interrupted a `%%generate` cell and its requests were aborted: a KeyboardInterrupt
    (a run-all stops there), shown as one line, not as a traceback through the magic's code."""


def show_interrupted(shell, etype, value, tb, tb_offset=None) -> list[str]:
    """IPython's custom handler for `GenerateInterrupted` (`shell.set_custom_exc`)."""
    stb = [f"\x1b[0;31mKeyboardInterrupt\x1b[0m: {value}"]
    shell._showtraceback(KeyboardInterrupt, value, stb)
    return stb


class GenerateRun:
    """One `%%generate` cell: its requests, their streams, and the display they update."""

    def __init__(
        self,
        prompts: list[str] | list[tuple[str, dict]],
        params: SamplingParams,
        *,
        n: int = 1,
        chat: bool = False,
        hz: float = 10.0,
        display: bool = True,
        note: str | None = None,
        timeout: float | None = None,
    ):
        if not prompts:
            raise ValueError(
                "the cell holds no prompt: write it below the %%generate line "
                "(separate several prompts with a line holding only ---)"
            )
        if n < 1:
            raise ValueError(f"--n must be >= 1, got {n}")
        self.chat = chat
        self.hz = float(hz)
        self.note = note
        self.timeout = timeout
        self.sections: list[Section] = []
        for i, item in enumerate(prompts):
            p, over = (item, {}) if isinstance(item, str) else item
            base = msgspec.structs.replace(params, **over) if over else params
            for k in range(n):
                sp = base
                if n > 1 and base.seed is not None:  # distinct but reproducible samples
                    sp = msgspec.structs.replace(base, seed=base.seed + k)
                self.sections.append(Section(i, k, p, sp))
        self.n = n
        self.num_prompts = len(prompts)
        self._display = display
        self._live = display and _in_kernel()  # a terminal cannot update in place: show it once, done
        self._handle = None
        self._dirty = True
        self.renders = 0  # display updates sent (tests count them)
        self.interrupted = False
        self.started = 0.0
        self.finished = 0.0

    # -- running ------------------------------------------------------------------------------
    async def arun(self, client) -> list[Any]:
        """Submit all in one message, stream, redraw at <= hz; returns the RequestOutputs in order."""
        self._show()
        self.started = time.monotonic()
        task = asyncio.ensure_future(self._pump_all(client))
        period = 1.0 / self.hz
        next_draw = time.monotonic() + period
        deadline = None if self.timeout is None else self.started + self.timeout
        try:
            while not task.done():
                # asyncio.wait, not wait_for: before Python 3.12 wait_for could swallow the cancel
                # a kernel interrupt sends when a token lands in the same loop pass (gh-86296)
                await asyncio.wait([task], timeout=max(0.0, next_draw - time.monotonic()))
                now = time.monotonic()
                if now >= next_draw:
                    self._redraw()
                    next_draw = now + period
                if deadline is not None and now > deadline:
                    raise TimeoutError(f"%%generate did not finish within {self.timeout}s")
            task.result()
        except BaseException as e:
            self.interrupted = isinstance(e, (asyncio.CancelledError, KeyboardInterrupt))
            task.cancel()
            # let the streams' cleanup send their aborts before we give up the loop
            await asyncio.wait([task], timeout=5)
            self.finished = time.monotonic()
            self._dirty = True
            self._redraw(final=True)
            raise
        self.finished = time.monotonic()
        self._dirty = True
        self._redraw(final=True)
        return [s.output for s in self.sections]

    async def _pump_all(self, client) -> None:
        """Every request in one submit, so the engine has them all before its next step (requests
        sent one by one let it start a step on the first alone). A submit is all or nothing: if the
        engine refuses it before any token, each request goes again on its own, so a bad prompt
        shows its own error and the others still run."""
        from ..interface import async_sink

        aq, sink = async_sink()
        batch = [(s.prompt, None, s.params) for s in self.sections]
        now = time.monotonic()
        for s in self.sections:
            s.submitted = now
        try:
            rids = client.submit(batch, sink, chat=self.chat, stream=True)
        except Exception:
            rids = None
        by_id = dict(zip(rids or (), self.sections))
        started = False
        try:
            while rids is not None and any(not s.done for s in self.sections):
                got = await client.apoll(aq)
                if isinstance(got, BaseException):
                    if started:
                        raise got
                    client.release(rids, set())
                    rids = None
                    break
                started = True
                s = by_id.get(got.request_id)
                if s is not None:
                    self._take(s, got)
        except asyncio.CancelledError:
            for s in self.sections:
                if s.finish_reason is None:
                    s.finish_reason = "abort"
            raise
        except Exception as e:
            for s in self.sections:
                if not s.done:
                    s.error = f"{type(e).__name__}: {e}"
            self._dirty = True
        finally:
            if rids is not None:
                client.release(rids, {r for r, s in by_id.items() if s.finish_reason is not None})
        if rids is None:
            await asyncio.gather(*(self._pump(client, s) for s in self.sections))

    async def _pump(self, client, s: Section) -> None:
        """One request on its own stream (after a refused batch)."""
        s.submitted = time.monotonic()
        try:
            async for chunk in client.astream(s.prompt, s.params, chat=self.chat):
                self._take(s, chunk)
        except asyncio.CancelledError:
            if s.finish_reason is None:
                s.finish_reason = "abort"
            raise
        except Exception as e:
            s.error = f"{type(e).__name__}: {e}"
            self._dirty = True

    def _take(self, s: Section, chunk) -> None:
        now = time.monotonic()
        s.request_id = chunk.request_id
        if chunk.token_ids_delta:
            if s.first_token is None:
                s.first_token = now
            s.last_token = now
            s.num_tokens += len(chunk.token_ids_delta)
        if chunk.text_delta:
            s.parts.append(chunk.text_delta)
        if chunk.finish_reason is not None:
            s.finish_reason = chunk.finish_reason
            s.output = chunk.output
            if s.output is not None:
                s.request_id = s.output.request_id
                if s.output.text != s.text:  # the engine's final text is authoritative
                    s.parts = [s.output.text]
        self._dirty = True

    def run(self, client) -> list[Any]:
        """Blocking: runs `arun` on a private event loop (in a helper thread when this thread
        already runs one); Ctrl-C aborts the requests and re-raises KeyboardInterrupt."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun(client))
        return _run_in_thread(lambda: self.arun(client))

    # -- display ------------------------------------------------------------------------------
    def _show(self, final: bool = False) -> None:
        if not self._display or (not self._live and not final):
            return
        from IPython.display import display

        self._handle = display(self._bundle(), raw=True, display_id=True)
        self.renders += 1
        self._dirty = False

    def _redraw(self, final: bool = False) -> None:
        if final and self._display and not self._live:
            self._show(final=True)
            return
        if not self._dirty:
            return
        self._dirty = False
        if self._handle is not None:
            self._handle.update(self._bundle(), raw=True)
            self.renders += 1

    def _bundle(self) -> dict[str, str]:
        return {"text/plain": self.to_text(), "text/html": self.to_html()}

    def _title(self, s: Section) -> str:
        title = f"Prompt {s.index + 1}" if self.num_prompts > 1 or self.n == 1 else "Prompt"
        if self.n > 1:
            title += f" · sample {s.sample + 1}"
        return title

    def _footer(self, s: Section) -> str:
        if s.error:
            return f"error: {s.error}"
        if s.done:
            st = _fmt_stats(s.stats())
            route = getattr(s.output, "route", None)
            if route is not None:  # through a router: the member that answered, and the path taken
                tried = getattr(s.output, "route_tried", None) or [route]
                st += f" · via {' → '.join(tried)}"
                if getattr(s.output, "route_score", None) is not None:
                    st += f" (score {s.output.route_score:.3g})"
            if s.finish_reason == "stop" and s.stats()["tokens"] <= EARLY_STOP_TOKENS and not self.chat:
                # an instruct model given bare text often ends at once: say why, and the way out
                st += " (the model's end of text came at once; an instruct model may need --chat: its chat template)"
            return st
        if s.first_token is None:
            return "waiting for the first token…"
        return f"{s.num_tokens} tokens…"

    def summary(self) -> str:
        done = [s for s in self.sections if s.done]
        tokens = sum(s.stats()["tokens"] for s in done)
        wall = (self.finished or time.monotonic()) - (self.started or time.monotonic())
        text = f"{len(self.sections)} request(s), {tokens} tokens in {wall:.2f} s"
        if wall > 0 and tokens:
            text += f" ({tokens / wall:.1f} tok/s overall)"
        if self.interrupted:
            aborted = sum(1 for s in self.sections if s.finish_reason == "abort")
            text += f" — interrupted: {aborted} request(s) aborted in the engine"
        return text

    def to_text(self) -> str:
        lines = [self.note] if self.note else []
        for s in self.sections:
            prompt = s.prompt if len(s.prompt) <= 200 else s.prompt[:200] + "…"
            lines += [f"── {self._title(s)} ──", f"> {prompt}", s.text, f"[{self._footer(s)}]", ""]
        if self.finished:
            lines.append(self.summary())
        return "\n".join(lines)

    def to_html(self) -> str:
        out = ['<div class="workbench-generate">']
        if self.note:
            out.append(
                f'<div style="color: var(--jp-ui-font-color2, #666); margin-bottom: 4px;">'
                f"{html.escape(self.note)}</div>"
            )
        for s in self.sections:
            prompt = s.prompt if len(s.prompt) <= 400 else s.prompt[:400] + "…"
            color = "#b00" if s.error or s.finish_reason == "abort" else "var(--jp-ui-font-color2, #666)"
            out.append(
                '<div style="border-left: 3px solid #4C72B0; padding: 2px 8px; margin: 6px 0;">'
                f'<div style="font-weight: 600;">{html.escape(self._title(s))}</div>'
                f'<pre style="{_CSS} color: var(--jp-ui-font-color2, #666);">{html.escape(prompt)}</pre>'
                f'<pre style="{_CSS}">{html.escape(s.text)}</pre>'
                f'<div style="font-size: 12px; color: {color};">{html.escape(self._footer(s))}</div>'
                "</div>"
            )
        if self.finished:
            out.append(f'<div style="font-size: 12px; font-weight: 600;">{html.escape(self.summary())}</div>')
        out.append("</div>")
        return "".join(out)


def _in_kernel() -> bool:
    from ..bokehjs import in_kernel

    return in_kernel()


def _run_in_thread(make_coro: Callable[[], Any]) -> Any:
    """Run a coroutine on a fresh loop in a helper thread (this thread's loop is busy), with
    this thread's context (so display output lands in the running cell); Ctrl-C here cancels it."""
    ctx = contextvars.copy_context()
    box: dict[str, Any] = {}
    ready = threading.Event()

    def main() -> None:
        loop = asyncio.new_event_loop()
        box["loop"] = loop
        try:
            task = loop.create_task(make_coro())
            box["task"] = task
            ready.set()
            box["result"] = loop.run_until_complete(task)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            ready.set()
            loop.close()

    t = threading.Thread(target=ctx.run, args=(main,), name="workbench-generate", daemon=True)
    t.start()
    interrupted = False
    while t.is_alive():
        try:
            t.join(0.1)
        except KeyboardInterrupt:
            interrupted = True
            ready.wait(5)
            loop, task = box.get("loop"), box.get("task")
            if loop is not None and task is not None:
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:
                    pass
    if interrupted:
        raise GenerateInterrupted("%%generate interrupted: its requests were aborted in the engine")
    if "error" in box:
        raise box["error"]
    return box.get("result")
