"""Engine: a loaded target plus its drafters, with streaming generation on top of the loop.

``Engine.stream`` turns a prompt (text, chat messages or token ids) into chunks of text as the
loop commits tokens, applies stop strings and cancellation, and ends with a ``GenerationResult``.
All MLX work happens in the thread that iterates the stream. A prompt that starts like an earlier
sequence resumes from its stored state (``engine/prefix_cache.py``): nothing to ask for.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

from engine import modes
from engine.detokenize import StopMatcher, StreamingDetokenizer
from engine.drafters.base import Drafter
from engine.drafters.suffix import SuffixIndex
from engine.errors import TandemError
from engine.prefix_cache import PrefixCache, fingerprint
from engine.prefix_cache import boundaries as prefix_boundaries
from engine.processors import LogitsProcessor, Processing, TokenLogprob
from engine.sampling import Sampler, SamplingParams
from engine.speculative import CapPolicy, DecodeStats, FixedCap, RoundEvent, decode
from engine.target import Target

log = logging.getLogger("tandem")

MODES = ("auto", "baseline", "lookup", "draft", "dspark", "dflash", "eagle3", "mtp")

Prompt = str | Sequence[dict] | Sequence[int]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    mode: str
    prompt_tokens: int
    rounds: list[tuple[int, int]]  # (drafted, accepted) per round
    prefill_s: float
    decode_s: float
    target_forwards: int
    finish_reason: str  # "stop" (EOS or stop string), "length", "cancelled"
    cap: int | str = 0
    token_times: list[float] = field(default_factory=list)  # seconds since the request began
    note: str | None = None  # why --mode auto ran baseline, when it had to
    caps: list[int] = field(default_factory=list)  # the cap of each round (0: a plain step)
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of prefilled
    batch_width: int = 1  # the most requests it shared a target forward with (itself included)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for

    @property
    def generated(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tps(self) -> float:
        # The first token comes from prefill; decode speed counts the ones after it.
        return (self.generated - 1) / self.decode_s if self.decode_s > 0 and self.generated > 1 else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] if self.token_times else self.prefill_s

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per verify round (accepted drafts + the target's own), the
        acceptance length tau; rounds that drafted nothing count as 1."""
        spec = self.rounds[1:]  # round 0 is the prefill's token
        return (sum(a for _, a in spec) + len(spec)) / len(spec) if spec else 0.0

    @property
    def drafted(self) -> int:
        return sum(d for d, _ in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(a for _, a in self.rounds)

    def summary(self) -> str:
        return (
            f"{self.generated} tokens | {self.decode_tps:.1f} tok/s decode | prefill {self.prompt_tokens} tok "
            f"({self.cached_tokens} cached) in {self.prefill_s:.2f}s | mode {self.mode} cap {self.cap} "
            f"| accept/round {self.mean_accepted:.2f} "
            f"| {self.target_forwards} target forwards | {self.finish_reason}"
            + (f" | {self.note}" if self.note else "")
        )

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "cap": self.cap, "tokens": self.generated, "prompt_tokens": self.prompt_tokens,
            "decode_tok_s": round(self.decode_tps, 3), "prefill_tok_s": round(self.prefill_tps, 3),
            "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "accept_per_round": round(self.mean_accepted, 3), "drafted": self.drafted, "accepted": self.accepted,
            "target_forwards": self.target_forwards, "finish_reason": self.finish_reason, "note": self.note,
            "cached_tokens": self.cached_tokens, "batch_width": self.batch_width,
        }


