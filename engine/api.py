"""The small Python API.

    >>> import engine.api as tandem
    >>> eng = tandem.load()                       # the starter model, offline
    >>> print(tandem.generate(eng, "Hello", mode="lookup").text)
    >>> for chunk in tandem.stream(eng, "Hello"): print(chunk.text, end="")
    >>> chat = tandem.Session(eng, system="Answer briefly.")
    >>> chat.send("Name a prime.").text; chat.send("Another one?").text   # turn 2 prefills only itself
    >>> chat.edit(0, "Name an even prime."); chat.regenerate()
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from engine.errors import TandemError
from engine.generate import Chunk, Engine, GenerationResult, Prompt


def load(model: str | None = None, *, drafter: str | None = None, draft_model: str | None = None,
         drafter_bits: int | None = None, confidence_threshold: float | None = None,
         draft_vocab: int | None = None, lookup_first: bool | None = None, kv_bits: int | None = None,
         confidence_rule: str | None = None, dtype: str | None = None,
         progress: Callable[[int, int, str], None] | None = None) -> Engine:
    """Load a target (HF repo id, local folder, .gguf, built-in name, or None for the starter).
    ``kv_bits`` (4/8) quantizes the KV cache on Metal/CUDA; why it stays off elsewhere is in
    ``engine.notes``. ``dtype``: float32 / bfloat16 / float16 for the target's floating
    parameters (quantized weights stay quantized on Metal/CUDA; None: the platform's policy).
    ``progress(done, total, stage)`` hears of the timing a first load runs on a CPU: this machine's
    matmuls on the model's forwards (a few seconds, once per machine and model)."""
    from engine import cpu_matmuls
    from engine.loading import load_model

    loaded = load_model(model, dtype=dtype)
    eng = Engine(loaded.model, loaded.tokenizer, name=loaded.name, loaded=loaded)
    # CPU backend: the faster matmuls for 1-14 rows, timed once per machine and model
    eng.cpu_matmuls = cpu_matmuls.choose(eng.target, progress=progress)
    eng.drafter_path = drafter
    eng.draft_model_spec = draft_model
    eng.drafter_bits = drafter_bits
    eng.confidence_threshold = confidence_threshold
    eng.confidence_rule = confidence_rule
    eng.draft_vocab = draft_vocab
    eng.lookup_first = lookup_first
    eng.set_kv_bits(kv_bits)
    return eng


def generate(engine: Engine, prompt: Prompt, **kwargs: Any) -> GenerationResult:
    return engine.generate(prompt, **kwargs)


def stream(engine: Engine, prompt: Prompt, **kwargs: Any) -> Iterator[Chunk]:
    return engine.stream(prompt, **kwargs)


def generate_batch(engine: Engine, prompts: Sequence[Prompt], *, max_batch: int | None = None,
                   **kwargs: Any) -> list[GenerationResult]:
    """Generate for several prompts together (continuous batching: up to ``max_batch`` share
    each target forward, the next joining as one finishes); results in the prompts' order.
    Each is the result its prompt gets alone. ``kwargs``: as for ``generate``, for every prompt."""
    from engine.batching import DEFAULT_MAX_BATCH, Batcher

    batcher = Batcher(engine, max_batch or DEFAULT_MAX_BATCH)
    tickets = [batcher.submit(p, **kwargs) for p in prompts]
    batcher.run()
    return [t.result for t in tickets]


class Session:
    """A conversation that keeps its history. Every turn sends the whole history, and the engine's
    prefix cache restores what earlier turns computed, so a turn prefills only its new tokens;
    an edit or a regeneration reuses everything before the changed message.

    ``defaults``: keyword arguments for every ``Engine.stream`` call (mode, max_new_tokens, ...)."""

    def __init__(self, engine: Engine, system: str | None = None, **defaults: Any):
        self.engine = engine
        self.defaults = defaults
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []

    @property
    def turns(self) -> list[tuple[str, str | None]]:
        """(user message, answer or None) per turn."""
        out: list[tuple[str, str | None]] = []
        for m in self.messages:
            if m["role"] == "user":
                out.append((m["content"], None))
            elif m["role"] == "assistant" and out:
                out[-1] = (out[-1][0], m["content"])
        return out

    def stream(self, text: str | None = None, **kwargs: Any) -> Iterator[Chunk]:
        """Add a user message (None: answer the history as it stands) and stream the answer, which
        joins the history when the stream ends. A failed turn leaves the history as it was."""
        if text is not None:
            self.messages.append({"role": "user", "content": text})
        if not self.messages or self.messages[-1]["role"] != "user":
            raise TandemError("nothing to answer: the conversation does not end with a user message")
        prompt, options = self._prompt()
        result = None
        try:
            for chunk in self.engine.stream(prompt, **{**self.defaults, **options, **kwargs}):
                if chunk.result is not None:
                    result = chunk.result
                yield chunk
        finally:
            if result is not None:
                self.messages.append({"role": "assistant", "content": result.text})
            elif text is not None:
                self.messages.pop()

    def send(self, text: str | None = None, **kwargs: Any) -> GenerationResult:
        result = None
        for chunk in self.stream(text, **kwargs):
            if chunk.result is not None:
                result = chunk.result
        return result

    def edit(self, turn: int, text: str, **kwargs: Any) -> GenerationResult:
        """Replace the user message of ``turn`` (0-based; negative counts from the end), drop every
        later message, and answer it again."""
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        try:
            index = users[turn]
        except IndexError:
            raise TandemError(f"no turn {turn}: this conversation has {len(users)}") from None
        return self._retry(index, text, **kwargs)

    def regenerate(self, **kwargs: Any) -> GenerationResult:
        """Answer the last user message again (its previous answer is dropped)."""
        end = len(self.messages) - (1 if self.messages and self.messages[-1]["role"] == "assistant" else 0)
        return self._retry(end, None, **kwargs)

    def _retry(self, keep: int, text: str | None, **kwargs: Any) -> GenerationResult:
        """Answer again from the first ``keep`` messages; the history is unchanged if that fails."""
        saved = self.messages
        self.messages = saved[:keep]
        try:
            return self.send(text, **kwargs)
        except BaseException:
            self.messages = saved
            raise

    def _prompt(self) -> tuple[Prompt, dict]:
        """The history as chat messages, or as plain 'role: text' lines for a model without a
        chat template."""
        if getattr(self.engine.tokenizer, "chat_template", None):
            return [dict(m) for m in self.messages], {}
        text = "".join(f"{m['role']}: {m['content']}\n" for m in self.messages) + "assistant:"
        return text, {"chat_template": False}
