"""Which drafter each mode uses, its default cap, and how --mode auto chooses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.drafters.base import Drafter
from engine.errors import TandemError
from engine.speculative import CapPolicy

if TYPE_CHECKING:
    from engine.generate import Engine

# Fixed caps used when no calibration is asked for (--max-draft omitted).
DEFAULT_CAPS = {"lookup": 16, "draft": 4}


def make_drafter(engine: "Engine", mode: str) -> Drafter | None:
    if mode == "baseline":
        return None
    if mode == "lookup":
        from engine.drafters.lookup import LookupDrafter

        return LookupDrafter()
    if mode == "draft":
        if not engine.draft_model_spec:
            raise TandemError("mode 'draft' needs a draft model (--draft-model): a small model sharing the target's tokenizer")
        from engine.drafters.draft_model import DraftModelDrafter, check_same_tokenizer
        from engine.loading import load_model

        loaded = load_model(engine.draft_model_spec)
        check_same_tokenizer(engine.tokenizer, loaded.tokenizer, engine.name, loaded.name)
        return DraftModelDrafter(loaded.model)
    if mode in ("dspark", "dflash"):
        from engine.drafters import block

        return block.load_block_drafter(engine, mode)
    raise TandemError(f"unknown mode '{mode}'")


def auto_mode(engine: "Engine") -> str:
    """The registry's mode for this pair, else DSpark, else DFlash, else lookup."""
    if engine.draft_model_spec:
        return "draft"
    from engine import registry

    return registry.auto_mode(engine)


def default_cap(engine: "Engine", mode: str, drafter: Drafter | None) -> int:
    """The cap this machine's cached calibration of the pair picks, else a fixed default."""
    if drafter is None:
        return 0
    from engine import calibrate

    calibrated = calibrate.default_cap(engine, mode, drafter)
    if calibrated is not None:
        return max(1, calibrated)  # the user asked for this mode: park only under --max-draft auto
    return min(DEFAULT_CAPS.get(mode, drafter.max_draft), drafter.max_draft)


def auto_cap_policy(engine: "Engine", mode: str, drafter: Drafter) -> CapPolicy:
    """--max-draft auto: a controller on top of this machine's calibrated cost curves."""
    from engine import calibrate

    return calibrate.auto_cap_policy(engine, mode, drafter)
