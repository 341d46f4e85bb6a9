"""Which drafter each mode uses, its default cap, which modes a model can run, and how --mode
auto chooses."""

from __future__ import annotations

from pathlib import Path

from engine.drafters.base import Drafter
from engine.errors import TandemError
from engine.protocols import EngineLike
from engine.speculative import CapPolicy

# Fixed caps used when no calibration is asked for (--max-draft omitted).
DEFAULT_CAPS = {"lookup": 16, "draft": 4}
# --mode auto puts earlier requests' continuations before a model drafter's guess where they match
# the context this long (``history_first``). Replayed on the starter's answers to repeated requests,
# a history draft after a match of 12+ tokens had 9 to 13 tokens accepted, one after 3-5 tokens about 1.
HISTORY_FIRST_MATCH = 12
BLOCK_MODES = ("dspark", "dflash")
CHECKPOINT_MODES = (*BLOCK_MODES, "eagle3")  # a drafter folder (--drafter or a registry row)


def make_drafter(engine: EngineLike, mode: str) -> Drafter | None:
    if mode == "baseline":
        return None
    if mode == "lookup":
        from engine.drafters.lookup import LookupDrafter

        return LookupDrafter(history=getattr(engine, "suffix_index", None))  # drafts from earlier requests too
    if mode == "draft":
        if not engine.draft_model_spec:
            raise TandemError("mode 'draft' needs a draft model (--draft-model): a small model sharing the target's tokenizer")
        from engine.drafters.draft_model import DraftModelDrafter, check_same_tokenizer
        from engine.loading import load_model

        loaded = load_model(engine.draft_model_spec)
        check_same_tokenizer(engine.tokenizer, loaded.tokenizer, engine.name, loaded.name)
        return DraftModelDrafter(loaded.model, shapes=engine.target.shapes)
    if mode in BLOCK_MODES:
        return block_drafter(engine, mode)
    if mode == "eagle3":
        return eagle3_drafter(engine)
    if mode == "mtp":
        return mtp_drafter(engine)
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


def _checkpoint(engine: EngineLike, mode: str) -> tuple[Path, dict | None]:
    """The drafter folder for ``mode``: --drafter, else the registry's locally available drafter
    for this target (and its row)."""
    from engine import registry
    from engine.drafters.checkpoint import resolve_drafter_path

    spec, row = engine.drafter_path, None
    if not spec:
        row = registry.usable_row(engine, mode)
        if row is None:
            raise TandemError(registry.missing_drafter_message(engine, mode))
        spec = row["drafter"]
    return resolve_drafter_path(spec), row


def _behind_lookup(engine: EngineLike, drafter: Drafter, row: dict | None) -> Drafter:
    """The drafter behind n-gram lookup when ``engine.lookup_first`` (or, left unset, the
    registry row) asks."""
    lookup_first = engine.lookup_first
    if lookup_first is None:  # the registry row's measured choice for this pair
        lookup_first = bool(row and row.get("lookup_first"))
    if lookup_first:
        from engine.drafters.lookup import LookupDrafter
        from engine.drafters.lookup_first import LookupFirst

        return LookupFirst(drafter, LookupDrafter(history=getattr(engine, "suffix_index", None)))
    return drafter


def history_first(engine: EngineLike, drafter: Drafter | None) -> Drafter | None:
    """What --mode auto runs for a model drafter that no lookup stands in front of: the history of
    earlier requests first, where it matches ``HISTORY_FIRST_MATCH`` tokens or more (an agent's
    repeated tool output, a file quoted again), else the model drafter. Nothing else of
    lookup: in-context lookup in front was measured per pair (the registry's ``lookup_first``).
    ``drafter`` itself when there is no history, no model drafter, a lookup in front already, or
    the user turned lookup-first off."""
    if (drafter is None or not drafter.has_model or hasattr(drafter, "lookup")
            or getattr(engine, "suffix_index", None) is None or engine.lookup_first is False):
        return drafter
    from engine.drafters.lookup import LookupDrafter
    from engine.drafters.lookup_first import LookupFirst

    lookup = LookupDrafter(max_draft=DEFAULT_CAPS["lookup"], history=engine.suffix_index, context=False,
                           min_history_match=HISTORY_FIRST_MATCH)
    return LookupFirst(drafter, lookup)


def block_drafter(engine: EngineLike, mode: str) -> Drafter:
    """The DSpark/DFlash drafter for ``engine``. Refuses, in one line, anything it cannot run
    exactly."""
    from engine.drafters.checkpoint import load_checkpoint

    path, row = _checkpoint(engine, mode)
    model, cfg = load_checkpoint(path, engine.target, mode=mode, bits=drafter_bits(engine),
                                 draft_vocab=engine.draft_vocab)
    drafter: Drafter
    if cfg.kind == "dspark":
        from engine.drafters.dspark import DSparkDrafter

        drafter = DSparkDrafter(model, cfg, engine.target, confidence_threshold=lambda: engine.confidence_threshold,
                                confidence_rule=lambda: engine.confidence_rule)
    elif cfg.dflash2:
        from engine.drafters.dflash2 import DFlash2Drafter

        drafter = DFlash2Drafter(model, cfg, engine.target)
    else:
        from engine.drafters.dflash import DFlashDrafter

        drafter = DFlashDrafter(model, cfg, engine.target)
    return _behind_lookup(engine, drafter, row)


def eagle3_drafter(engine: EngineLike) -> Drafter:
    from engine.drafters.eagle3 import Eagle3Drafter
    from engine.drafters.formats import load_eagle3

    path, row = _checkpoint(engine, "eagle3")
    model, vocab_ids = load_eagle3(path, engine.target, bits=drafter_bits(engine))
    return _behind_lookup(engine, Eagle3Drafter(model, engine.target, vocab_ids), row)


def _sidecar_path(spec: str) -> Path:
    from engine.drafters.checkpoint import resolve_drafter_path

    file = Path(spec).expanduser()
    return file if file.is_file() else resolve_drafter_path(spec)


def mtp_drafter(engine: EngineLike) -> Drafter:
    """The target's own MTP head (from its folder), or the sidecar --drafter names."""
    from engine import registry
    from engine.drafters import formats

    if engine.drafter_path:
        drafter = formats.mtp_drafter_from_sidecar(engine.target, _sidecar_path(engine.drafter_path),
                                                   registry.model_config(engine), engine.tokenizer,
                                                   bits=drafter_bits(engine))
    else:
        drafter = formats.mtp_drafter_from_model(engine.target, registry.model_folder(engine),
                                                 registry.model_config(engine), where=engine.name,
                                                 bits=drafter_bits(engine))
    return _behind_lookup(engine, drafter, None)


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
        elif mode in (*CHECKPOINT_MODES, "mtp"):
            reason = registry.drafter_problem(engine, mode)
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


def auto_cap_policy(engine: EngineLike, mode: str, drafter: Drafter, seeded: bool = False,
                    cached_only: bool = False) -> CapPolicy | None:
    """--max-draft auto: a controller on top of this machine's calibrated cost curves
    (``cached_only``: None where it has none)."""
    from engine import calibrate

    return calibrate.auto_cap_policy(engine, mode, drafter, seeded=seeded, cached_only=cached_only)
