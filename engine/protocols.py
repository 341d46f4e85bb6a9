"""What the orchestration modules (modes, registry, calibrate) read from an engine.

They serve ``engine.generate.Engine`` but must not import it (it imports them), so they take any
object with these attributes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.target import Target


class EngineLike(Protocol):
    name: str
    model: Any
    tokenizer: Any
    target: "Target"
    loaded: Any  # engine.loading.LoadedModel when loaded from disk, else None
    drafter_path: str | None  # DSpark/DFlash checkpoint chosen by the user
    draft_model_spec: str | None
    drafter_bits: int | None
    confidence_threshold: float | None
    confidence_rule: str | None
    draft_vocab: int | None
    lookup_first: bool | None

    def encode(self, prompt: Any, *, chat_template: bool = True, system: str | None = None) -> list[int]: ...
