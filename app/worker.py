"""The engine worker: the ONLY module of the app that touches MLX (and the engine modules that
import it). It lives in one long-lived QThread and does every MLX call there: load, generate,
race, calibrate. MLX streams are thread-bound (MLX >= 0.31.2), so everything is created here.

Views never call this directly: they emit the ``Bridge``'s request signals (queued into this
thread) and listen to its reply signals. Cancellation is read from the bridge between rounds,
so a Stop takes effect within one verify round. Every job catches its errors and reports them
as one line: a failed load keeps the previous model; a failed lane does not end a race.

While the app serves its model (app.serving), chat messages and the server's requests decode
together in one batch that this thread pumps between its other jobs, one tick per pass of its
event loop; a race or a calibration pauses the batch while it runs. Loading another model first
answers every request in flight on the old one; server requests that come meanwhile wait for
the new one.
"""

from __future__ import annotations

import sys
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from PySide6.QtCore import QObject, Qt, QTimer, Signal, Slot

from app.background import one_line as _one_line
from app.bridge import Bridge
from app.generation import Generation
from app.race_verdict import verdict as race_verdict

EngineFactory = Callable[[Optional[str], Optional[str]], Any]  # (spec, drafter) -> engine.generate.Engine


def _report(err: BaseException) -> None:
    """Log a traceback for unexpected errors; a TandemError is a user-facing one-liner already."""
    from engine.errors import TandemError

    if not isinstance(err, TandemError):
        traceback.print_exception(err, file=sys.stderr)


