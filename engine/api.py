"""The small Python API.

    >>> import engine.api as tandem
    >>> eng = tandem.load()                       # the starter model, offline
    >>> print(tandem.generate(eng, "Hello", mode="lookup").text)
    >>> for chunk in tandem.stream(eng, "Hello"): print(chunk.text, end="")
"""

from __future__ import annotations

from typing import Any, Iterator

from engine.generate import Chunk, Engine, GenerationResult, Prompt


def load(model: str | None = None, *, drafter: str | None = None, draft_model: str | None = None,
         drafter_bits: int | None = None, confidence_threshold: float | None = None,
         draft_vocab: int | None = None, lookup_first: bool | None = None, kv_bits: int | None = None,
         confidence_rule: str | None = None, dtype: str | None = None) -> Engine:
    """Load a target (HF repo id, local folder, .gguf, built-in name, or None for the starter).
    ``kv_bits`` (4/8) quantizes the KV cache on Metal/CUDA; why it stays off elsewhere is in
    ``engine.notes``. ``dtype``: float32 / bfloat16 / float16 for the target's floating
    parameters (quantized weights stay quantized on Metal/CUDA; None: the platform's policy)."""
    from engine.loading import load_model

    loaded = load_model(model, dtype=dtype)
    eng = Engine(loaded.model, loaded.tokenizer, name=loaded.name, loaded=loaded)
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
