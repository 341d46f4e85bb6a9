"""The Anthropic dialect: /v1/messages and /v1/messages/count_tokens.

Content blocks map onto the canonical chat messages: ``tool_use`` blocks become the assistant's
tool calls, ``tool_result`` blocks become tool turns (in order, before any text of the same user
turn; a non-text block inside a result becomes a placeholder), earlier ``thinking`` blocks are dropped (chat templates drop past reasoning too). The reply
lifts ``<think>`` output into ``thinking`` blocks and tool calls into ``tool_use`` blocks; a
streamed reply opens and closes one content block per run of one kind. ``thinking: {"type":
"enabled" | "disabled"}`` sets the chat template's ``enable_thinking`` (reported as ignored where
the template has no such switch); its ``budget_tokens`` and ``cache_control`` marks are accepted
and have no effect (reported in ``x_tandem.ignored``). ``x_tandem`` rides on the body, or on ``message_delta`` when streaming.
"""

from __future__ import annotations

import json
from typing import Any

from engine.serve.chat_format import (SEED_MAX, GenSpec, Reply, RequestError, opt_bool, opt_number, opt_str,
                                      processing_options, set_thinking, str_list, tandem_options)
from engine.serve.images import anthropic_ref, join_parts


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}: 'content' must be a string or a list of content blocks", param=where)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"{where}.content[{j}] must be a content block with a 'type'", param=where)
    return content


def _block_text(content: Any, where: str, *, placeholder: bool = False) -> str:
    """Text of a system prompt or tool_result (a string or text blocks). In tool results a
    non-text block (a screenshot a tool returned) becomes a placeholder, so one such result does
    not make the whole conversation unanswerable."""
    if content is None:
        return ""
    parts = []
    for block in _blocks(content, where):
        if block["type"] == "text":
            parts.append(opt_str(block.get("text"), f"{where}: a text block's 'text'"))
        elif placeholder:
            parts.append(f"[{block['type']} omitted: this model reads text only]")
        else:
            raise RequestError(f"{where}: '{block['type']}' blocks are not supported here (text only)", param=where)
    return "\n".join(parts)


def parse_system(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n\n".join(_block_text([b], "system") for b in system)
    raise RequestError("'system' must be a string or a list of text blocks", param="system")


def parse_messages(messages: Any, system: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    out: list[dict] = []
    system_text = parse_system(system)
    if system_text:
        out.append({"role": "system", "content": system_text})
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise RequestError(f"{where} must be an object with role 'user' or 'assistant'", param=where)
        role, text, calls = m["role"], [], []
        for j, block in enumerate(_blocks(m.get("content"), where)):
            kind, at = block["type"], f"{where}.content[{j}]"
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise RequestError(f"{at}: a text block needs a string 'text'", param=at)
                text.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise RequestError(f"{at}: tool_use needs a 'name' and an object 'input'", param=at)
                call_id = opt_str(block.get("id"), f"{at}.id") or f"toolu_{i}_{j}"
                names[call_id] = block["name"]
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and role == "user":
                result = _block_text(block.get("content"), at, placeholder=True)
                if block.get("is_error"):
                    result = f"Error: {result}"
                tool_id = opt_str(block.get("tool_use_id"), f"{at}.tool_use_id")
                msg = {"role": "tool", "content": result, "tool_call_id": tool_id}
                if tool_id in names:
                    msg["name"] = names[tool_id]
                out.append(msg)
            elif kind in ("thinking", "redacted_thinking"):
                continue
            elif kind == "image" and role == "user":
                text.append(anthropic_ref(block, at))
            elif kind in ("document", "audio"):
                raise RequestError(f"{at}: '{kind}' blocks are not supported", param=at)
            else:
                raise RequestError(f"{at}: unsupported block type '{kind}' for role {role}", param=at)
        if text or calls or not m.get("content"):
            msg = {"role": role, "content": join_parts(text, "\n")}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def parse_tools(tools: Any, tool_choice: Any, ignored: list[str]) -> list[dict] | None:
    if tools is None or (isinstance(tool_choice, dict) and tool_choice.get("type") == "none"):
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not t["name"]:
            raise RequestError(f"tools[{i}] needs a 'name'", param=f"tools[{i}]")
        if t.get("type") not in (None, "custom") and "input_schema" not in t:
            ignored.append(f"tools[{i}] ({t['type']}: a server tool)")
            continue
        schema = t.get("input_schema")
        if schema is not None and not isinstance(schema, dict):
            raise RequestError(f"tools[{i}].input_schema must be a JSON Schema object", param=f"tools[{i}].input_schema")
        schema = schema or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                     "parameters": schema}})
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "tool":
        out = [t for t in out if t["function"]["name"] == tool_choice.get("name")]
        if not out:
            raise RequestError("'tool_choice' names a tool not in 'tools'", param="tool_choice")
    return out or None


