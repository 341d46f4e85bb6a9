"""The OpenAI dialect: /v1/chat/completions and /v1/completions requests and replies.

Requests become a ``GenSpec``; replies are rendered from a ``Reply``. Omitted sampling fields
use the server's defaults (greedy unless ``tandem serve --temperature`` says otherwise), not
OpenAI's temperature 1. Reasoning goes to ``reasoning_content`` (as DeepSeek and vLLM do);
tool calls come whole in one delta once the model closes them. Every reply carries
``x_tandem`` (in the body, or in the final streamed chunk).

``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` (vLLM's extension) and
``logit_bias`` change the distribution sampled from; ``logprobs``/``top_logprobs`` (chat) and
``logprobs`` (completions) report it, up to 20 alternatives (``engine/processors.py`` defines
both). ``chat_template_kwargs`` and ``enable_thinking`` reach the chat template.
"""

from __future__ import annotations

import json
from typing import Any

from engine.processors import MAX_TOP_LOGPROBS
from engine.serve.chat_format import (SEED_MAX, GenSpec, Reply, RequestError, opt_bool, opt_number, opt_str,
                                      processing_options, set_thinking, str_list, tandem_options, template_options)
from engine.serve.images import join_parts, openai_ref

# Fields clients send that change nothing here when left at their defaults.
_NEUTRAL = {"reasoning_effort": None}


