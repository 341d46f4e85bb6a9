"""Chat prompts in, structured replies out: the model-side half of the API server.

Both API dialects turn their requests into one canonical message list (the Hugging Face chat
format: ``{"role", "content": str, "tool_calls": [{"id", "type": "function", "function":
{"name", "arguments": dict}}], "tool_call_id", "name"}``) and their tools into OpenAI
function specs. ``render_chat`` renders that with the model's own chat template:

* A template that knows tools (it mentions ``tools``; Qwen2.5/Qwen3/Hermes/Llama-3.1 do) gets
  ``tools=`` and the tool turns as they are, so the model sees its native tool syntax.
* A template that does not (SmolLM2's) gets the tools written into the system message in the
  Hermes/Qwen wording below (``<tools>`` JSON lines and a ``<tool_call>{json}</tool_call>``
  instruction), earlier tool calls written back as such blocks, and tool results as user turns
  wrapped in ``<tool_response>``. The model's reply is parsed the same way either way.
* A tokenizer with no template at all (a base model, the tests' tiny tokenizer) gets ChatML
  text (``<|im_start|>role\\ncontent<|im_end|>``) with the same tool rendering.

``OutputParser`` splits the streamed reply into text, reasoning (``<think>...</think>``, also when
the template opened the block in the generation prompt) and tool calls (``<tool_call>{json}
</tool_call>``; with tools on, a reply that is just a JSON object naming a known tool also
counts, since small models often drop the tags). It holds back a tail that might be the start
of a tag, so a tag split across stream chunks is still found.
"""

from __future__ import annotations

import functools
import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from engine.errors import TandemError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

TOOLS_SYSTEM_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


SEED_MAX = 2**64 - 1  # the range of mx.random.key


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


# -- rendering ---------------------------------------------------------------------------------

def template_supports_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers picks "tool_use" when tools are given
        return "tool_use" in template or any("tools" in str(t) for t in template.values())
    return bool(template) and "tools" in template


def tools_system_text(tools: Sequence[dict]) -> str:
    return TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def _tool_call_text(call: dict) -> str:
    fn = call.get("function", call)
    return f"{TOOL_OPEN}\n" + json.dumps({"name": fn["name"], "arguments": fn.get("arguments", {})},
                                         ensure_ascii=False) + f"\n{TOOL_CLOSE}"


def tools_as_text(messages: Sequence[dict], tools: Sequence[dict] | None) -> list[dict]:
    """Plain user/assistant/system turns for a template that has no tool syntax."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            parts = [content] if content else []
            parts += [_tool_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results share one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        text = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def chatml(messages: Sequence[dict], *, prefill: bool = False, add_generation_prompt: bool = True) -> str:
    """The fallback rendering for a tokenizer without a chat template (``prefill``: the last
    message is the assistant's reply so far, left open)."""
    if prefill:
        *messages, last = messages
        return chatml(messages) + last["content"]
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + (
        "<|im_start|>assistant\n" if add_generation_prompt else "")


class PromptTooLong(TandemError):
    """The rendered prompt has more bytes than a tokenizer could fit in the context."""

    def __init__(self, n_bytes: int, max_bytes: int):
        super().__init__(f"the prompt has {n_bytes} bytes, more than the {max_bytes} the context can hold")
        self.n_bytes, self.max_bytes = n_bytes, max_bytes


MIN_BYTES_PER_TOKEN = 16  # floor of the bound below, for tokenizers that map unknown text to one token


@functools.lru_cache(maxsize=4)
def bytes_per_token_bound(tokenizer: Any) -> int:
    """The most UTF-8 bytes of text one token can stand for: its longest vocabulary entry (for
    byte-level BPE an overestimate, as bytes >= 0x80 are written as two-byte characters; for
    SentencePiece too, as the space mark takes three), at least ``MIN_BYTES_PER_TOKEN``. A prompt
    of more than ``context x this`` bytes cannot fit, so it is refused before it is tokenized."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer that cannot list its vocabulary: a generous bound
        return 256
    return max([MIN_BYTES_PER_TOKEN] + [len(t.encode("utf-8", "replace")) for t in vocab])


def encode_bounded(tokenizer: Any, text: str, max_bytes: int | None, **kw: Any) -> list[int]:
    """``tokenizer.encode(text)``, refused (``PromptTooLong``) before any work when ``text`` has more
    than ``max_bytes`` bytes: tokenizing a 30 MiB prompt takes seconds of CPU."""
    if max_bytes is not None:
        n = len(text.encode("utf-8", "surrogatepass"))
        if n > max_bytes:
            raise PromptTooLong(n, max_bytes)
    return list(tokenizer.encode(text, **kw))


def render_chat(tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                template_kwargs: dict | None = None, *, add_generation_prompt: bool = True,
                max_bytes: int | None = None) -> tuple[str, list[int]]:
    """(prompt text, token ids) for canonical messages, ending with the assistant's turn (unless
    not ``add_generation_prompt``: the history as the next turn will render it). A final assistant
    message (without tool calls) is then a prefill: the reply continues it, as OpenAI-compatible
    servers and Anthropic's API do. ``template_kwargs``: variables for the template
    (``enable_thinking``...). ``max_bytes``: see ``encode_bounded``."""
    if not messages:
        raise TandemError("'messages' is empty: give at least one message")
    last = messages[-1]
    prefill = add_generation_prompt and last["role"] == "assistant" and not last.get("tool_calls")
    if prefill and not last.get("content"):  # nothing to continue: a plain generation prompt
        messages, prefill = messages[:-1], False
        if not messages:
            raise TandemError("'messages' holds only an empty assistant message: give a user message")
    has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    template = getattr(tokenizer, "chat_template", None)
    if template and (template_supports_tools(tokenizer) or not (tools or has_tool_turns)):
        try:
            text = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                 add_generation_prompt=add_generation_prompt and not prefill,
                                                 continue_final_message=prefill, tokenize=False,
                                                 **(template_kwargs or {}))
        except Exception as e:  # jinja raise_exception(), a template that needs other fields
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise TandemError(f"the model's chat template rejected these messages: {first}") from None
        # The template writes BOS and other specials itself.
        return text, encode_bounded(tokenizer, text, max_bytes, add_special_tokens=False)
    plain = tools_as_text(messages, tools)
    if template:
        return render_chat(tokenizer, plain, None, template_kwargs, add_generation_prompt=add_generation_prompt,
                           max_bytes=max_bytes)
    text = chatml(plain, prefill=prefill, add_generation_prompt=add_generation_prompt)
    return text, encode_bounded(tokenizer, text, max_bytes)


def opens_thinking(prompt_text: str) -> bool:
    """Templates like Qwen3's / DeepSeek-R1's open the reasoning block in the generation prompt."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