def parse_request(body: dict, *, count_only: bool = False) -> GenSpec:
    ignored: list[str] = []
    spec = GenSpec(kind="chat", messages=parse_messages(body.get("messages"), body.get("system")),
                   tools=parse_tools(body.get("tools"), body.get("tool_choice"), ignored))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    spec.model = model
    if count_only:
        return spec
    if body.get("max_tokens") is None:
        raise RequestError("'max_tokens' is required", param="max_tokens")
    spec.max_tokens = opt_number(body, "max_tokens", lo=1, integer=True)
    spec.temperature = opt_number(body, "temperature", lo=0, hi=2)
    spec.top_p = opt_number(body, "top_p", lo=0, hi=1)
    if spec.top_p == 0:
        raise RequestError("'top_p' must be greater than 0", param="top_p")
    spec.top_k = opt_number(body, "top_k", lo=0, integer=True)
    spec.seed = opt_number(body, "seed", lo=0, hi=SEED_MAX, integer=True)  # not in Anthropic's API; handy for tests
    spec.stop = str_list(body.get("stop_sequences"), "stop_sequences")
    spec.stream = opt_bool(body, "stream")
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise RequestError("'thinking' must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}", param="thinking")
        set_thinking(spec, kind != "disabled")
        if thinking.get("budget_tokens") is not None:
            ignored.append("thinking.budget_tokens (the model decides how long it reasons)")
    spec.ignored = ignored
    processing_options(body, spec)  # not in Anthropic's API; the OpenAI fields, for clients that send them
    tandem_options(body, spec)
    return spec


# -- replies -----------------------------------------------------------------------------------

_STOP_REASON = {"tool_calls": "tool_use", "stop_sequence": "stop_sequence", "stop": "end_turn",
                "length": "max_tokens", "cancelled": "end_turn"}


def _event(kind: str, obj: dict) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **obj}, ensure_ascii=False).encode() + b"\n\n"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


def context_error(n_prompt: int, limit: int, *, at_least: bool = False) -> RequestError:
    # Claude Code recognises this wording and offers to compact the conversation (``at_least``: a
    # lower bound, from the prompt's size in bytes; the wording stays the same).
    return RequestError(f"prompt is too long: {n_prompt} tokens > {limit} maximum", param="messages")


def _block(kind: str, payload: Any) -> dict:
    if kind == "text":
        return {"type": "text", "text": payload}
    if kind == "thinking":
        return {"type": "thinking", "thinking": payload, "signature": ""}
    return {"type": "tool_use", "id": "toolu_" + payload.id.removeprefix("call_"), "name": payload.name,
            "input": payload.arguments}


class MessagesWriter:
    def __init__(self, spec: GenSpec):
        self.spec = spec
        self._open: str | None = None  # kind of the open content block
        self._index = -1

    def _usage(self, r: Reply) -> dict:
        # Anthropic counts cache reads apart: input_tokens are the prompt tokens computed anew.
        return {"input_tokens": r.prompt_tokens - r.cached_tokens, "output_tokens": r.completion_tokens,
                "cache_read_input_tokens": r.cached_tokens, "cache_creation_input_tokens": 0}

    def body(self, r: Reply) -> dict:
        return {"id": r.id, "type": "message", "role": "assistant", "model": r.model,
                "content": [_block(k, p) for k, p in r.blocks],
                "stop_reason": _STOP_REASON[r.finish], "stop_sequence": r.stop_sequence,
                "usage": self._usage(r), "x_tandem": r.x_tandem}

    def start(self, r: Reply) -> list[bytes]:
        message = {"id": r.id, "type": "message", "role": "assistant", "model": r.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": r.prompt_tokens, "output_tokens": 0}}
        return [_event("message_start", {"message": message})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", {"index": self._index})]

    def events(self, r: Reply, events: list) -> list[bytes]:
        out: list[bytes] = []
        for kind, payload in events:
            if kind != self._open or kind == "tool":
                out += self._close()
                self._index += 1
                start = _block(kind, payload)
                if kind == "tool":
                    out.append(_event("content_block_start", {"index": self._index, "content_block": {**start, "input": {}}}))
                    out.append(_event("content_block_delta", {"index": self._index, "delta": {
                        "type": "input_json_delta", "partial_json": payload.arguments_json()}}))
                    out.append(_event("content_block_stop", {"index": self._index}))
                    continue
                empty = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
                out.append(_event("content_block_start", {"index": self._index, "content_block": empty}))
                self._open = kind
            delta = {"type": "text_delta", "text": payload} if kind == "text" else {"type": "thinking_delta", "thinking": payload}
            out.append(_event("content_block_delta", {"index": self._index, "delta": delta}))
        return out

    def end(self, r: Reply) -> list[bytes]:
        return self._close() + [
            _event("message_delta", {"delta": {"stop_reason": _STOP_REASON[r.finish], "stop_sequence": r.stop_sequence},
                                     "usage": self._usage(r), "x_tandem": r.x_tandem}),
            _event("message_stop", {}),
        ]

    keepalive = staticmethod(lambda: _event("ping", {}))

    @staticmethod
    def stream_error(message: str, kind: str = "api_error") -> bytes:
        return _event("error", {"error": {"type": kind, "message": message}})