def _text_content(content: Any, where: str) -> str | list[dict]:
    """The text of a message's content, or its parts when it holds images (engine/serve/images.py)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise RequestError(f"{where}: content parts must be objects", param=where)
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text", "refusal"):
                text = part.get("text", part.get("refusal"))
                if not isinstance(text, str):
                    raise RequestError(f"{where}: a '{kind}' part needs a string 'text'", param=where)
                parts.append(text)
            elif kind in ("image_url", "input_image"):
                parts.append(openai_ref(part, f"{where}.content[{len(parts)}]"))
            elif kind in ("input_audio", "file"):
                raise RequestError(f"{where}: '{kind}' content is not supported", param=where)
            else:
                raise RequestError(f"{where}: unknown content part type {json.dumps(kind)[:40]}", param=where)
        return join_parts(parts)
    raise RequestError(f"{where}: 'content' must be a string or a list of parts", param=where)


def _arguments(raw: Any, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except ValueError:
            raise RequestError(f"{where}: 'arguments' is not valid JSON", param=where) from None
        if isinstance(value, dict):
            return value
    raise RequestError(f"{where}: 'arguments' must be a JSON object", param=where)


def parse_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object", param=where)
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role == "function":  # the pre-tools API
            role = "tool"
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestError(f"{where}: unknown role {json.dumps(role)[:40]}", param=f"{where}.role")
        msg: dict = {"role": role, "content": _text_content(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise RequestError(f"{where}: 'tool_calls' must be a list", param=f"{where}.tool_calls")
            msg["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RequestError(f"{where}.tool_calls[{j}] needs a function with a name", param=f"{where}.tool_calls")
                call_id = opt_str(call.get("id"), f"{where}.tool_calls[{j}].id") or f"call_{i}_{j}"
                msg["tool_calls"].append({"id": call_id, "type": "function",
                                          "function": {"name": fn["name"],
                                                       "arguments": _arguments(fn.get("arguments"), f"{where}.tool_calls[{j}]")}})
        if role == "tool":
            msg["tool_call_id"] = opt_str(m.get("tool_call_id"), f"{where}.tool_call_id")
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    _name_tool_results(out)
    return out


def _name_tool_results(messages: list[dict]) -> None:
    """Give tool results the function name of the call they answer (some templates print it)."""
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())}
    for m in messages:
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]


def parse_tools(tools: Any, tool_choice: Any) -> list[dict] | None:
    if tools is None or tool_choice == "none":
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                               param=f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON Schema object",
                               param=f"tools[{i}].function.parameters")
        spec = {"name": fn["name"], "description": fn.get("description") or "",
                "parameters": params or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": spec})
    if isinstance(tool_choice, dict):  # one named function: offer only that one
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        chosen = [t for t in out if t["function"]["name"] == name]
        if not chosen:
            raise RequestError(f"'tool_choice' names a function not in 'tools': {json.dumps(name)[:60]}", param="tool_choice")
        out = chosen
    return out or None


def _common(body: dict, spec: GenSpec) -> GenSpec:
    if opt_number(body, "n", lo=1, integer=True) not in (None, 1):
        raise RequestError("'n' must be 1: this server returns one choice", param="n")
    max_tokens = opt_number(body, "max_completion_tokens", lo=1, integer=True)
    spec.max_tokens = max_tokens if max_tokens is not None else opt_number(body, "max_tokens", lo=1, integer=True)
    spec.temperature = opt_number(body, "temperature", lo=0, hi=2)
    spec.top_p = opt_number(body, "top_p", lo=0, hi=1)
    if spec.top_p == 0:
        raise RequestError("'top_p' must be greater than 0", param="top_p")
    spec.top_k = opt_number(body, "top_k", lo=0, integer=True)
    spec.seed = opt_number(body, "seed", lo=0, hi=SEED_MAX, integer=True)
    spec.stop = str_list(body.get("stop"), "stop")
    spec.stream = opt_bool(body, "stream")
    opts = body.get("stream_options")
    spec.include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    spec.model = model
    spec.ignored = [k for k, neutral in _NEUTRAL.items() if body.get(k) not in (None, neutral, {})]
    processing_options(body, spec)
    tandem_options(body, spec)
    return spec


def parse_chat(body: dict) -> GenSpec:
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise RequestError(f"response_format '{fmt.get('type')}' is not supported (no constrained decoding)",
                           param="response_format")
    spec = GenSpec(kind="chat", messages=parse_messages(body.get("messages")),
                   tools=parse_tools(body.get("tools"), body.get("tool_choice")))
    top = opt_number(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    if opt_bool(body, "logprobs"):
        spec.logprobs = top or 0
    elif top:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    template_options(body, spec)
    if body.get("enable_thinking") is not None:  # the peer's per-request switch
        set_thinking(spec, opt_bool(body, "enable_thinking"))
    return _common(body, spec)


def parse_completion(body: dict) -> GenSpec:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise RequestError("'prompt' must be a string, or a list of token ids (one prompt per request)",
                               param="prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string", param="prompt")
    logprobs = opt_number(body, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    if logprobs is not None and opt_bool(body, "echo"):
        raise RequestError("'logprobs' with 'echo' is not supported (no logprobs for prompt tokens)", param="logprobs")
    if body.get("suffix"):
        raise RequestError("'suffix' (fill-in-the-middle) is not supported", param="suffix")
    if opt_number(body, "best_of", lo=1, integer=True) not in (None, 1):
        raise RequestError("'best_of' must be 1", param="best_of")
    spec = GenSpec(kind="completion", prompt=prompt, echo=opt_bool(body, "echo"), logprobs=logprobs)
    return _common(body, spec)


# -- replies -----------------------------------------------------------------------------------

def _finish(reply: Reply) -> str:
    return {"stop_sequence": "stop", "cancelled": "stop"}.get(reply.finish, reply.finish)


def _usage(reply: Reply) -> dict:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": reply.cached_tokens}}


def _tool_call(call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json()}}
    return out if index is None else {"index": index, **out}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def context_error(n_prompt: int, limit: int, *, at_least: bool = False) -> RequestError:
    return RequestError(f"This model's maximum context length is {limit} tokens. However, your prompt is "
                        f"{'at least ' * at_least}{n_prompt} tokens. Please shorten it.", param="messages",
                        code="context_length_exceeded")


LOGPROB_FLOOR = -9999.0  # for -inf, which JSON cannot carry (vLLM's choice)


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def _token_logprob(r: Reply, token: int, logprob: float) -> dict:
    text = r.token_text(token)
    return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}


class ChatWriter:
    """/v1/chat/completions replies: one JSON body, or chunks. Streamed logprobs ride on the
    first chunk written after their tokens arrive (reasoning and tool-call tokens included)."""

    def __init__(self, spec: GenSpec):
        self.spec = spec
        self._tool_index = 0

    def logprobs(self, r: Reply, items: list) -> dict:
        return {"content": [{**_token_logprob(r, t.token, t.logprob),
                             "top_logprobs": [_token_logprob(r, i, v) for i, v in t.top]} for t in items],
                "refusal": None}

    def _pending_logprobs(self, r: Reply) -> dict | None:
        if self.spec.logprobs is None or not r.logprobs:
            return None
        items, r.logprobs = r.logprobs, []
        return self.logprobs(r, items)

    def _all_logprobs(self, r: Reply) -> dict | None:
        if self.spec.logprobs is None or r.result is None:
            return None
        return self.logprobs(r, r.result.logprobs or [])

    def body(self, r: Reply) -> dict:
        message: dict = {"role": "assistant", "content": r.text if (r.text or not r.tool_calls) else None}
        if r.thinking:
            message["reasoning_content"] = r.thinking
        if r.tool_calls:
            message["tool_calls"] = [_tool_call(c) for c in r.tool_calls]
        return {"id": r.id, "object": "chat.completion", "created": r.created, "model": r.model,
                "choices": [{"index": 0, "message": message, "logprobs": self._all_logprobs(r),
                             "finish_reason": _finish(r)}],
                "usage": _usage(r), "x_tandem": r.x_tandem}

    def _chunk(self, r: Reply, delta: dict, finish: str | None = None, logprobs: dict | None = None,
               **extra: Any) -> bytes:
        return sse({"id": r.id, "object": "chat.completion.chunk", "created": r.created, "model": r.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], **extra})

    def start(self, r: Reply) -> list[bytes]:
        return [self._chunk(r, {"role": "assistant", "content": ""})]

    def events(self, r: Reply, events: list) -> list[bytes]:
        out = []
        for kind, payload in events:
            logprobs = self._pending_logprobs(r)
            if kind == "text":
                out.append(self._chunk(r, {"content": payload}, logprobs=logprobs))
            elif kind == "thinking":
                out.append(self._chunk(r, {"reasoning_content": payload}, logprobs=logprobs))
            else:
                out.append(self._chunk(r, {"tool_calls": [_tool_call(payload, self._tool_index)]}, logprobs=logprobs))
                self._tool_index += 1
        return out

    def end(self, r: Reply) -> list[bytes]:
        out = [self._chunk(r, {}, _finish(r), logprobs=self._pending_logprobs(r), x_tandem=r.x_tandem)]
        if self.spec.include_usage:
            out.append(sse({"id": r.id, "object": "chat.completion.chunk", "created": r.created, "model": r.model,
                            "choices": [], "usage": _usage(r)}))
        return out + [b"data: [DONE]\n\n"]

    keepalive = staticmethod(lambda: b": keep-alive\n\n")

    @staticmethod
    def stream_error(message: str, kind: str = "server_error") -> bytes:
        return sse(error_body(message, kind))


class CompletionWriter(ChatWriter):
    """/v1/completions replies (raw text, no chat template, no tool or reasoning parsing)."""

    def __init__(self, spec: GenSpec, prompt_text: str = ""):
        super().__init__(spec)
        self.echo = prompt_text if spec.echo else ""
        self._offset = len(self.echo)  # text_offset of the next token

    def logprobs(self, r: Reply, items: list) -> dict:
        """The legacy shape: parallel lists, ``top_logprobs`` as {token text: logprob}."""
        tokens, offsets = [], []
        for t in items:
            tokens.append(r.token_text(t.token))
            offsets.append(self._offset)
            self._offset += len(tokens[-1])
        top = [{r.token_text(i): _logprob(v) for i, v in t.top} for t in items] if self.spec.logprobs else None
        return {"tokens": tokens, "token_logprobs": [_logprob(t.logprob) for t in items], "top_logprobs": top,
                "text_offset": offsets}

    def body(self, r: Reply) -> dict:
        return {"id": r.id, "object": "text_completion", "created": r.created, "model": r.model,
                "choices": [{"index": 0, "text": self.echo + r.text, "logprobs": self._all_logprobs(r),
                             "finish_reason": _finish(r)}],
                "usage": _usage(r), "x_tandem": r.x_tandem}

    def _chunk(self, r: Reply, text: str, finish: str | None = None, logprobs: dict | None = None,
               **extra: Any) -> bytes:
        return sse({"id": r.id, "object": "text_completion", "created": r.created, "model": r.model,
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}], **extra})

    def start(self, r: Reply) -> list[bytes]:
        return [self._chunk(r, self.echo)] if self.echo else []

    def events(self, r: Reply, events: list) -> list[bytes]:
        return [self._chunk(r, payload, logprobs=self._pending_logprobs(r)) for kind, payload in events if kind == "text"]

    def end(self, r: Reply) -> list[bytes]:
        out = [self._chunk(r, "", _finish(r), logprobs=self._pending_logprobs(r), x_tandem=r.x_tandem)]
        if self.spec.include_usage:
            out.append(sse({"id": r.id, "object": "text_completion", "created": r.created, "model": r.model,
                            "choices": [], "usage": _usage(r)}))
        return out + [b"data: [DONE]\n\n"]
