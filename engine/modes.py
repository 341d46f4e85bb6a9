"""Which drafter each mode uses, its default cap, which modes a model can run, and how --mode
auto chooses."""

from __future__ import annotations

from engine.drafters.base import Drafter
from engine.errors import TandemError
from engine.protocols import EngineLike
from engine.speculative import CapPolicy

# Fixed caps used when no calibration is asked for (--max-draft omitted).
DEFAULT_CAPS = {"lookup": 16, "draft": 4}
BLOCK_MODES = ("dspark", "dflash")


def make_drafter(engine: EngineLike, mode: str) -> Drafter | None:
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
    if mode in BLOCK_MODES:
        return block_drafter(engine, mode)
    raise TandemError(f"unknown mode '{mode}'")


def drafter_bits(engine: EngineLike) -> int | None:
    """Bits to quantize a block drafter to, or None to keep it float. Quantized matmul is only
    fast on Metal/CUDA; on the CPU backend the drafter stays float32 (spec/models.md)."""
    from engine import platform
    from engine.drafters.checkpoint import VALID_BITS

    bits = engine.drafter_bits
    if bits is not None and bits not in VALID_BITS and bits not in (0, 16, 32):
        raise TandemError(f"drafter bits must be one of {', '.join(map(str, VALID_BITS))} (or 16/32 for none), got {bits}")
    if platform.backend() not in ("metal", "cuda"):
        return None
    if bits is None:
        return 4
    return bits if bits in VALID_BITS else None


def block_drafter(engine: EngineLike, mode: str) -> Drafter:
    """The DSpark/DFlash drafter for ``engine``: its --drafter, else the registry's locally
    available drafter for this target, behind n-gram lookup when ``engine.lookup_first`` (or,
    left unset, the registry row) asks. Refuses, in one line, anything it cannot run exactly."""
    from engine import registry
    from engine.drafters.checkpoint import load_checkpoint, resolve_drafter_path

    spec, row = engine.drafter_path, None
    if not spec:
        row = registry.usable_row(engine, mode)
        if row is None:
            raise TandemError(registry.missing_drafter_message(engine, mode))
        spec = row["drafter"]
    path = resolve_drafter_path(spec)
    model, cfg = load_checkpoint(path, engine.target, mode=mode, bits=drafter_bits(engine),
                                 draft_vocab=engine.draft_vocab)
    drafter: Drafter
    if cfg.kind == "dspark":
        from engine.drafters.dspark import DSparkDrafter

        drafter = DSparkDrafter(model, cfg, engine.target, confidence_threshold=lambda: engine.confidence_threshold)
    else:
        from engine.drafters.dflash import DFlashDrafter

        drafter = DFlashDrafter(model, cfg, engine.target)
    lookup_first = engine.lookup_first
    if lookup_first is None:  # the registry row's measured choice for this pair
        lookup_first = bool(row and row.get("lookup_first"))
    if lookup_first:
        from engine.drafters.lookup_first import LookupFirst

        return LookupFirst(drafter)
    return drafter


def speculation_blocker(engine: EngineLike) -> str | None:
    """Why this target cannot verify drafts (a cache the engine cannot roll back), or None."""
    reason = engine.target.speculation_blocker()
    return None if reason is None else f"{engine.name}: {reason}"


def kv_bits_policy(bits: int | None, *, force: bool = False) -> tuple[int | None, str | None]:
    """The K/V bits to use for ``--kv-bits`` and, when it stays off, why. Quantized attention is
    only fast on Metal/CUDA; on the CPU backend K/V stay float, as weights do (spec/models.md),
    unless ``force`` (tests, measurements)."""
    from engine import platform
    from engine.caches import KV_BITS

    if not bits:
        return None, None
    if bits not in KV_BITS:
        raise TandemError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, got {bits}")
    backend = platform.backend()
    if backend not in ("metal", "cuda") and not force:
        return None, (f"--kv-bits {bits} is off on the {backend} backend: MLX's CPU quantized kernels are slower "
                      f"than float, so the KV cache stays float like the weights")
    return bits, None


def mode_support(engine: EngineLike, modes: tuple[str, ...]) -> dict[str, str | None]:
    """For each mode: None when this engine can run it, else the one-line reason it cannot.
    Cheap: reads configs and the registry, loads no drafter."""
    from engine import registry

    blocker = speculation_blocker(engine)
    support: dict[str, str | None] = {}
    for mode in modes:
        if mode in ("auto", "baseline"):
            reason = None
        elif blocker:
            reason = blocker + "; only baseline runs"
        elif mode == "draft":
            reason = None if engine.draft_model_spec else "needs a draft model sharing the tokenizer (--draft-model)"
        elif mode in BLOCK_MODES:
            reason = registry.block_drafter_problem(engine, mode)
        else:
            reason = None
        support[mode] = reason
    return support


def auto_mode(engine: EngineLike) -> str:
    """The registry's mode for this pair, else DSpark, else DFlash, else lookup."""
    if speculation_blocker(engine):
        return "baseline"
    if engine.draft_model_spec:
        return "draft"
    from engine import registry

    return registry.auto_mode(engine)


def default_cap(engine: EngineLike, mode: str, drafter: Drafter | None) -> int:
    """The cap this machine's cached calibration of the pair picks, else a fixed default."""
    if drafter is None:
        return 0
    from engine import calibrate

    calibrated = calibrate.default_cap(engine, mode, drafter)
    if calibrated is not None:
        return max(1, calibrated)  # the user asked for this mode: park only under --max-draft auto
    return min(DEFAULT_CAPS.get(mode, drafter.max_draft), drafter.max_draft)


def auto_cap_policy(engine: EngineLike, mode: str, drafter: Drafter) -> CapPolicy:
    """--max-draft auto: a controller on top of this machine's calibrated cost curves."""
    from engine import calibrate

    return calibrate.auto_cap_policy(engine, mode, drafter)