# -- parsing -----------------------------------------------------------------------------------

def parse_tool_json(text: str, tool_names: Sequence[str] | None = None) -> ToolCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` -> ToolCall; None if it is not one."""
    try:
        obj = json.loads(text.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    if tool_names is not None and obj["name"] not in tool_names:
        return None
    return ToolCall(new_id("call_"), obj["name"], args)


def _partial_tag(buf: str, tags: Sequence[str]) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


Event = tuple[str, Any]  # ("text", str) | ("thinking", str) | ("tool", ToolCall)


class OutputParser:
    """Streaming split of a reply into text, thinking and tool calls (see the module doc)."""

    def __init__(self, *, tool_names: Sequence[str] | None = None, in_think: bool = False):
        self.tool_names = list(tool_names) if tool_names else None
        self._state = "think" if in_think else "text"
        self._buf = ""
        self._strip = True  # drop whitespace at the start of a text / thinking section
        self._started = False  # any answer text seen (decides the bare-JSON tool call)
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        self._drain(out, final=False)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self._drain(out, final=True)
        return out

    def _emit(self, out: list[Event], kind: str, text: str) -> None:
        if not text:
            return
        if out and out[-1][0] == kind and kind != "tool":
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def _tags(self) -> tuple[str, ...]:
        return (THINK_OPEN, TOOL_OPEN) if self.tool_names is not None else (THINK_OPEN,)

    def _drain(self, out: list[Event], final: bool) -> None:
        while True:
            buf = self._buf
            if self._strip and self._state in ("text", "think"):
                buf = self._buf = buf.lstrip()
                if not buf:
                    return
                self._strip = False
            if self._state == "think":
                i = buf.find(THINK_CLOSE)
                if i >= 0:
                    self._emit(out, "thinking", buf[:i].rstrip())
                    self._buf, self._state, self._strip = buf[i + len(THINK_CLOSE):], "text", True
                    continue
                keep = 0 if final else _partial_tag(buf, (THINK_CLOSE,))
                ready = buf[: len(buf) - keep]
                if not final:  # hold trailing whitespace: it may be all that precedes </think>
                    ready = ready.rstrip()
                self._emit(out, "thinking", ready)
                self._buf = buf[len(ready):]
                return
            if self._state == "tool":
                i = buf.find(TOOL_CLOSE)
                if i < 0 and not final:
                    return
                body = buf[:i] if i >= 0 else buf
                self._buf = buf[i + len(TOOL_CLOSE):] if i >= 0 else ""
                self._state, self._strip = "text", True
                call = parse_tool_json(body)
                if call is not None:
                    self.tool_calls.append(call)
                    out.append(("tool", call))
                else:  # not a tool call after all: keep every character
                    self._emit(out, "text", TOOL_OPEN + body + (TOOL_CLOSE if i >= 0 else ""))
                    self._started, self._strip = True, False
                if not self._buf:
                    return
                continue
            if self._state == "json":
                if not final:
                    return
                call = parse_tool_json(buf, self.tool_names)
                if call is not None:
                    self.tool_calls.append(call)
                    out.append(("tool", call))
                else:
                    self._emit(out, "text", buf)
                self._buf = ""
                return
            # text
            if not buf:
                return
            if not self._started and self.tool_names and buf[0] == "{":
                self._state = "json"
                continue
            hits = [(buf.find(t), t) for t in self._tags() if t in buf]
            if hits:
                i, tag = min(hits)
                self._emit(out, "text", buf[:i] if buf[:i].strip() else "")
                self._started = self._started or bool(buf[:i].strip())
                self._buf = buf[i + len(tag):]
                self._state = "think" if tag == THINK_OPEN else "tool"
                self._strip = tag == THINK_OPEN
                continue
            keep = 0 if final else _partial_tag(buf, self._tags())
            self._emit(out, "text", buf[: len(buf) - keep])
            self._started = self._started or keep < len(buf)
            self._buf = buf[len(buf) - keep:]
            return


# -- the dialect-neutral request and reply -----------------------------------------------------

class RequestError(TandemError):
    """A bad request: answered with ``status`` and the dialect's error body, never a traceback."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind


@dataclass
class GenSpec:
    """What a request asks for, whichever dialect it came in. ``None`` = the server's default."""

    kind: str  # "chat" or "completion"
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None  # completions
    tools: list[dict] | None = None  # OpenAI function specs; None = no tools, no tool-call parsing
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    mode: str | None = None
    max_draft: int | str | None = None
    echo: bool = False
    ignored: list[str] = field(default_factory=list)  # fields accepted but not acted on (reported in x_tandem)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # None: none; else the top alternatives to report per token (0..20)
    template_kwargs: dict = field(default_factory=dict)  # for the chat template (enable_thinking among them)

    def processing(self) -> dict:
        """``Engine.stream`` keyword arguments for the penalties, bias and logprobs asked for."""
        out = {k: getattr(self, k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                                             "logit_bias") if getattr(self, k) is not None}
        return out | ({"logprobs": self.logprobs} if self.logprobs is not None else {})


@dataclass
class Reply:
    """A reply being built from parser events; both dialects render it."""

    id: str
    model: str
    created: int
    prompt_tokens: int
    stop: list[str] = field(default_factory=list)
    blocks: list[list] = field(default_factory=list)  # [kind, payload] in order; text/thinking runs merged
    result: Any = None  # engine.generate.GenerationResult
    stop_sequence: str | None = None
    x_tandem: dict = field(default_factory=dict)
    logprobs: list = field(default_factory=list)  # streamed TokenLogprobs not yet written
    token_text: Any = None  # token id -> its text (the tokenizer's), for logprobs

    def add(self, events: Sequence[Event]) -> None:
        for kind, payload in events:
            if kind != "tool" and self.blocks and self.blocks[-1][0] == kind:
                self.blocks[-1][1] += payload
            else:
                self.blocks.append([kind, payload])

    @property
    def text(self) -> str:
        return "".join(p for k, p in self.blocks if k == "text")

    @property
    def thinking(self) -> str:
        return "".join(p for k, p in self.blocks if k == "thinking")

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [p for k, p in self.blocks if k == "tool"]

    @property
    def completion_tokens(self) -> int:
        return self.result.generated if self.result is not None else 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache restored instead of computing."""
        return self.result.cached_tokens if self.result is not None else 0

    @property
    def finish(self) -> str:
        """"tool_calls", "stop_sequence", "stop" (EOS), "length" or "cancelled"."""
        if self.tool_calls:
            return "tool_calls"
        if self.stop_sequence is not None:
            return "stop_sequence"
        return self.result.finish_reason if self.result is not None else "stop"


def matched_stop(full_text: str, stops: Sequence[str]) -> str | None:
    """The stop string that ended ``full_text`` (the earliest one in it), if any."""
    hits = [(full_text.find(s), s) for s in stops if s and s in full_text]
    return min(hits)[1] if hits else None


# -- field checks shared by the dialects -------------------------------------------------------

def opt_number(body: dict, key: str, *, lo: float | None = None, hi: float | None = None,
               integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return None
    what = "an integer" if integer else "a number"
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not (math.isfinite(value) and (value.is_integer() or not integer)))):
        raise RequestError(f"'{key}' must be {what}, got {json.dumps(value)[:40]}", param=key)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise RequestError(f"'{key}' must be {bounds}, got {str(value)[:40]}", param=key)
    if integer:
        return int(value)
    try:
        return float(value)
    except OverflowError:  # an integer beyond float range, with no upper bound to catch it
        raise RequestError(f"'{key}' is out of range", param=key) from None


def opt_bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be true or false", param=key)
    return value


def opt_str(value: Any, where: str, default: str = "") -> str:
    """A string field that may be absent (None, then ``default``) but is never another type."""
    if value is None:
        return default
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string, got {json.dumps(value)[:40]}", param=where)
    return value


def str_list(value: Any, key: str, *, limit: int = 16) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise RequestError(f"'{key}' must be a string or a list of strings", param=key)
    if len(value) > limit:
        raise RequestError(f"'{key}' takes at most {limit} strings, got {len(value)}", param=key)
    return [s for s in value if s]


MAX_LOGIT_BIAS = 1024  # entries; OpenAI takes 300


def processing_options(body: dict, spec: GenSpec) -> None:
    """``presence_penalty``, ``frequency_penalty`` (OpenAI's ranges), ``repetition_penalty`` (vLLM's
    extension) and ``logit_bias`` ({"token id": bias in [-100, 100]}); token ids are checked
    against the vocabulary when the request runs."""
    spec.presence_penalty = opt_number(body, "presence_penalty", lo=-2, hi=2)
    spec.frequency_penalty = opt_number(body, "frequency_penalty", lo=-2, hi=2)
    spec.repetition_penalty = opt_number(body, "repetition_penalty", lo=0)
    if spec.repetition_penalty == 0:
        raise RequestError("'repetition_penalty' must be greater than 0 (1 = off)", param="repetition_penalty")
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} \"token id\": bias pairs",
                           param="logit_bias")
    spec.logit_bias = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise RequestError(f"'logit_bias' keys must be token ids, got {json.dumps(key)[:40]}", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(f"'logit_bias' values must be numbers between -100 and 100, got {json.dumps(value)[:40]} "
                               f"for token {key}", param="logit_bias")
        spec.logit_bias[int(key)] = float(value)
    spec.logit_bias = spec.logit_bias or None


# Arguments apply_chat_template takes itself: a request may not set them through the template's kwargs.
_RESERVED_TEMPLATE_KEYS = {"messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
                           "continue_final_message", "return_dict", "return_tensors", "chat_template", "padding",
                           "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}


def template_options(body: dict, spec: GenSpec, key: str = "chat_template_kwargs") -> None:
    """``chat_template_kwargs`` (vLLM's and SGLang's field: any variables the template reads) into
    ``spec.template_kwargs``."""
    kwargs = body.get(key)
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or len(kwargs) > 32:
        raise RequestError(f"'{key}' must be an object of at most 32 template variables", param=key)
    for name in kwargs:
        if not name.isidentifier() or name in _RESERVED_TEMPLATE_KEYS:
            raise RequestError(f"'{key}' cannot set {json.dumps(name)[:40]}", param=key)
    spec.template_kwargs.update(kwargs)


def set_thinking(spec: GenSpec, on: bool | None) -> None:
    """The thinking switch as templates read it (Qwen3's ``enable_thinking``)."""
    if on is not None:
        spec.template_kwargs["enable_thinking"] = on


def template_reads(tokenizer: Any, name: str) -> bool:
    """Whether the tokenizer's chat template mentions the variable ``name`` (it can only then act on it)."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any(re.search(rf"\b{re.escape(name)}\b", str(t)) for t in texts)


def unread_template_kwargs(tokenizer: Any, kwargs: dict) -> list[str]:
    """Notes for ``x_tandem.ignored``: the template variables this model's template never reads."""
    out = []
    for name in kwargs:
        if name == "enable_thinking" and not template_reads(tokenizer, name):
            out.append("thinking (this model's chat template has no enable_thinking switch)")
        elif not template_reads(tokenizer, name):
            out.append(f"chat_template_kwargs.{name} (this model's chat template does not read it)")
    return out


def tandem_options(body: dict, spec: GenSpec) -> None:
    """The optional ``"tandem": {"mode": ..., "max_draft": ...}`` extension (extra_body in the SDKs)."""
    opts = body.get("tandem")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise RequestError("'tandem' must be an object like {\"mode\": \"lookup\", \"max_draft\": 8}", param="tandem")
    from engine.generate import MODES

    mode = opts.get("mode")
    if mode is not None and mode not in MODES:
        raise RequestError(f"'tandem.mode' must be one of {', '.join(MODES)}, got {json.dumps(mode)[:40]}",
                           param="tandem.mode")
    spec.mode = mode
    cap = opts.get("max_draft")
    if cap is not None and cap != "auto" and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise RequestError("'tandem.max_draft' must be an integer >= 0 or \"auto\"", param="tandem.max_draft")
    spec.max_draft = cap