class EngineWorker(QObject):
    _wake = Signal()  # from the server's HTTP threads: a job is queued for the batch

    def __init__(self, bridge: Bridge, engine_factory: Optional[EngineFactory] = None):
        super().__init__()
        self.bridge = bridge
        self.factory = engine_factory
        self.engine = None
        self._device_sent = False
        self._bandwidth: Optional[float] = None
        self.serving = None  # app.serving.Serving, made in this thread when first switched on
        self._pump_due = False
        self._pumping = False
        self._served: dict = {}  # the serving state last sent to the views
        self._wake.connect(self._kick, Qt.ConnectionType.QueuedConnection)

    @Slot()
    def release(self) -> None:
        """Drop this thread's MLX streams as the thread ends: with MLX 0.32 a thread that ran
        compiled functions can otherwise abort the process at exit. The local server closes
        first and its requests end cancelled."""
        if self.serving is not None:
            try:
                self.serving.shutdown()
            except Exception as err:
                _report(err)
        if "mlx.core" in sys.modules:
            sys.modules["mlx.core"].clear_streams()

    # -- loading ---------------------------------------------------------------------------------
    @Slot(object, object)
    def load(self, spec: Optional[str], drafter: Optional[str]) -> None:
        b = self.bridge
        label = spec or "starter model"
        b.busy_changed.emit(True)
        b.model_loading.emit(label)
        serving = self.serving
        if serving is not None:  # requests in flight end on the model they began on
            serving.pause()
            if serving.busy:
                b.model_loading.emit(f"{label}, once the requests in flight are answered")
                serving.drain()
                b.model_loading.emit(label)
        try:
            import engine  # noqa: F401  (OpenBLAS before mlx.core)

            self._send_device_info()
            if self.factory is not None:
                eng = self.factory(spec, drafter)
            else:
                from engine.api import load

                def timing(done: int, total: int, stage: str) -> None:  # a first load on a CPU: a few seconds
                    if done == 0:
                        b.model_loading.emit(f"{label}: timing this computer's matmuls, once")

                eng = load(spec, drafter=drafter, progress=timing)
            info = self._model_info(eng, spec, drafter)
        except Exception as err:  # the previous engine (if any) stays usable
            _report(err)
            b.model_failed.emit(f"could not load {label}: {_one_line(err)}")
            if serving is not None and self.engine is not None:
                serving.attach(self.engine)
        else:
            previous, self.engine = self.engine, eng
            if serving is not None:
                serving.attach(eng)
            if previous is not None:
                _clear_prefix_cache(previous)  # its cached prefixes would outlive it otherwise
            b.telemetry.set_model(info)
            b.model_loaded.emit(info)
            # after any request already queued (a chat sent while loading goes first)
            QTimer.singleShot(0, lambda: self._after_load(eng, info))
        finally:
            b.busy_changed.emit(False)

    def _send_device_info(self) -> None:
        if self._device_sent:
            return
        from engine import platform

        info = {"backend": platform.backend(), "device": platform.device_name(),
                "memory_bytes": platform.memory_bytes(), "blas": platform.blas_status().state}
        self._device_sent = True
        self.bridge.device_info.emit(info)
        try:  # the Models tab shows registry pairs; reading the registry imports MLX, so it happens here
            from engine import registry

            self.bridge.registry_rows.emit(list(registry.rows()))
        except Exception as err:
            print(f"tandem app: registry unavailable: {_one_line(err)}", file=sys.stderr)

    def _model_info(self, eng, spec: Optional[str], drafter: Optional[str]) -> dict:
        from mlx.utils import tree_flatten

        from engine.roofline import active_weight_bytes, kv_profile
        from engine.serve.chat_format import template_reads

        loaded = getattr(eng, "loaded", None)
        flat = tree_flatten(eng.model.parameters())
        kv = kv_profile(eng.model)
        return {
            "name": eng.name, "spec": spec, "drafter": drafter or eng.drafter_path,
            "path": str(loaded.path) if loaded is not None else None,
            "source": getattr(loaded, "source", "in-memory"),
            "dtype": getattr(loaded, "dtype", None) or _dominant_dtype(flat),
            "quantized": bool(getattr(loaded, "quantized", False)),
            "params": sum(int(v.size) for _, v in flat), "weight_bytes": active_weight_bytes(eng.model),
            "kv": {"layers": [list(layer) for layer in kv.layers], "state": kv.state_bytes},
            "kv_bytes_per_token": kv.bytes_per_token,
            "layers": eng.target.num_layers, "vocab": eng.target.vocab_size,
            "chat_template": bool(getattr(eng.tokenizer, "chat_template", None)),
            "takes_images": bool(getattr(eng, "takes_images", False)),
            "images_note": eng.image_refusal() if hasattr(eng, "image_refusal") else "",
            "thinking_switch": template_reads(eng.tokenizer, "enable_thinking"),
            "can_rollback": eng.target.speculation_blocker() is None,
            "mode_support": _mode_support(eng),
            **_auto_choice(eng),
        }

    def _after_load(self, eng, info: dict) -> None:
        """The roofline needs this machine's bandwidth: from a cached calibration of this model
        if there is one (its curves go to the plot too), else measured once per session."""
        try:
            self._roofline_inputs(eng)
        except Exception as err:  # the roofline goes without a ceiling; the model is usable
            _report(err)

    def _roofline_inputs(self, eng) -> None:
        if eng is not self.engine:  # another model was loaded meanwhile
            return
        cal = None
        try:
            from engine import calibrate

            mode = self._calibration_mode(eng)
            cal = calibrate.load_cached(calibrate.calibration_key(eng, mode, eng.drafter(mode)))
        except Exception as err:
            print(f"tandem app: no cached calibration: {_one_line(err)}", file=sys.stderr)
        if cal is not None:
            self.bridge.telemetry.set_calibration(_curves(cal, mode))
            if cal.bandwidth > 0:
                self._bandwidth = cal.bandwidth
        else:
            self.bridge.telemetry.set_calibration(None)
        if self._bandwidth is None:
            self._bandwidth = _session_bandwidth()
        self.bridge.telemetry.update_model(bandwidth=self._bandwidth)

    @staticmethod
    def _calibration_mode(eng) -> str:
        """The drafter whose curves matter: the one --mode auto would use (lookup at least)."""
        mode = eng.resolve_mode("auto")
        return "lookup" if mode == "baseline" else mode

    @Slot()
    def clear_prefix_cache(self) -> None:
        if self.engine is not None:
            _clear_prefix_cache(self.engine)

    # -- generation --------------------------------------------------------------------------
    def _prompt_for(self, prompt: Any) -> tuple[Any, bool]:
        """Chat messages need a chat template; a model without one gets the turns as plain text."""
        if isinstance(prompt, str):
            return prompt, True
        if getattr(self.engine.tokenizer, "chat_template", None):
            return list(prompt), True
        return "\n".join(m["content"] for m in prompt), False

    def _generation(self, label: str, key: Any, params: dict, on_text: Callable[[str], None],
                    started: Callable[[str, int], None] | None = None, use_template: bool = True) -> Generation:
        from engine.detokenize import StreamingDetokenizer
        from engine.serve.chat_format import template_reads

        detok = StreamingDetokenizer(self.engine.tokenizer)
        run = Generation(self.engine, detok, self.bridge.telemetry, label, key, params, on_text, started)
        thinking = params.get("thinking")  # the chat header's Think toggle, for templates with the switch
        if use_template and thinking is not None and template_reads(self.engine.tokenizer, "enable_thinking"):
            run.kwargs["template_kwargs"] = {"enable_thinking": bool(thinking)}
        return run

    def _stream(self, rid: int, prompt: Any, params: dict, label: str, on_text: Callable[[str], None],
                started: Callable[[str, int], None] | None = None, prefix_cache: bool = True,
                key: Any = None) -> dict:
        """Run one generation on the current engine; returns the result as a plain dict."""
        prompt, use_template = self._prompt_for(prompt)
        run = self._generation(label, key, params, on_text, started, use_template)

        def prefill_progress(done: int, total: int) -> None:
            if self.bridge.is_cancelled(rid):  # Stop or closing during a long prompt: end after this chunk
                raise _Cancelled()

        try:
            with self._calibration_shown(rid):
                for chunk in self.engine.stream(prompt, chat_template=use_template, on_round=run.on_round,
                                                prefix_cache=prefix_cache, prefill_progress=prefill_progress,
                                                cancel=lambda: self.bridge.is_cancelled(rid), **run.kwargs):
                    run.add(chunk)
        except BaseException as err:  # the requests table says how it ended
            self.bridge.telemetry.end(key, error="cancelled" if isinstance(err, _Cancelled) else _one_line(err))
            raise
        return run.finish()

    @contextmanager
    def _calibration_shown(self, rid: int) -> Iterator[None]:
        """A first ``--max-draft auto`` message measures this machine before its first token (once
        per model; a minute or more on a CPU): the message shows how far it got, and Stop ends it
        between two measurements."""
        engine = self.engine
        measured: list[int] = []

        def progress(done: int, total: int, stage: str) -> None:
            measured.append(done)
            if self.bridge.is_cancelled(rid):
                raise _Cancelled()
            self.bridge.gen_calibrating.emit(rid, done, total, stage)

        try:  # the user's own message measures, visibly, where the app's server requests do not
            with engine.measuring_calibrations(progress):
                yield
        finally:
            if measured:  # the Telemetry tab's curves and roofline, from the calibration just made
                self._after_load(engine, {})

    @Slot(int, object, object)
    def generate(self, rid: int, prompt: Any, params: dict) -> None:
        b = self.bridge
        if b.is_cancelled(rid):
            b.gen_failed.emit(rid, "cancelled")
            return
        if self.engine is None:
            b.gen_failed.emit(rid, "no model is loaded (see the Models tab)")
            return
        if self.serving is not None and self.serving.batched:
            self._generate_batched(rid, prompt, params)
            return
        b.busy_changed.emit(True)
        try:
            out = self._stream(rid, prompt, params, f"chat | {params.get('mode', 'auto')}",
                               on_text=lambda text: b.gen_text.emit(rid, text),
                               started=lambda mode, n: b.gen_started.emit(rid, {"mode": mode, "prompt_tokens": n}),
                               key=("chat", rid))
        except _Cancelled:  # stopped during the prefill: nothing was generated
            b.gen_failed.emit(rid, "cancelled")
        except Exception as err:
            _report(err)
            b.gen_failed.emit(rid, _one_line(err))
        else:
            b.gen_finished.emit(rid, out)
        finally:
            b.busy_changed.emit(False)

    def _generate_batched(self, rid: int, prompt: Any, params: dict) -> None:
        """The chat message joins the batch it shares with the server's requests; its chunks and
        its answer come as the batch is pumped (the same signals, the same text as alone)."""
        b, serving = self.bridge, self.serving
        text, use_template = self._prompt_for(prompt)
        run = self._generation(f"chat | {params.get('mode', 'auto')}", ("chat", rid), params,
                               on_text=lambda piece: b.gen_text.emit(rid, piece),
                               started=lambda mode, n: b.gen_started.emit(rid, {"mode": mode, "prompt_tokens": n}),
                               use_template=use_template)

        def on_chunk(chunk: Any) -> None:
            run.add(chunk)
            if chunk.result is not None:
                b.gen_finished.emit(rid, run.finish())

        def on_error(err: BaseException) -> None:
            _report(err)
            b.telemetry.end(("chat", rid), error=_one_line(err))
            b.gen_failed.emit(rid, _one_line(err))

        try:
            with serving.tokenizer_lock, self._calibration_shown(rid):  # the lock: not while a handler thread
                serving.batcher_for(self.engine).submit(  # settles a new tokenizer (serve/routes.py)
                    text, chat_template=use_template, on_chunk=on_chunk, on_error=on_error, on_round=run.on_round,
                    cancel=lambda: b.is_cancelled(rid), **run.kwargs)
        except _Cancelled:  # Stop while its calibration ran: it never joined
            b.telemetry.end(("chat", rid), error="cancelled")
            b.gen_failed.emit(rid, "cancelled")
        except Exception as err:  # a bad setting: refused before it joined
            on_error(err)
        else:
            self._kick()

    # -- the local server (app.serving) ------------------------------------------------------------
    @Slot(object)
    def serve(self, options: Optional[dict]) -> None:
        """Switch the local server on (``{"port": int, "api_key": str | None}``) or off (None)."""
        if options is None:
            if self.serving is not None:
                self.serving.stop()
                self._kick()  # the requests in flight go on
            self._send_serving()
            return
        if self.engine is None:
            self._send_serving("no model is loaded (see the Models tab)")
            return
        if self.serving is None:
            from app.serving import Serving
            from engine.batching import DEFAULT_MAX_BATCH

            self.serving = Serving(self._wake.emit, self._server_event, DEFAULT_MAX_BATCH)
        try:
            self.serving.start(self.engine, int(options.get("port") or 0), options.get("api_key") or None)
        except Exception as err:  # the port is taken, most often
            _report(err)
            self._send_serving(_one_line(err))
        else:
            self._send_serving()

    def _send_serving(self, error: str = "") -> None:
        state = self.serving.state() if self.serving is not None else {"on": False}
        self._served = state
        self.bridge.serving_changed.emit({**state, "error": error} if error else state)

    def _server_event(self, ev: dict) -> None:
        """A server request's telemetry (engine.serve.worker's /events dicts) into the Telemetry tab."""
        tel, key, kind = self.bridge.telemetry, ("server", ev["id"]), ev["type"]
        if kind == "request":
            tel.begin(f"server: {_DIALECTS.get(ev.get('endpoint', ''), ev.get('endpoint', ''))}", key)
        elif kind == "round":
            tel.push_round(ev, key)
        elif kind in ("result", "error"):
            tel.end(key, ev if kind == "result" else None, ev.get("message", ""))

    @Slot()
    def _kick(self) -> None:
        """Pump the batch on the next pass of this thread's event loop (once, however often asked)."""
        if not self._pump_due:
            self._pump_due = True
            QTimer.singleShot(0, self._pump)

    def _pump(self) -> None:
        self._pump_due = False
        serving = self.serving
        if serving is None:
            return
        try:
            more = serving.pump()
        except Exception as err:  # a bug must not stop the worker; the batch's own errors fail its requests
            _report(err)
            more = False
        batcher = serving.batcher
        self.bridge.telemetry.set_batch_width(batcher.occupancy if batcher is not None else 0)
        if serving.state() != self._served:  # requests in flight changed: the switch's status line follows
            self._send_serving()
        if more != self._pumping:
            self._pumping = more
            self.bridge.busy_changed.emit(more)
        if more:
            self._kick()

    # -- race ----------------------------------------------------------------------------------
    @Slot(int, object, object, object)
    def race(self, rid: int, prompt: Any, modes: list, params: dict) -> None:
        """Run each mode in turn (same prompt, settings and seed; each stream makes a fresh cache),
        then compare every lane's tokens with baseline's."""
        b = self.bridge
        modes = ["baseline"] + [m for m in modes if m != "baseline"]
        lanes: list[dict] = []
        if self.engine is None:
            b.race_finished.emit(rid, {"lanes": [], "verdicts": [], "error": "no model is loaded"})
            return
        b.busy_changed.emit(True)
        try:
            seed = params.get("seed")
            params = dict(params, seed=0 if seed is None else seed)
            for i, mode in enumerate(modes):
                if b.is_cancelled(rid):
                    lanes.append({"mode": mode, "error": "cancelled"})
                    b.race_lane_finished.emit(rid, i, lanes[-1])
                    continue
                b.race_lane_started.emit(rid, i, mode)
                try:
                    lane = self._stream(rid, prompt, dict(params, mode=mode), f"race | {mode}",
                                        on_text=lambda text, i=i: b.race_lane_text.emit(rid, i, text),
                                        prefix_cache=False, key=("race", rid, i))  # every lane prefills alike
                    lane["mode_requested"] = mode
                except _Cancelled:
                    lane = {"mode": mode, "error": "cancelled"}
                except Exception as err:
                    _report(err)
                    lane = {"mode": mode, "error": _one_line(err)}
                lanes.append(lane)
                b.race_lane_finished.emit(rid, i, lane)
            verdicts = self._verdicts(prompt, lanes, params, rid)
            b.race_finished.emit(rid, {"lanes": lanes, "verdicts": verdicts})
        except Exception as err:
            _report(err)
            b.race_finished.emit(rid, {"lanes": lanes, "verdicts": [], "error": _one_line(err)})
        finally:
            b.busy_changed.emit(False)

    def _verdicts(self, prompt: Any, lanes: list[dict], params: dict,
                  rid: Optional[int] = None) -> list[Optional[dict]]:
        base = lanes[0] if lanes else None
        if not base or "error" in base:
            return [None for _ in lanes]
        greedy = float(params.get("temperature") or 0.0) <= 0.0
        ref = base["token_ids"]
        finish = {"reference_finish": base.get("finish_reason", "")}
        out: list[Optional[dict]] = [None]
        for lane in lanes[1:]:
            if "error" in lane:
                out.append(None)
                continue
            cand = lane["token_ids"]
            kw = dict(finish, candidate_finish=lane.get("finish_reason", ""), greedy=greedy)
            v = race_verdict(ref, cand, **kw)
            if v.status == "diverged":
                try:
                    margin, gap, expected, got = self._margin_at(prompt, ref[: v.index], v.expected, v.got, rid)
                except _Cancelled:  # the race was stopped: the divergence stays unexplained
                    pass
                else:
                    names = {t: self.engine.tokenizer.decode([t]) for t in (expected, got) if t is not None}
                    v = race_verdict(ref, cand, margin=margin, gap=gap, token_text=names, **kw)
            out.append({"status": v.status, "index": v.index, "expected": v.expected, "got": v.got,
                        "margin": v.margin, "gap": v.gap, "text": v.text, "ok": v.ok})
        return out

    def _margin_at(self, prompt: Any, prefix: list[int], expected: Optional[int], got: Optional[int],
                   rid: Optional[int] = None) -> tuple[float, Optional[float], Optional[int], Optional[int]]:
        """Re-run prompt + baseline's prefix on a clean cache, one forward; return the target's
        top-1 minus top-2 logit and its logit of ``expected`` minus that of ``got`` there. None
        (a lane ended there) stands for the EOS token the target rates highest: the one greedy
        picked if it picked EOS."""
        import mlx.core as mx

        eng = self.engine
        text, use_template = self._prompt_for(prompt)
        ids = eng.encode(text, chat_template=use_template) + list(prefix)

        def progress(done: int, total: int) -> None:
            if rid is not None and self.bridge.is_cancelled(rid):
                raise _Cancelled()

        logits, _ = eng.target.prefill(ids, eng.target.new_cache(), progress=progress)
        logits = logits.astype(mx.float32)
        top2 = mx.sort(logits)[-2:]
        mx.eval(top2, logits)
        eos = [int(t) for t in (getattr(eng.tokenizer, "eos_token_ids", None) or [])]
        best_eos = max(eos, key=lambda t: logits[t].item()) if eos else None
        expected = best_eos if expected is None else expected
        got = best_eos if got is None else got
        margin = float(top2[1].item() - top2[0].item())
        gap = None if expected is None or got is None else float(logits[expected].item() - logits[got].item())
        return margin, gap, expected, got

    # -- calibration ---------------------------------------------------------------------------
    @Slot(int, object)
    def calibrate(self, rid: int, params: Optional[dict] = None) -> None:
        """Measure this machine's cost curves for the loaded model and its drafter (the
        calibrator's own measurement, cached by it), with progress; Cancel aborts between steps."""
        b = self.bridge
        if self.engine is None:
            b.calib_failed.emit(rid, "no model is loaded")
            return
        b.busy_changed.emit(True)
        try:
            from engine import calibrate

            mode = self._calibration_mode(self.engine)

            def progress(done: int, total: int, stage: str) -> None:
                if b.is_cancelled(rid):
                    raise _Cancelled()
                b.calib_progress.emit(rid, done, total, stage)

            b.calib_progress.emit(rid, 0, 1, f"{mode} drafter")
            cal = calibrate.calibrate(self.engine, mode, recalibrate=True, progress=progress, **(params or {}))
        except _Cancelled:
            b.calib_failed.emit(rid, "cancelled")
        except Exception as err:
            _report(err)
            b.calib_failed.emit(rid, _one_line(err))
        else:
            curves = _curves(cal, mode)
            if cal.bandwidth > 0:
                self._bandwidth = cal.bandwidth
                b.telemetry.update_model(bandwidth=cal.bandwidth)
            b.telemetry.set_calibration(curves)
            b.calib_finished.emit(rid, curves)
        finally:
            b.busy_changed.emit(False)