@dataclass
class Chunk:
    """A piece of the stream: new text and tokens from one round, or the final result."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    event: RoundEvent | None = None
    result: GenerationResult | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for


@dataclass
class RequestPlan:
    """One request resolved: what the loop needs to decode it (``Engine.plan``)."""

    prompt_ids: list[int]
    mode: str
    drafter: Drafter | None
    sampler: Sampler
    cap_policy: CapPolicy
    cap_label: int | str
    max_new_tokens: int
    note: str | None = None  # why --mode auto ran baseline, when it had to
    stop: tuple[str, ...] = ()
    store: PrefixCache | None = None  # the prefix cache to restore from and keep into
    image: Any = None  # engine.vision.ImagePrompt: its embeddings enter the prefill; keyed by its images
    boundaries: tuple[int, ...] = ()  # where later prompts likely depart (its opening's end, its next turn): snapshots there
    logprobs: bool = False  # the request asked for logprobs (the sampler computes them)
    history: SuffixIndex | None = None  # the index of earlier requests this one adds to (its API key's)
    history_scope: str | None = None  # whose index that is (None: the process's)

    @property
    def embeddings(self) -> Callable[[int, int], Any] | None:
        """The image prompt's input embeddings for its prefill (``Target.prompt_embeddings``)."""
        return self.image.embeddings if self.image is not None else None

    @property
    def cache_key(self) -> list[int]:
        """The prompt as the prefix cache keys it: an image prompt's placeholders stand for their
        images (ids derived from the image bytes), so another image never restores this one's rows."""
        return self.image.key if self.image is not None else self.prompt_ids


