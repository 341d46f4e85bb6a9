"""The target model wrapper: logits for chosen rows, a hidden-state tap, cache transactions.

mlx-lm models return logits only. DSpark and DFlash drafters read the residual stream after a
few decoder layers ("tap layers"), so the wrapper swaps those layers for thin proxies that keep
their output. The model's own forward still runs, so the tapped logits are the model's logits
by construction; the load-time probe proves it anyway (and catches a model whose forward does
something the proxy breaks) and refuses the tap otherwise. Tap id ``FINAL`` is the final norm's
output, the lm_head input at every row (native MTP heads read it); its probe also checks that the
head applied to the captured rows gives the model's logits.

The forward is split into trunk (``model.model``: embeddings, layers, final norm) and head
(``lm_head`` or the tied embedding), so prefill and plain steps apply the head to the rows that
matter only. The split is probed as well; when it does not reproduce the model's logits the
wrapper falls back to the full model call.

A verify forward runs inside a cache transaction (engine/caches.py): ``verify`` returns it and the
loop commits the accepted rows. Models with recurrent state get a recorder (engine/recurrent.py)
whose rollback is proved on the model at load; a cache the engine cannot roll back is reported by
``speculation_blocker`` and the model runs baseline only.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from engine import batch_cache, caches, compiled, cuda_skinny, recurrent
from engine.errors import TandemError
from engine.platform import backend
from engine.shapes import ShapePolicy, default_policy

log = logging.getLogger("tandem.target")

PROBE_TOLERANCE = 1e-3
LOW_PRECISION_TOLERANCE = 2e-2  # bf16/fp16 models: rounding of differently chunked forwards
PREFILL_CHUNK = 512
FINAL = -1  # tap id of the final norm's output (the lm_head input)


class _TapSink:
    """Where the tap proxies leave their layer outputs during one forward."""

    def __init__(self) -> None:
        self.enabled = False
        self.outputs: dict[int, mx.array] = {}


class TapLayer(nn.Module):
    """Runs the wrapped decoder layer unchanged and records its output when enabled."""

    def __init__(self, layer: nn.Module, index: int, sink: _TapSink):
        super().__init__()
        self.layer = layer
        self.tap_index = index
        self.sink = sink

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        out = self.layer(*args, **kwargs)
        if self.sink.enabled:
            self.sink.outputs[self.tap_index] = out
        return out

    def __getattr__(self, name: str) -> Any:
        # Models read per-layer attributes (use_sliding, layer_type, ...) through the list.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)


def _trunk(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        lm = getattr(model, "language_model", None)
        inner = getattr(lm, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        inner = getattr(model, "backbone", None)  # Nemotron-H, Mamba
    if inner is None or not hasattr(inner, "layers"):
        raise TandemError(f"{type(model).__module__}: no decoder layer list found; this architecture is not supported")
    return inner


def prefill_bounds(length: int, offset: int = 0, stops: Sequence[int] = (), chunk: int = PREFILL_CHUNK) -> list[int]:
    """Where the prefill chunks of ``length`` prompt tokens after ``offset`` cached ones start and
    end, counted from the first of them: at multiples of ``chunk`` from token 0 (so a restored
    prefix leaves the boundaries of a prefill from token 0), at ``stops`` and at the end."""
    first = min(length, chunk - offset % chunk)
    return sorted({0, *range(first, length, chunk), *(s for s in stops if 0 < s < length), length})


class Target:
    """A loaded mlx-lm model with the calls the verify loop needs."""

    def __init__(self, model: nn.Module, tokenizer: Any = None, name: str = "target",
                 rollback_method: str | None = None, shapes: ShapePolicy | None | str = "default"):
        """``rollback_method``: how recurrent state is rewound (engine/recurrent.py); default
        from TANDEM_RECURRENT_ROLLBACK, else per-position states. ``shapes``: the stable-shape
        policy (engine/shapes.py; default: the backend's)."""
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.trunk = _trunk(model)
        self.layers = self.trunk.layers
        self.num_layers = len(self.layers)
        self.tap_layers: tuple[int, ...] = ()
        self._sink = _TapSink()
        self.forwards = 0  # target forward passes, for telemetry
        self.kv_bits: int | None = None  # full-attention layers' K/V quantized to these bits
        self.shapes: ShapePolicy | None = None  # stable attention/verify shapes (engine/shapes.py), set last
        self.shapes_refused = ""  # why the backend's shape policy is off for this model ("" = it is not)
        # An image prompt's input embeddings for prompt rows [start, end), or None for plain token
        # rows (engine/vision.py); set for one prefill by ``prompt_embeddings``.
        self._embeddings: Callable[[int, int], mx.array | None] | None = None
        fresh = make_prompt_cache(model)
        self._blocker = caches.blocker(fresh)
        self.recorder = None
        if self._blocker is None and caches.has_recurrent(fresh):
            self.recorder = recurrent.Recorder(self.layers, rollback_method)
        probe = self._probe_ids()
        reference = self._full_logits(probe)
        self._split = False
        # The residual width, read from a forward (a quantized embedding's weight is packed).
        self.hidden_size = int(self.trunk(probe, make_prompt_cache(self.model)).shape[-1])
        try:
            self._split = _close(self._split_logits(probe), reference)
        except Exception:  # a model whose trunk has a different signature: use the full call
            self._split = False
        self.vocab_size = int(reference.shape[-1])
        self._switch = compiled.Switch()
        self.compiled_off = self._install_compiled()  # why small forwards run uncompiled ("" = they don't)
        self._skinny = cuda_skinny.Switch()
        self.skinny_off = self._install_skinny()  # why verifies run cuBLAS's matmuls ("" = they don't)
        if self.recorder is not None:
            self._blocker = self._prove_rollback()
        self.set_shapes(default_policy() if shapes == "default" else shapes)

    # -- construction helpers -------------------------------------------------------------
    def _probe_ids(self) -> mx.array:
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", 32) or 32
        return mx.array([[1 % vocab, 7 % vocab, 3 % vocab, 11 % vocab]])

    def _full_logits(self, ids: mx.array) -> mx.array:
        out = self.model(ids, cache=make_prompt_cache(self.model))
        mx.eval(out)
        return out

    def _split_logits(self, ids: mx.array) -> mx.array:
        out = self.head(self.trunk(ids, make_prompt_cache(self.model)))
        mx.eval(out)
        return out

    def _install_compiled(self) -> str:
        """Compiled norms and ropes for small forwards (engine.compiled), kept only when the
        logits of a prefill, a step and a verify are bit-identical to the plain forward's."""
        if backend() != "cpu":  # Metal/CUDA run mx.fast's fused kernels; a compiled wrapper only adds calls
            return f"not needed on {backend()}"
        swapped = compiled.swap_modules(self.model, self._switch)
        if not swapped:
            return "no plain RMSNorm or RoPE modules to compile"

        probe = self._probe_ids()

        def forward() -> mx.array:  # a prefill, a step and a verify, on one cache
            cache = make_prompt_cache(self.model)
            rows = [self.model(ids, cache=cache)[0] for ids in (probe, probe[:, :1], probe[:, 1:])]
            return mx.concatenate(rows, axis=0)

        why = compiled.probe(forward, self._switch)
        if why:
            compiled.restore(swapped)
        return why

    def _install_skinny(self) -> str:
        """engine.cuda_skinny's kernel for 2-8-row forwards on CUDA, kept when its self-test
        passes and a verify's logits come as close to the same rows' steps as cuBLAS's do."""
        if backend() != "cuda":
            return f"not needed on {backend()}"
        dtypes = tuple({w.dtype for _, w in tree_flatten(self.model.parameters()) if w.dtype in cuda_skinny.DTYPES})
        why = cuda_skinny.self_test(dtypes)
        if why:
            return why
        swapped = cuda_skinny.swap_modules(self.model, self._skinny)
        if not swapped:
            return "no dense linears"
        probe = mx.concatenate([self._probe_ids()] * 2, axis=1)  # 8 rows
        cache = make_prompt_cache(self.model)
        steps = mx.concatenate([self.model(probe[:, i:i + 1], cache=cache) for i in range(probe.shape[1])], axis=1)
        cublas = self._full_logits(probe)
        self._skinny.on = True
        try:
            skinny = self._full_logits(probe)
        except Exception as e:
            skinny, why = None, f"{type(e).__name__}: {e}"
        finally:
            self._skinny.on = False
        if skinny is not None:
            # A verify's rows already differ from the same rows as steps by rounding (cuBLAS sums
            # in another order than the gemv): the kernel may differ as much, not more.
            gap, inherent = _gap(skinny, steps), _gap(cublas, steps)
            if gap > 2 * inherent and not _close(skinny, steps, _tolerance(steps)):
                why = f"logits {gap:.3g} from a step's (cuBLAS: {inherent:.3g})"
        if why:
            cuda_skinny.restore(swapped)
            log.warning("CUDA skinny matmuls off for %s: %s", self.name, why)
        return why

    def head(self, h: mx.array) -> mx.array:
        outer = getattr(self.model, "language_model", self.model)  # VLM-style wrappers (Qwen3.5)
        if getattr(outer, "lm_head", None) is not None and not getattr(
            getattr(outer, "args", None), "tie_word_embeddings", False
        ):
            return outer.lm_head(h)
        return self.embed_tokens.as_linear(h)

    @property
    def embed_tokens(self) -> nn.Module:
        embed = getattr(self.trunk, "embed_tokens", None)
        return embed if embed is not None else self.trunk.embeddings  # Nemotron-H names it so

    def set_taps(self, layer_ids: Sequence[int]) -> None:
        """Tap the outputs of these decoder layers (0-based; the final layer is refused
        because DSpark/DFlash train on pre-norm residuals) and, for ``FINAL``, of the final
        norm. Probed before use."""
        layer_ids = tuple(int(i) for i in layer_ids)
        if layer_ids == self.tap_layers:
            return
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers - 1 and i != FINAL]
        if FINAL in layer_ids and not isinstance(getattr(self.trunk, "norm", None), nn.Module):
            raise TandemError(f"hidden-state tap refused for {self.name}: it has no final norm ('norm') to tap")
        if bad:
            raise TandemError(
                f"tap layer ids {bad} out of range for {self.name}: it has {self.num_layers} layers "
                f"and the last one ({self.num_layers - 1}) cannot be tapped"
            )
        self.clear_taps()
        probe = self._probe_ids()
        reference = self._full_logits(probe)
        for i in layer_ids:
            if i == FINAL:
                self.trunk.norm = TapLayer(self.trunk.norm, i, self._sink)
            else:
                self.layers[i] = TapLayer(self.layers[i], i, self._sink)
        self.tap_layers = layer_ids
        # The probe compares the tapped forward with the model's own call bit for bit: both run
        # MLX's matmuls (the skinny kernel rounds a verify's rows differently, as cuBLAS does).
        skinny_off, self.skinny_off = self.skinny_off, "off while probing the tap"
        try:
            verify_tap(self, probe, reference)
        except TandemError:
            self.clear_taps()
            raise
        finally:
            self.skinny_off = skinny_off

    def clear_taps(self) -> None:
        for i in self.tap_layers:
            if i == FINAL:
                if isinstance(self.trunk.norm, TapLayer):
                    self.trunk.norm = self.trunk.norm.layer
            elif isinstance(self.layers[i], TapLayer):
                self.layers[i] = self.layers[i].layer
        self.tap_layers = ()

    def set_shapes(self, policy: ShapePolicy | None) -> None:
        """Use ``policy`` when a padded verify on its cache reproduces the plain cache's logits
        (the probe also catches a model whose attention does not take the cache's mask)."""
        self.shapes, self.shapes_refused = None, ""
        if policy is None:
            return
        probe = self._probe_ids()
        try:
            fresh = make_prompt_cache(self.model)
            stable = caches.stabilize(fresh, policy)
            if stable is fresh:
                return  # nothing to stabilize (only rotating windows or recurrent state)
            plain = make_prompt_cache(self.model)
            want = self._two_step_logits(probe, plain)
            got = self._two_step_logits(probe, stable)
        except Exception as e:
            self._refuse_shapes(f"{type(e).__name__}: {e}")
            return
        # bf16/fp16: attention over the whole masked buffer rounds differently from the sliced
        # one (another reduction order), by about an ulp of the logits; fp32 must agree closely.
        if _close(got, want, _tolerance(want)):
            self.shapes = policy
        else:
            self._refuse_shapes(f"a padded verify's logits differ from the plain cache's by "
                                f"{_gap(got, want):.3g} ({want.dtype})")

    def _refuse_shapes(self, reason: str) -> None:
        # Loud: without the policy a CUDA backend compiles new shapes nearly every round.
        self.shapes_refused = reason
        log.warning("stable shapes off for this model: %s", reason)

    def _two_step_logits(self, ids: mx.array, cache: list) -> mx.array:
        """A 1-row then a 3-row forward on one cache: a step, then a verify after it."""
        self.model(ids[:, :1], cache=cache)
        out = self.model(ids[:, 1:], cache=cache)
        mx.eval(out)
        return out

    def verify_width(self, width: int) -> int:
        """Rows a verify of ``width`` tokens runs at (padded to the shape ladder, or exact)."""
        return self.shapes.pad(width) if self.shapes is not None else width

    # -- the calls the loop makes -------------------------------------------------------------
    def new_cache(self) -> list:
        cache = make_prompt_cache(self.model)
        if self.kv_bits:
            return caches.quantize_kv(cache, self.kv_bits)
        return caches.stabilize(cache, self.shapes)

    def set_kv_bits(self, bits: int | None) -> None:
        """Quantize full-attention K/V to ``bits`` (4 or 8, group size 64; None: off). Probed with
        a forward first; refused in one line when the model's attention cannot take it."""
        if bits is not None and bits not in caches.KV_BITS:
            raise TandemError(f"kv bits must be one of {', '.join(map(str, caches.KV_BITS))}, got {bits}")
        previous, self.kv_bits = self.kv_bits, bits
        if not bits:
            return
        try:
            with self.uncounted():
                logits, _ = self.forward(self._probe_ids(), self.new_cache())
            ok = bool(mx.all(mx.isfinite(logits)).item())
        except Exception as e:  # e.g. a head dim that is not a multiple of the group size
            ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        else:
            why = "non-finite logits"
        if not ok:
            self.kv_bits = previous
            raise TandemError(f"{bits}-bit KV cache refused for {self.name} ({why})")

    def describe_caches(self) -> str:
        """The layer caches by kind and how a verify rolls them back (for ``tandem doctor``)."""
        text = caches.describe(self.new_cache())
        if self.recorder is not None:
            way = "per-position states" if self.recorder.method == "states" else "replay"
            text += f"; recurrent state rewound by {way}"
        return text

    def speculation_blocker(self) -> str | None:
        """Why rejected drafts cannot be rolled back out of this model's caches (speculation is
        refused and baseline runs), or None."""
        return self._blocker

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Forwards inside the block are not generation work: the telemetry counter comes back after
        (load-time proofs, checks, a benchmark's clean re-runs)."""
        forwards = self.forwards
        try:
            yield
        finally:
            self.forwards = forwards

    @contextmanager
    def prompt_embeddings(self, embeddings: Callable[[int, int], mx.array | None] | None) -> Iterator[None]:
        """While open, ``prefill`` asks ``embeddings(start, end)`` for the input embeddings of
        prompt rows [start, end) (an image prompt's) and feeds the token ids where it gives None."""
        previous, self._embeddings = self._embeddings, embeddings
        try:
            yield
        finally:
            self._embeddings = previous

    def forward(
        self, ids: mx.array, cache: list, *, last_only: bool = False, tap: bool = False,
        embeds: mx.array | None = None,
    ) -> tuple[mx.array, mx.array | None]:
        """One target forward over ``ids`` [1, L] appended to ``cache``; ``embeds`` [1, L, H]: the
        input embeddings of those rows instead of the tokens' (an image prompt's prefill).

        Returns lazy (logits [L, V] or [1, V] when last_only, hidden [L, n_taps * H] or None).
        """
        logits, hidden = self._run(ids, cache, last_only, tap, embeds)
        return logits[0], None if hidden is None else hidden[0]

    def forward_rows(self, ids: mx.array, row_caches: Sequence[list], *, tap: bool = False
                     ) -> tuple[mx.array, mx.array | None]:
        """One forward over B sequences at once: ``ids`` [B, L], row b appended to its own caches
        ``row_caches[b]`` (engine/batch_cache.py; every layer's cache must batch). Returns lazy
        (logits [B, L, V], hidden [B, L, n_taps * H] or None)."""
        logits, hidden, txns = self.verify_rows(ids, row_caches, tap=tap)
        for txn in txns:
            txn.commit(int(ids.shape[1]))
        return logits, hidden

    def verify_rows(self, ids: mx.array, row_caches: Sequence[list], *, tap: bool = False
                    ) -> tuple[mx.array, mx.array | None, list[caches.Verify]]:
        """``forward_rows`` inside one cache transaction per row: ``txns[b].commit(kept)`` keeps
        row b's first ``kept`` rows, recurrent state included (per-position states, recorded
        for the whole batch at once)."""
        width = int(ids.shape[1])
        view = batch_cache.batch_view(row_caches)
        before = batch_cache.recurrent_slots(view)
        txns = [batch_cache.RowVerify(c, width, b) for b, c in enumerate(row_caches)]  # marks before the forward
        recording = None
        if before and width > 1:
            with self.recorder.record() as recording:
                logits, hidden = self._run(ids, view, False, tap)
        else:
            logits, hidden = self._run(ids, view, False, tap)
        picks = batch_cache.recurrent_picks(view, before, width, recording)
        for txn in txns:
            txn.picks = picks
        return logits, hidden, txns

    def batch_blocker(self) -> str | None:
        """Why requests on this target cannot share a forward, or None when they can."""
        reason = batch_cache.batchable(self.new_cache())
        if reason is None and self.recorder is not None and self.recorder.method != "states":
            reason = "its recurrent state is rewound by replay, which does not batch"
        return reason

    def _run(self, ids: mx.array, cache: list, last_only: bool, tap: bool, embeds: mx.array | None = None
             ) -> tuple[mx.array, mx.array | None]:
        self.forwards += 1
        self._sink.enabled = tap and bool(self.tap_layers)
        self._sink.outputs = {}
        self._switch.set(not self.compiled_off and ids.shape[1] <= compiled.MAX_WIDTH)
        self._skinny.on = not self.skinny_off and 2 <= ids.shape[1] <= cuda_skinny.MAX_ROWS
        try:
            extra = {} if embeds is None else {"input_embeddings": embeds}
            if self._split:
                h = self.trunk(ids, cache, **extra)
                logits = self.head(h[:, -1:] if last_only else h)
            else:
                logits = self.model(ids, cache=cache, **extra)
                if last_only:
                    logits = logits[:, -1:]
            hidden = None
            if self._sink.enabled:
                hidden = mx.concatenate([self._sink.outputs[i] for i in self.tap_layers], axis=-1)
        finally:
            self._sink.enabled = False
            self._sink.outputs = {}
            self._switch.set(False)
            self._skinny.on = False
        return logits, hidden

    def prefill(self, ids: Sequence[int], cache: list, *, tap: bool = False, chunk: int = PREFILL_CHUNK,
                progress: Any = None, offset: int = 0, stops: Sequence[int] = ()) -> tuple[mx.array, mx.array | None]:
        """Run the prompt through the target in chunks (bounded memory). Returns the last
        row's logits [V] and, when tapping, hidden states for every prompt row.

        ``offset``: tokens ``cache`` already holds (a restored prefix). Chunks end at multiples of
        ``chunk`` counted from token 0: after a restored prefix, chunk boundaries fall where a
        prefill from token 0 puts them. ``stops``: positions in ``ids`` where a chunk must end
        too (``progress`` is called there: the prefix cache snapshots a state to restore)."""
        ids = list(ids)
        hiddens = []
        logits = None
        bounds = prefill_bounds(len(ids), offset, stops, chunk)
        for start, end in zip(bounds, bounds[1:]):
            part = mx.array([ids[start:end]])
            embeds = self._embeddings(offset + start, offset + end) if self._embeddings is not None else None
            logits, hidden = self.forward(part, cache, last_only=True, tap=tap, embeds=embeds)
            if hidden is not None:
                hiddens.append(hidden)
            mx.eval(logits, *(c.state for c in cache if hasattr(c, "state")), *(hiddens[-1:] if hiddens else []))
            if progress is not None:
                progress(end, len(ids))
        hidden = mx.concatenate(hiddens, axis=0) if hiddens else None
        return logits[-1], hidden

    def verify(self, ids: mx.array, cache: list, *, tap: bool = False
               ) -> tuple[mx.array, mx.array | None, caches.Verify]:
        """``forward`` inside a cache transaction: commit the accepted rows with
        ``txn.commit(kept)`` and the caches end as if only those had been fed."""
        width = int(ids.shape[1])
        txn = caches.Verify(cache, width, rerun=lambda kept: self._feed(ids[:, :kept], cache))
        if self.recorder is None or width == 1:
            logits, hidden = self.forward(ids, cache, tap=tap)
            return logits, hidden, txn
        with self.recorder.record() as recording:
            logits, hidden = self.forward(ids, cache, tap=tap)
        txn.rewinder = recording
        return logits, hidden, txn

    def _feed(self, ids: mx.array, cache: list) -> None:
        """Append ``ids`` to the caches (no logits needed)."""
        self.forwards += 1
        if self._split:
            self.trunk(ids, cache)
        else:
            self.model(ids, cache=cache)

    def _prove_rollback(self) -> str | None:
        """Prove on this model that a verify keeping 2 of 5 rows leaves the recurrent caches as a
        clean forward over the kept tokens would (state and next logits); try the other method
        when the chosen one fails. The reason speculation is refused, or None."""
        ids = [(5 * i + 3) % max(2, self.vocab_size) for i in range(9)]
        errors = []
        with self.uncounted():
            for method in (self.recorder.method, *(m for m in recurrent.METHODS if m != self.recorder.method)):
                self.recorder.method = method
                try:
                    error = self._rollback_error(ids)
                except Exception as e:  # a layer the recorder cannot replay
                    error = f"{type(e).__name__}: {e}"
                if error is None:
                    return None
                errors.append(f"{method}: {error}")
        return f"rolling back its recurrent state failed the load-time check ({'; '.join(errors)})"

    def _rollback_error(self, ids: list[int]) -> str | None:
        # The clean reference is fed in the same chunks (3 rows, then the 2 kept ones): a wrong
        # rollback moves states and logits by their own size, while bf16 rounding of a different
        # chunking alone moves them by ~1% (measured on Nemotron-H).
        cache, clean = self.new_cache(), self.new_cache()
        for c in (cache, clean):
            self.forward(mx.array([ids[:3]]), c)
        _, _, txn = self.verify(mx.array([ids[3:8]]), cache)
        txn.commit(2)
        self.forward(mx.array([ids[3:5]]), clean)
        nxt = mx.array([[ids[8]]])
        got, want = self.forward(nxt, cache)[0], self.forward(nxt, clean)[0]
        mx.eval(got, want)
        tolerance = _tolerance(want)
        if not _close(got, want, tolerance):
            return f"next logits differ by {mx.abs(got - want).max().item():.3g}"
        for a, b in zip(caches.leaves(cache), caches.leaves(clean)):
            if type(a) is caches.ArraysCache and not all(
                    (x is None) == (y is None) and (x is None or _close(x, y, tolerance, relative=True))
                    for x, y in zip(a.cache, b.cache)):
                return "recurrent state differs from a clean forward"
        return None


def verify_tap(target: Target, probe: mx.array, reference: mx.array) -> None:
    """Refuse a tap whose forward does not reproduce the model's own logits, or whose
    captured rows are not [L, H] per tapped layer."""
    logits, hidden = target.forward(probe, target.new_cache(), tap=True)
    target.forwards -= 1  # probes are not generation work
    mx.eval(logits, hidden)
    if not _close(logits[None], reference):
        diff = mx.abs(logits[None] - reference).max().item()
        raise TandemError(f"hidden-state tap refused for {target.name}: tapped logits differ from the model's by {diff:.3g}")
    want = (probe.shape[1], len(target.tap_layers) * target.hidden_size)
    if hidden is None or tuple(hidden.shape) != want:
        got = None if hidden is None else tuple(hidden.shape)
        raise TandemError(f"hidden-state tap refused for {target.name}: captured shape {got}, expected {want}")
    if not mx.all(mx.isfinite(hidden)).item():
        raise TandemError(f"hidden-state tap refused for {target.name}: captured states are not finite")
    if FINAL in target.tap_layers:  # the captured rows must be what the head reads
        h = target.hidden_size
        i = target.tap_layers.index(FINAL)
        if not _close(target.head(hidden[:, i * h : (i + 1) * h])[None], reference):
            raise TandemError(f"hidden-state tap refused for {target.name}: its final norm's output is not its lm_head input")


def _tolerance(reference: mx.array) -> float:
    """How close a probe must come to ``reference``: fp32 closely, bf16/fp16 within their rounding."""
    return PROBE_TOLERANCE if reference.dtype == mx.float32 else LOW_PRECISION_TOLERANCE


def _gap(a: mx.array, b: mx.array) -> float:
    """The largest elementwise difference, in float32."""
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def _close(a: mx.array, b: mx.array, tolerance: float = PROBE_TOLERANCE, relative: bool = False) -> bool:
    """Within ``tolerance`` of ``b``'s largest magnitude (at least 1 unless ``relative``)."""
    if a.shape != b.shape:
        return False
    scale = mx.abs(b.astype(mx.float32)).max().item()
    scale = scale if relative else max(1.0, scale)
    return _gap(a, b) <= tolerance * max(scale, 1e-30)