class _Cancelled(Exception):
    pass


# What the Telemetry tab calls a server request, by route (engine.serve.routes)
_DIALECTS = {"/chat/completions": "OpenAI chat", "/completions": "OpenAI completion", "/messages": "Anthropic"}


# -- helpers (run in the worker thread) ----------------------------------------------------------
def _clear_prefix_cache(eng) -> None:
    try:
        eng.clear_prefix_cache()
    except Exception as err:
        _report(err)


def _auto_choice(eng) -> dict:
    """What --mode auto runs on this engine, and with which drafter (for the chat's header)."""
    from engine import registry
    from engine.modes import CHECKPOINT_MODES

    try:
        mode = eng.resolve_mode("auto")
        drafter = eng.drafter_path
        if drafter is None and mode in (*CHECKPOINT_MODES, "mtp"):  # a registry row's drafter
            row = registry.usable_row(eng, mode, for_auto=True)
            drafter = row.get("drafter") if row else None
    except Exception as err:  # the header goes without it; generation reports its own errors
        print(f"tandem app: auto mode unknown: {_one_line(err)}", file=sys.stderr)
        return {}
    return {"auto_mode": mode, "auto_drafter": drafter}


def _mode_support(eng) -> Optional[dict]:
    """{mode: None (runs) or why it cannot}; None = unknown (the engine could not tell)."""
    try:
        return {str(mode): (None if why is None else str(why)) for mode, why in eng.mode_support().items()}
    except Exception as err:
        _report(err)
        return None