class RequestOutput:
    """Turns one request's committed tokens into chunks of text: streaming detokenization, stop
    strings, timings, and the ``GenerationResult`` at the end. The loop pushes each round in
    (``feed``); the single-sequence stream and the batch share it."""

    def __init__(self, engine: "Engine", plan: RequestPlan, *, on_round: Callable[[RoundEvent], None] | None = None,
                 stats: DecodeStats | None = None, look_up: bool = True):
        self.engine, self.plan, self.on_round = engine, plan, on_round
        self.stats = stats if stats is not None else DecodeStats()
        self.eos = list(getattr(engine.tokenizer, "eos_token_ids", None) or [])
        self.detok = StreamingDetokenizer(engine.tokenizer)
        self.stops = StopMatcher(plan.stop)
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.stopped = False
        self.batch_width = 1  # the most rows it shared a forward with (itself included)
        self.logprobs: list[TokenLogprob] | None = [] if plan.logprobs else None
        self.prefix_plan = None
        self.prefill_stops: Sequence[int] = ()
        if look_up:
            self.look_up()

    def look_up(self) -> None:
        """Find where the prompt resumes in the prefix cache (``prefix_plan``), and where its
        prefill must pause for the cache's marks. A batch asks when the row starts prefilling,
        so it finds what the rows before it prefilled."""
        plan = self.plan
        store = plan.store
        self.prefix_plan = store.plan(self.engine.target, plan.drafter, plan.cache_key, plan.boundaries) if store is not None else None
        self.prefill_stops = self.prefix_plan.stops if self.prefix_plan is not None else ()

    def feed(self, new: list[int], event: RoundEvent) -> tuple[list[Chunk], bool]:
        """One round's tokens -> its chunk; True when a stop string ended the request."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.tokens.extend(new)
        self.times.extend([now - self.t0] * len(new))
        if self.logprobs is not None:
            self.logprobs.extend(event.logprobs or ())
        if self.on_round is not None:
            self.on_round(event)
        text, self.stopped = self.stops.feed(self.detok.add(new))
        if self.stopped:
            self.stats.finish_reason = "stop"
            self.tokens = self.engine._tokens_before_stop(self.tokens, self.detok.text, self.plan.stop)
            self.times = self.times[: len(self.tokens)]
        new_logprobs = None
        if self.logprobs is not None:  # this round's, up to the stop string's cut
            new_logprobs = self.logprobs[len(self.logprobs) - len(new): len(self.tokens)]
            del self.logprobs[len(self.tokens):]
        return [Chunk(text, new, event, logprobs=new_logprobs)], self.stopped

    def remember(self, drafter: Drafter | None) -> None:
        """Keep what the target's caches hold for the prefix cache (after the last round, or in a
        batch also once the prompt is in: the live ids are left as they are)."""
        if self.prefix_plan is not None:
            stats = self.stats
            if self.plan.image is not None:  # the cache keys an image prompt by its images, not its placeholders
                key = self.plan.cache_key
                stats = replace(stats, ids=list(key) + stats.ids[len(key):])
            self.engine._remember(self.plan.store, self.prefix_plan, stats, drafter)

    def finish(self) -> Iterator[Chunk]:
        """The text held back by stop-string matching, then the result; writes the disk tier."""
        plan, stats = self.plan, self.stats
        if not self.stopped:
            text, _ = self.stops.feed(self.detok.flush())
            tail = text + self.stops.flush()
            if tail:
                yield Chunk(tail)
        end = time.perf_counter()
        decode_s = end - self.t_first if self.t_first is not None else 0.0
        full_text = self.engine._final_text(self.tokens)
        if self.stopped:
            full_text = _cut_at_stop(self.detok.text, plan.stop)
        yield Chunk(result=GenerationResult(
            text=full_text, token_ids=self.tokens, mode=plan.mode, prompt_tokens=len(plan.prompt_ids),
            rounds=stats.rounds, prefill_s=stats.prefill_s, decode_s=decode_s, target_forwards=stats.target_forwards,
            finish_reason=stats.finish_reason, cap=plan.cap_label, token_times=self.times, note=plan.note,
            caps=stats.caps, cached_tokens=stats.cached_tokens, batch_width=self.batch_width, logprobs=self.logprobs))
        if plan.history is not None:  # what this request saw and wrote, for later requests' drafts
            self.engine.remember_sequence(plan.history_scope, plan.history, list(plan.prompt_ids) + self.tokens)
        if plan.store is not None:
            plan.store.flush()  # the disk tier's write, once the reply is out


class Engine:
    """A target model and the drafters it can use. Not thread-safe: one thread owns it."""

    def __init__(self, model: Any, tokenizer: Any, *, name: str = "target", loaded: Any = None):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.loaded = loaded  # engine.loading.LoadedModel when loaded from disk
        self.target = Target(model, tokenizer, name=name)
        self._drafters: dict[tuple, Drafter] = {}
        self._auto_drafters: dict[str, tuple] = {}  # mode -> (its drafter, what --mode auto runs with it)
        self.drafter_path: str | None = None  # DSpark/DFlash/EAGLE-3 checkpoint or MTP sidecar chosen by the user
        self.draft_model_spec: str | None = None
        self.drafter_bits: int | None = None  # None: 4-bit on Metal/CUDA, float32 on the CPU backend
        self.confidence_threshold: float | None = None
        self.confidence_rule: str | None = None  # DSpark: "slot" | "product"; None = calibrated, else the drafter's
        self.draft_vocab: int | None = None  # DSpark: None = the drafter's draft_vocab.json, 0 = full vocabulary
        self.lookup_first: bool | None = None  # DSpark/DFlash: None = the registry row's lookup_first
        self.kv_bits: int | None = None  # full-attention K/V quantized to these bits (see set_kv_bits)
        self.notes: list[str] = []  # load-time settings that could not apply here, and why
        # Hears of a calibration that a first ``--max-draft auto`` request measures (done, total,
        # stage); a front end shows it (and may raise from it to cancel the request).
        self.calibration_progress: Callable[[int, int, str], None] | None = None
        # False (a server): a request whose --max-draft auto finds no calibration drafts at the
        # mode's fixed cap instead of measuring first, and its mode waits in ``uncalibrated`` for
        # ``prepare`` (tandem serve measures while idle; the app, when a chat message needs it)
        self.calibrate_on_request = True
        self.uncalibrated: dict[str, None] = {}  # modes as requested ("auto", "lookup", ...), oldest first
        self.cpu_matmuls: Any = None  # engine.cpu_matmuls.Choice: on the CPU backend, which matmuls were picked
        self.warmed: Any = None  # engine.warmup.Warmed: the shapes a warm-up compiled (a shape policy only)
        self.prefix_cache: PrefixCache | None = PrefixCache()  # None: every prompt prefills from token 0
        self.suffix_index: SuffixIndex | None = SuffixIndex()  # earlier prompts and outputs, for lookup drafts
        self.suffix_scopes: dict[str, SuffixIndex] = {}  # one index per API key (``history``)
        self.suffix_disk: Any = None  # engine.suffix_disk.SuffixDisk: the indexes kept across restarts
        self.vision: Any = None  # engine.vision.Vision: the model takes images (a model loaded through mlx-vlm)
        if loaded is not None and getattr(loaded, "vision", None) is not None:
            from engine import vision

            self.vision = vision.attach(self, loaded.vision, fingerprint)

    @property
    def takes_images(self) -> bool:
        return self.vision is not None and self.vision.takes_images

    def image_refusal(self) -> str | None:
        """Why this engine takes no images (one line), or None when it does."""
        if self.vision is None:
            return f"{self.name} takes no images (a text-only model)"
        return None if self.vision.takes_images else f"{self.name} takes no images here: {self.vision.refused}"

    def set_kv_bits(self, bits: int | None, *, force: bool = False) -> None:
        """``--kv-bits``: quantize full-attention K/V (mlx-lm's QuantizedKVCache, group size 64) on
        Metal/CUDA; on the CPU backend it stays off, with the reason in ``notes``, unless
        ``force``. Sliding-window and recurrent caches stay float (mlx-lm has no quantized kind)."""
        bits, why = modes.kv_bits_policy(bits, force=force)
        self.notes = [n for n in self.notes if not n.startswith("--kv-bits")] + ([why] if why else [])
        self.target.set_kv_bits(bits)
        self.kv_bits = bits

    # -- prefix cache -----------------------------------------------------------------------
    def configure_prefix_cache(self, enabled: bool = True, *, memory_mb: float | None = None,
                               disk_dir: str | None = None, disk_mb: float | None = None) -> None:
        """Memory budget (None: a quarter of the memory available), optional disk tier."""
        if self.prefix_cache is not None:
            self.prefix_cache.flush()
        self.prefix_cache = None
        if enabled:
            self.prefix_cache = PrefixCache(None if memory_mb is None else int(memory_mb * 2**20), disk_dir=disk_dir,
                                            disk_bytes=None if disk_mb is None else int(disk_mb * 2**20))

    # -- suffix drafts ------------------------------------------------------------------------
    def configure_suffix_drafts(self, enabled: bool = True, *, disk_dir: str | None = None) -> None:
        """Lookup drafts from earlier requests (``engine/drafters/suffix.py``), or not; with
        ``disk_dir`` (the prefix cache's disk tier) the indexes are loaded now and kept there."""
        self.save_history()
        self.suffix_scopes = {}
        self.suffix_index = SuffixIndex() if enabled else None
        self.suffix_disk = None
        if enabled and disk_dir is not None:
            import atexit
            import weakref
            from pathlib import Path

            from engine import suffix_disk

            self.suffix_disk = suffix_disk.SuffixDisk(Path(disk_dir).expanduser())
            self.suffix_disk.bind(suffix_disk.identity(self.target), self.target.vocab_size)
            self.suffix_disk.load(None, self.suffix_index)
            atexit.register(_save_history_at_exit, weakref.ref(self))

    def history(self, scope: str | None = None) -> SuffixIndex | None:
        """The index of earlier requests that a request of ``scope`` drafts from and adds to: the
        process's for None (the app, the CLI, a server without keys), else that API key's own,
        so one client's drafting speed never tells what another one sent. None when off."""
        if self.suffix_index is None or scope is None:
            return self.suffix_index
        index = self.suffix_scopes.get(scope)
        if index is None:
            index = self.suffix_scopes[scope] = SuffixIndex(self.suffix_index.budget_tokens, self.suffix_index.ngram)
            if self.suffix_disk is not None:
                self.suffix_disk.load(scope, index)
        return index

    def remember_sequence(self, scope: str | None, index: SuffixIndex, tokens: list[int]) -> None:
        """Add a finished request's prompt and output to its index; every ``SAVE_EVERY`` additions
        the index is written to disk (when kept there)."""
        index.add(tokens)
        if self.suffix_disk is not None:
            from engine.suffix_disk import SAVE_EVERY

            self.suffix_disk.save(scope, index, every=SAVE_EVERY)

    def save_history(self) -> None:
        """Write every index that changed to disk (when kept there): the server's shutdown, exit."""
        disk = self.suffix_disk
        if disk is None:
            return
        if self.suffix_index is not None:
            disk.save(None, self.suffix_index)
        for scope, index in list(self.suffix_scopes.items()):
            disk.save(scope, index)

    def clear_prefix_cache(self) -> None:
        """Release the stored prefixes held in memory (a new chat, another model)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    # -- prompts ----------------------------------------------------------------------------
    def encode(self, prompt: Prompt, *, chat_template: bool = True, system: str | None = None,
               template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a prompt; text and messages go through the chat template (with
        ``template_kwargs``, e.g. ``{"enable_thinking": False}``) when the tokenizer has one."""
        kwargs = dict(template_kwargs or {})
        if isinstance(prompt, str):
            if not prompt.strip():
                raise TandemError("empty prompt: give some text to continue")
            if chat_template and getattr(self.tokenizer, "chat_template", None):
                return list(self.tokenizer.apply_chat_template(_one_turn(prompt, system), add_generation_prompt=True,
                                                               **kwargs))
            return list(self.tokenizer.encode(prompt))
        prompt = list(prompt)
        if not prompt:
            raise TandemError("empty prompt: give some text to continue")
        if isinstance(prompt[0], dict):
            if not getattr(self.tokenizer, "chat_template", None):
                raise TandemError(f"{self.name} has no chat template; pass plain text instead of messages")
            return list(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, **kwargs))
        return [int(t) for t in prompt]

    def _boundaries(self, prompt: Prompt, prompt_ids: list[int], chat_template: bool, system: str | None,
                    template_kwargs: Mapping[str, Any] | None) -> list[int]:
        """For a chat prompt (messages, or text through the template): where its opening ends and
        where its next turn departs."""
        if not chat_template or not getattr(self.tokenizer, "chat_template", None):
            return []
        if isinstance(prompt, str):
            messages = _one_turn(prompt, system)
        elif prompt and isinstance(prompt[0], dict):
            messages = list(prompt)
        else:
            return []
        kwargs = dict(template_kwargs or {})
        return prefix_boundaries(
            lambda m: self.tokenizer.apply_chat_template(m, add_generation_prompt=False, **kwargs), messages, prompt_ids)

    # -- drafters ---------------------------------------------------------------------------
    def resolve_mode(self, mode: str) -> str:
        if mode not in MODES:
            raise TandemError(f"unknown mode '{mode}': choose one of {', '.join(MODES)}")
        if mode != "auto":
            return mode
        return modes.auto_mode(self)

    def drafter(self, mode: str) -> Drafter | None:
        key = self._drafter_key(mode)
        if key not in self._drafters:
            self._drafters[key] = modes.make_drafter(self, mode)
        return self._drafters[key]

    def _auto_drafter(self, mode: str) -> Drafter | None:
        """--mode auto's drafter for ``mode``: the mode's, with earlier requests' continuations first
        where they are confident (``modes.history_first``)."""
        drafter = self.drafter(mode)
        made = self._auto_drafters.get(mode)
        if made is None or made[0] is not drafter:
            made = self._auto_drafters[mode] = (drafter, modes.history_first(self, drafter))
        return made[1]

    def set_drafter(self, mode: str, drafter: Drafter | None) -> None:
        """Use this drafter instance for ``mode`` (a custom or pre-built drafter)."""
        self._drafters[self._drafter_key(mode)] = drafter

    def _drafter_key(self, mode: str) -> tuple:
        # Anything that changes how the drafter is built must be part of its cache key.
        return mode, self.drafter_path, self.draft_model_spec, self.drafter_bits, self.draft_vocab, self.lookup_first

    def default_cap(self, mode: str, drafter: Drafter | None) -> int:
        return modes.default_cap(self, mode, drafter)

    def warm_up(self, modes: Sequence[str] = ("baseline",), *, progress: Callable[[int, int, str], None] | None = None,
                tokens: int | None = None, rows: int = 1,
                generate_rows: Callable[[str, int], object] | None = None) -> float:
        """Run once, now, the shapes and kernels ``modes`` will use (``engine/warmup.py``), for
        batches of up to ``rows`` requests (``engine.batching.warm_up`` passes its short batch as
        ``generate_rows``): on a GPU backend the first request then pays no compile time. Returns
        the seconds it took."""
        from engine.warmup import WARM_TOKENS, warm_prompt, warm_up

        modes = [self.resolve_mode(m) for m in modes]
        prompt = warm_prompt(self.target.vocab_size)
        return warm_up(self, modes, tokens=tokens or WARM_TOKENS, progress=progress, rows=rows,
                       generate=lambda m: self.generate(prompt, mode=m, max_new_tokens=8, prefix_cache=False),
                       generate_rows=generate_rows)

    def mode_support(self) -> dict[str, str | None]:
        """Every mode, with None when this engine can run it, else the one-line reason it cannot
        (for the app's mode picker and ``tandem doctor``). Loads no drafter."""
        return modes.mode_support(self, MODES)

    # -- generation -------------------------------------------------------------------------
    def plan(
        self,
        prompt: Prompt,
        *,
        mode: str = "auto",
        max_new_tokens: int = 256,
        max_draft: int | str | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        chat_template: bool = True,
        system: str | None = None,
        cap_policy: CapPolicy | None = None,
        prefix_cache: bool = True,
        images: Sequence[Any] = (),
        image_prompt: Any = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: int | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        boundaries: Sequence[int] | None = None,
        history_scope: str | None = None,
    ) -> "RequestPlan":
        """Resolve a request once into what decoding it takes: the prompt's ids, the mode, the
        drafter, the cap policy and the sampler (with the request's logits processing). A bad
        setting raises ``TandemError`` here, before any decoding.

        ``images`` (engine.images.Image) go with a text prompt, before its text; chat messages
        carry theirs as {"type": "image", "image": Image} content parts (engine/vision.py).
        ``image_prompt``: an ``engine.vision.ImagePrompt`` rendered already (the server's); it
        replaces ``prompt``. Penalties and ``logit_bias`` change the distribution sampled from
        (speculation stays on and lossless); ``logprobs``: None, or how many top alternatives to
        report with each token's logprob (0..20) in ``Chunk.logprobs`` / ``GenerationResult.logprobs``.
        Their definitions: ``engine/processors.py``. ``boundaries``: prompt positions later prompts
        will likely depart at (``prefix_cache.boundaries``: the chat's opening, its next turn; found
        here for messages).
        ``history_scope``: whose earlier requests lookup may draft from (``history``: an API key's)."""
        if max_new_tokens is None or max_new_tokens < 1:
            raise TandemError(f"max-new-tokens must be at least 1, got {max_new_tokens}")
        processing = Processing(presence_penalty, frequency_penalty, repetition_penalty, dict(logit_bias or {}),
                                logprobs).validate(self.target.vocab_size)
        params = SamplingParams(temperature, top_p, top_k, seed)
        image = image_prompt
        if image is None and (images or _has_images(prompt)):
            image = self._image_prompt(prompt, images, system)
        if image is not None:
            prompt_ids = image.ids
        else:
            prompt_ids = self.encode(prompt, chat_template=chat_template, system=system, template_kwargs=template_kwargs)
            vocab = self.target.vocab_size
            if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= vocab):  # the embedding would read
                outside = next(t for t in prompt_ids if not 0 <= t < vocab)  # past its table: garbage, no error
                raise TandemError(f"the prompt has token id {outside}, outside the vocabulary (size {vocab})")
            if boundaries is None and prefix_cache and self.prefix_cache is not None:
                boundaries = self._boundaries(prompt, prompt_ids, chat_template, system, template_kwargs)
        sampler = Sampler(params, LogitsProcessor(processing, prompt_ids) if processing.active else None)
        mode, drafter, cap_policy, cap_label, note = self._decoding(mode, max_draft, cap_policy, seed is not None)
        # Drafts change which random draws a sampled round makes: a seeded sample must not depend
        # on what earlier requests left in the suffix index (greedy output never depends on drafts).
        history = self.history(history_scope)
        _set_history(drafter, history if params.greedy or seed is None else None)
        return RequestPlan(prompt_ids=prompt_ids, mode=mode, drafter=drafter, sampler=sampler,
                           cap_policy=cap_policy, cap_label=cap_label, note=note, max_new_tokens=max_new_tokens,
                           stop=tuple(stop), store=self.prefix_cache if prefix_cache else None, image=image,
                           boundaries=tuple(boundaries or ()), logprobs=processing.logprobs is not None, history=history,
                           history_scope=history_scope)

    def stream(
        self,
        prompt: Prompt,
        *,
        on_round: Callable[[RoundEvent], None] | None = None,
        cancel: Callable[[], bool] | None = None,
        prefill_progress: Callable[[int, int], None] | None = None,
        **kwargs: Any,
    ) -> Iterator[Chunk]:
        """Stream one request's chunks (``plan``'s keyword arguments); the last carries the result."""
        plan = self.plan(prompt, **kwargs)
        out = RequestOutput(self, plan, on_round=on_round)
        prefix = out.prefix_plan
        steps = decode(self.target, plan.drafter, plan.prompt_ids, plan.sampler, max_new_tokens=plan.max_new_tokens,
                       eos_ids=out.eos, cap_policy=plan.cap_policy, stats=out.stats, mode=plan.mode,
                       prefill_progress=prefill_progress, resume=prefix.resume if prefix else None,
                       on_prefill=prefix.on_prefill if prefix else None, prefill_stops=out.prefill_stops,
                       prompt_embeddings=plan.embeddings)
        try:
            for new, event in steps:
                chunks, ended = out.feed(new, event)
                yield from chunks
                if ended:
                    break
                if cancel is not None and cancel():
                    out.stats.finish_reason = "cancelled"
                    break
        finally:
            steps.close()
            out.remember(plan.drafter)  # also after a cancelled prefill: the chunks done are kept
        yield from out.finish()

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerationResult:
        result = None
        for chunk in self.stream(prompt, **kwargs):  # to the end: the stream's last step writes the disk tier
            if chunk.result is not None:
                result = chunk.result
        if result is None:
            raise RuntimeError("stream ended without a result")  # unreachable
        return result

    # -- helpers ------------------------------------------------------------------------------
    def _image_prompt(self, prompt: Prompt, images: Sequence[Any], system: str | None) -> Any:
        from engine import vision

        refusal = self.image_refusal()
        if refusal is not None:
            raise vision.ImageError(refusal)
        if isinstance(prompt, str):
            parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": prompt}]
            prompt = _one_turn(parts, system)
        elif images:
            raise TandemError("pass images inside the chat messages (image content parts), not beside them")
        elif not prompt or not isinstance(prompt[0], dict):
            raise TandemError("an image prompt must be text or chat messages")
        messages, found = vision.split_images(prompt)
        return vision.image_prompt(self, messages, found)

    @staticmethod
    def _remember(store: PrefixCache, plan: Any, stats: DecodeStats, drafter: Drafter | None) -> None:
        try:
            store.remember(plan, stats, drafter)
        except Exception:  # the reply (or the error being raised) matters more than the cache
            log.exception("prefix cache: could not keep this sequence")

    def _decoding(self, mode: str, max_draft: int | str | None, cap_policy: CapPolicy | None, seeded: bool
                  ) -> tuple[str, Drafter | None, CapPolicy, int | str, str | None]:
        """(mode, drafter, cap policy, cap label, note) for a request's mode and cap. ``--max-draft
        auto`` measures this machine's calibration first if it has none, unless requests may not
        (``calibrate_on_request``): then an unseeded request drafts at the mode's fixed cap, with a
        note, and its mode joins ``uncalibrated``."""
        requested, mode = mode, self.resolve_mode(mode)
        drafter = self.drafter(mode) if requested != "auto" else self._auto_drafter(mode)
        # A cache the engine cannot roll back (the target's or a draft model's): --mode auto runs
        # baseline and says why; an explicit speculative mode is refused with the reason.
        reason = modes.speculation_blocker(self) or (drafter.speculation_blocker() if drafter else None)
        note = None
        if reason is not None and (drafter is not None or requested == "auto"):
            if requested != "auto":
                raise TandemError(f"--mode {mode} cannot run: {reason}; only --mode baseline works")
            mode, drafter, note = "baseline", None, f"speculation off: {reason}"
        if cap_policy is not None:
            return mode, drafter, cap_policy, getattr(cap_policy, "label", "custom"), note
        if max_draft is None and requested == "auto":  # auto picks how far to draft too, and when not to
            max_draft = "auto"
        # A seeded request measures it now all the same: its caps, and so its sample, must not
        # depend on whether the server had measured it yet
        cached_only = not self.calibrate_on_request and not seeded
        cap_policy, cap_label = self._cap_policy(mode, drafter, max_draft, seeded=seeded, cached_only=cached_only)
        if cap_policy is None:  # --max-draft auto, no calibration here, and this request may not measure it
            self.uncalibrated.setdefault(requested)
            cap = self.default_cap(mode, drafter)
            waits = f"--max-draft auto: {mode} is not calibrated on this machine yet; a fixed cap of {cap} until it is"
            return mode, drafter, FixedCap(cap), cap, f"{note}; {waits}" if note else waits
        if max_draft == "auto":
            self.uncalibrated.pop(requested, None)  # measured now if it was not
        return mode, drafter, cap_policy, cap_label, note

    def prepare(self, mode: str = "auto", max_draft: int | str | None = None,
                progress: Callable[[int, int, str], None] | None = None) -> None:
        """Measure now what the first request with this mode and cap would otherwise measure before
        its first token: the calibration ``--max-draft auto`` prices caps with (once per machine
        and model, then cached; a minute or more on a CPU). ``progress(done, total, stage)`` hears
        of it if it runs (it may raise to stop the measurement: nothing is kept); nothing runs when
        it is cached or the cap is fixed."""
        with self.measuring_calibrations(progress):
            self._decoding(mode, max_draft, None, False)

    @contextmanager
    def measuring_calibrations(self, progress: Callable[[int, int, str], None] | None = None) -> Iterator[None]:
        """Within the block a request whose ``--max-draft auto`` finds no calibration measures it
        first, telling ``progress`` (else ``calibration_progress``); both settings come back after."""
        previous, inline = self.calibration_progress, self.calibrate_on_request
        self.calibration_progress, self.calibrate_on_request = progress or previous, True
        try:
            yield
        finally:
            self.calibration_progress, self.calibrate_on_request = previous, inline

    def defer_calibration(self, mode: str = "auto", max_draft: int | str | None = None) -> None:
        """From now on a request whose ``--max-draft auto`` finds no calibration drafts at the
        mode's fixed cap and says so, and its mode waits in ``uncalibrated`` for ``prepare`` (a
        server measures between requests, so none waits for it); this mode's waits already."""
        self.calibrate_on_request = False
        try:
            self._decoding(mode, max_draft, None, False)
        except TandemError:  # a mode this model cannot run: its requests are refused with the reason
            pass

    def _cap_policy(self, mode: str, drafter: Drafter | None, max_draft: int | str | None,
                    seeded: bool = False, cached_only: bool = False) -> tuple[CapPolicy | None, int | str]:
        """The cap policy and its label; ``cached_only``: no auto policy (None) where this machine
        has no calibration to price it with."""
        if drafter is None:
            return FixedCap(0), 0
        if max_draft is None:
            cap = self.default_cap(mode, drafter)
            return FixedCap(cap), cap
        if max_draft == "auto":  # seeded: caps from the calibration and acceptance only (reproducible)
            return modes.auto_cap_policy(self, mode, drafter, seeded=seeded, cached_only=cached_only), "auto"
        cap = int(max_draft)
        if cap < 0:
            raise TandemError(f"max-draft must be >= 0 or 'auto', got {max_draft}")
        if cap == 0:  # 0 means "the drafter's full block" (DFlash convention)
            cap = drafter.max_draft
        return FixedCap(cap), cap

    def _final_text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False) if tokens else ""

    def _tokens_before_stop(self, tokens: list[int], text: str, stop: Sequence[str]) -> list[int]:
        """Keep the tokens up to and including the one that completed the stop string."""
        cut = len(_cut_at_stop(text, stop))
        for n in range(1, len(tokens) + 1):
            if len(self.tokenizer.decode(tokens[:n], skip_special_tokens=False)) > cut:
                return tokens[:n]
        return tokens


def _has_images(prompt: Prompt) -> bool:
    from engine.vision import has_images

    return not isinstance(prompt, str) and has_images(prompt)


def _one_turn(content: Any, system: str | None) -> list[dict]:
    """A text prompt (or its content parts) as chat messages: the system prompt, then the user's."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]


def _set_history(drafter: Drafter | None, history: SuffixIndex | None) -> None:
    """The index a lookup drafter (alone or in front of a model drafter) drafts from for this
    request (None: none). A batch row's fork keeps the one its request was planned with."""
    for d in (drafter, getattr(drafter, "lookup", None)):
        if hasattr(d, "history"):
            d.history = history


def _save_history_at_exit(ref: Any) -> None:
    engine = ref()
    if engine is not None:
        engine.save_history()


def _cut_at_stop(text: str, stop: Sequence[str]) -> str:
    hits = [text.find(s) for s in stop if s and s in text]
    return text[: min(hits)] if hits else text
