"""Structured output on the HTTP endpoint: OpenAI's `response_format` and `tools`, and vLLM's
extension fields, mapped onto `SamplingParams.structured`.

- `response_format`: `{"type": "text"}`, `{"type": "json_object"}`, or `{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": ...}}` (the grammar always holds the
  schema: strict or not, the output validates).
- vLLM's fields: `structured_outputs` (`{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`)
  and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
- `tools`: where the chat template defines tool calls in the `<tool_call>{"name": ..., "arguments":
  ...}</tool_call>` form (Hermes, Qwen), the template is given the tools and the output is free text
  in which every call, once begun, is held to its tool's schema (an XGrammar structural tag):
  `tool_choice` `"auto"` lets the model decide, `"required"` needs at least one call, a named
  function exactly that one. A template without tools gets them described in a system message, and
  `"required"` (a JSON list of calls) and a named function (its arguments as JSON) are served by a
  schema; `"auto"` is refused there (the model has no way to call). `"none"` leaves the tools out.
  Calls come back as `tool_calls`.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from ..sampling_params import StructuredOutput
from .protocol import ChatCompletionRequest, _Common, bad_request

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _spec(fields: dict, param: str) -> StructuredOutput:
    try:
        return StructuredOutput.coerce(fields)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e).replace("SamplingParams.structured", param), param=param) from None


def constraint_of(req: _Common) -> StructuredOutput | None:
    """The constraint a request names, from at most one of its fields."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(("response_format", StructuredOutput(json_object=True)))
        elif kind == "json_schema":
            inner = fmt.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, dict):
                raise bad_request(
                    "response_format json_schema needs json_schema.schema, a JSON schema object",
                    param="response_format",
                )
            found.append(("response_format", _spec({"json": schema}, "response_format.json_schema.schema")))
        elif kind != "text":
            raise bad_request(
                f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                param="response_format",
            )
    if req.structured_outputs is not None:
        if not isinstance(req.structured_outputs, dict):
            raise bad_request("structured_outputs must be an object", param="structured_outputs")
        found.append(("structured_outputs", _spec(req.structured_outputs, "structured_outputs")))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, _spec({kind: value}, name)))
    if len(found) > 1:
        raise bad_request(
            f"give one constraint; this request names {', '.join(n for n, _ in found)}", param=found[1][0]
        )
    return found[0][1] if found else None


@dataclass
class ToolPlan:
    """How a chat request's tools are served: the constraint on the output, and how the output
    becomes `tool_calls`."""

    structured: StructuredOutput
    named: str | None  # tool_choice named this function
    tools: list[dict]  # the functions ({"name", "description", "parameters"})
    tagged: bool = False  # calls are the template's <tool_call> blocks in free text (else the output is JSON)

    def answer(self, text: str) -> tuple[str | None, list[dict] | None]:
        """The message's content and OpenAI `tool_calls` for a complete output (no calls: the text)."""
        try:
            if self.tagged:
                calls = [json.loads(block) for block in _CALL.findall(text)]
                pairs = [(c["name"], c["arguments"]) for c in calls]
                content = _CALL.sub("", text).strip() or None
            else:
                value = json.loads(text)
                pairs = (
                    [(self.named, value)] if self.named is not None else [(c["name"], c["parameters"]) for c in value]
                )
                content = None
        except (ValueError, KeyError, TypeError):
            return text, None
        if not pairs:
            return text, None
        return content, [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
            for name, args in pairs
        ]


def _functions(tools: list) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}",
                param="tools",
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        out.append({"name": fn["name"], "description": fn.get("description") or "", "parameters": params})
    names = [f["name"] for f in out]
    if len(set(names)) != len(names):
        raise bad_request(f"tools name a function twice: {names}", param="tools")
    return out


def template_tools(template: str) -> str | None:
    """How a chat template calls tools: "tagged" (`<tool_call>` blocks), "other" (a form this server
    does not parse), or None (it defines none)."""
    if "tools" not in template:
        return None
    return "tagged" if "<tool_call>" in template else "other"


def tool_plan(req: ChatCompletionRequest, template: str) -> ToolPlan | None:
    """None when the output is free (no tools, or tool_choice "none")."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    tools = _functions(req.tools)
    if choice == "none":
        return None
    if choice not in (None, "auto", "required"):
        _named(choice, tools)  # a bad tool_choice is named before anything else
    if req.response_format is not None and (req.response_format or {}).get("type", "text") != "text":
        raise bad_request("response_format cannot be combined with tools", param="response_format")
    form = template_tools(template)
    if form == "tagged":
        named = None if choice in (None, "auto", "required") else _named(choice, tools)
        tags = [
            {
                "type": "tag",
                "begin": '<tool_call>\n{"name": ' + json.dumps(f["name"]) + ', "arguments": ',
                # at most one blank in a row: a free-whitespace JSON lets a weak model pad until max_tokens
                "content": {"type": "json_schema", "json_schema": f["parameters"], "max_whitespace_cnt": 1},
                "end": "}\n</tool_call>",
            }
            for f in tools
            if named is None or f["name"] == named
        ]
        if choice in (None, "auto"):  # free text; a call, once begun, holds to its tool's schema
            fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags}
        else:  # calls only: one or more (required), exactly the one named
            fmt = {"type": "tags_with_separator", "separator": "\n", "tags": tags, "at_least_one": True}
            fmt["stop_after_first"] = named is not None
        tag = {"type": "structural_tag", "format": fmt}
        return ToolPlan(StructuredOutput(structural_tag=tag), named, tools, tagged=True)
    if choice in (None, "auto"):
        why = (
            "needs a chat template that defines tool calls; this model's does not"
            if form is None
            else "needs tool calls this server can read (<tool_call>{...}</tool_call>); this model's chat template "
            "writes them in another form"
        )
        raise bad_request(
            f"tool_choice 'auto' (the default with tools) lets the model decide whether to call a tool, which {why}. "
            "Send tool_choice 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if choice == "required":
        one_of = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "parameters": f["parameters"]},
                "required": ["name", "parameters"],
            }
            for f in tools
        ]
        schema = {"type": "array", "minItems": 1, "items": one_of[0] if len(one_of) == 1 else {"anyOf": one_of}}
        return ToolPlan(StructuredOutput(json=schema), None, tools)
    name = _named(choice, tools)
    [match] = [f for f in tools if f["name"] == name]
    return ToolPlan(StructuredOutput(json=match["parameters"]), name, tools)


def _named(choice, tools: list[dict]) -> str:
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
    if not isinstance(name, str):
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in [f["name"] for f in tools]:
        raise bad_request(f"tool_choice names {name!r}, which is not among tools {[f['name'] for f in tools]}",
                          param="tool_choice")  # fmt: skip
    return name


def tools_message(plan: ToolPlan) -> str:
    """What a model whose chat template knows no tools is told of them (a system message)."""
    listing = json.dumps(plan.tools, ensure_ascii=False)
    if plan.named is not None:
        return f"You call the function {plan.named}. Functions: {listing}. Answer with its arguments as JSON."
    return (
        f"You can call these functions: {listing}. Answer with a JSON list of calls, each "
        '{"name": <function name>, "parameters": <its arguments>}.'
    )


def with_tools(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """The messages with the tools described in the system message."""
    note = tools_message(plan)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]