def _dominant_dtype(flat) -> str:
    sizes: dict[str, int] = {}
    for _, v in flat:
        name = str(v.dtype).replace("mlx.core.", "")
        sizes[name] = sizes.get(name, 0) + int(v.size)
    return max(sizes, key=sizes.get) if sizes else "?"


_BANDWIDTH: list[float] = []  # measured once per process: the machine's bandwidth doesn't change


def _session_bandwidth() -> float:
    if not _BANDWIDTH:
        from engine.roofline import measure_bandwidth

        _BANDWIDTH.append(measure_bandwidth(repeats=3))
    return _BANDWIDTH[0]


def _curves(cal, mode: str) -> dict:
    """A calibration as plain numbers for the plot (no MLX objects cross the bridge)."""
    from engine.cost_model import static_cap

    return {"mode": mode, "widths": list(cal.widths), "verify_ms": list(cal.verify_ms),
            "verify_fit": [cal.verify(w) for w in cal.widths], "draft_caps": list(cal.draft_caps),
            "draft_ms": list(cal.draft_ms), "overhead_ms": cal.overhead_ms, "step_overhead_ms": cal.step_overhead_ms,
            "bandwidth": cal.bandwidth, "context": cal.context, "default_cap": static_cap(cal),
            "seconds": cal.seconds, "from_cache": bool(cal.from_cache)}
