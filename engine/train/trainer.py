"""One drafter being trained: a fresh DSpark model shaped for the target, its optimizer, data,
checkpoints with exact resume, and the acceptance report through the real engine loop.

The exported drafter sets ``use_target_embeddings: true`` in its config.json: the frozen
embedding and head are left out of ``model.safetensors`` (they are the target's, 2·V·H floats)
and the loader fills them from the target (``engine/drafters/checkpoint.py``).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from engine.errors import TandemError
from engine.train.config import TrainConfig, lr_at
from engine.train.data import (Example, batch_at, batches_per_epoch, content_class, draft_vocabulary, make_batch,
                               usable)
from engine.train.loss import batch_arrays, check_target_states, dspark_loss, target_side, target_states

OPENING_TOKENS = 128  # `val_walk128`: the walk over each answer's first tokens, tandem benchmark's default length


def default_mask_token(tokenizer: Any, vocab_size: int) -> int:
    """The tokenizer's mask token, else its highest-id added token outside the special set
    (SmolLM2: ``<empty_output>``, never produced in chat), else a special token that is not
    BOS/EOS/pad, else the last vocab id. The mask's embedding is the frozen target's, so any
    id the model does not emit in use will do."""
    tok = getattr(tokenizer, "_tokenizer", tokenizer)
    mid = getattr(tok, "mask_token_id", None)
    if isinstance(mid, int) and 0 <= mid < vocab_size:
        return mid
    reserved = {getattr(tok, n, None) for n in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    reserved |= set(getattr(tokenizer, "eos_token_ids", None) or [])
    in_use = set(getattr(tok, "all_special_ids", None) or [])  # chat markers, EOS...
    try:
        added = set((tok.get_added_vocab() or {}).values())
    except Exception:
        added = set()
    for pool in (added - in_use, in_use):
        ids = [i for i in pool if i not in reserved and 0 <= i < vocab_size]
        if ids:
            return max(ids)
    return vocab_size - 1


def target_config_of(engine: Any) -> dict:
    """The target's HF-style config (the loaded config.json, else the mlx-lm model's args)."""
    loaded = getattr(engine, "loaded", None)
    if loaded is not None and getattr(loaded, "config", None):
        return dict(loaded.config)
    a = engine.model.args
    heads = a.num_attention_heads
    return {
        "model_type": a.model_type, "hidden_size": a.hidden_size, "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": heads, "num_key_value_heads": getattr(a, "num_key_value_heads", None) or heads,
        "head_dim": getattr(a, "head_dim", None) or a.hidden_size // heads, "intermediate_size": a.intermediate_size,
        "vocab_size": a.vocab_size, "rms_norm_eps": a.rms_norm_eps, "rope_theta": getattr(a, "rope_theta", 10000.0),
        "rope_scaling": getattr(a, "rope_scaling", None),
        "max_position_embeddings": getattr(a, "max_position_embeddings", None) or 4096,
    }


def new_drafter(engine: Any, cfg: TrainConfig):
    """A fresh DSpark model shaped for ``engine``'s target, embedding/head copied from it and frozen."""
    from engine.drafters.checkpoint import new_dspark_model

    tconf = target_config_of(engine)
    if cfg.intermediate_size:
        tconf["intermediate_size"] = int(cfg.intermediate_size)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else default_mask_token(engine.tokenizer, engine.target.vocab_size)
    model = new_dspark_model(tconf, num_layers=cfg.layers, block_size=cfg.block_size, markov_rank=cfg.markov_rank,
                                   tap_layers=cfg.tap_layers, mask_token_id=mask, markov_head_type=cfg.markov_head_type,
                                   confidence_head=True, confidence_head_with_markov=cfg.markov_rank > 0,
                                   seed=cfg.seed, target=engine.target)
    model.config["num_anchors"] = cfg.anchors
    model.config["use_target_embeddings"] = True
    freeze_target_parts(model)
    return model


def drafter_from_folder(engine: Any, spec: str):
    """An exported DSpark drafter (a folder, ``resources:...``) as a float32 model to train
    further: its own architecture and tap layers over the full vocabulary, the target's
    embedding/head, frozen. The engine's loader reads and checks it (target, keys, shapes)."""
    import mlx.core as mx

    from engine.drafters import checkpoint

    path = checkpoint.resolve_drafter_path(spec)
    model, _ = checkpoint.load_checkpoint(path, engine.target, mode="dspark", dtype=mx.float32, draft_vocab=0)
    model.train()  # the loader hands out a drafter for inference
    model.config = {k: v for k, v in checkpoint.read_config(path).items() if k not in ("tandem", "torch_dtype")}
    freeze_target_parts(model)
    return model


def grow_layers(model: Any, extra: int) -> Any:
    """``model`` with ``extra`` more decoder layers on top that start as the identity: each is a
    copy of the last layer with its output projections (``o_proj``, ``down_proj``) zeroed, so the
    grown drafter drafts exactly as the old one did and training gives the new depth its use
    (the copy, not a random init, gives their attention and MLP inputs a trained start)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.drafters import block

    if extra <= 0:
        return model
    config = dict(model.config)
    n = int(config["num_hidden_layers"])
    config["num_hidden_layers"] = n + extra
    if config.get("layer_types"):
        config["layer_types"] = list(config["layer_types"]) + [config["layer_types"][-1]] * extra
    grown = block.DSparkModel(block.parse_config(config, "grown DSpark model"))
    weights = dict(tree_flatten(model.parameters()))
    outputs = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight")
    for i in range(n, n + extra):
        weights.update({f"layers.{i}.{name}": mx.zeros_like(w) if name in outputs else w
                        for name, w in tree_flatten(model.layers[-1].parameters())})
    grown.load_weights(list(weights.items()), strict=True)
    mx.eval(grown.parameters())
    grown.config = config
    grown.train()
    freeze_target_parts(grown)
    return grown


def adopt_architecture(cfg: TrainConfig, config: dict) -> None:
    """A resumed or continued drafter keeps its own shape: batches must be cut for its block
    size, not for the command line's defaults."""
    cfg.layers = int(config.get("num_hidden_layers", cfg.layers))
    cfg.block_size = int(config.get("block_size", cfg.block_size))
    cfg.markov_rank = int(config.get("markov_rank", cfg.markov_rank))


def freeze_target_parts(model: Any) -> None:
    model.embed_tokens.freeze()
    if hasattr(model, "lm_head"):
        model.lm_head.freeze()


@dataclass
class TrainState:
    step: int = 0
    total_steps: int = 0
    elapsed: float = 0.0  # training seconds over all sessions
    restart_step: int = 0  # where an --extend run restarted the schedule
    restart_lr: float | None = None
    history: list[dict] = field(default_factory=list)


class Trainer:
    """One drafter being trained: model, optimizer, data, checkpoints. ``out`` layout:
    ``checkpoint/`` (state.json, config.json, weights + optimizer state, float32) and
    ``drafter/`` (the exported DeepSpec-format drafter)."""

    def __init__(self, engine: Any, train: list[Example], val: list[Example], out: str | Path, cfg: TrainConfig,
                 *, log: Callable[[str], None] = print, export_dir: str | Path | None = None,
                 mirror: Callable[[], None] | None = None):
        import mlx.core as mx
        import mlx.nn as nn
        import mlx.optimizers as optim

        self.engine, self.target, self.cfg, self.log = engine, engine.target, cfg, log
        self.out = Path(out)
        self.ckpt = self.out / "checkpoint"
        self.export_dir = Path(export_dir) if export_dir else self.out / "drafter"
        self.mirror = mirror
        self.train = usable(train, block_size=cfg.block_size, max_len=cfg.max_len)
        self.val = _interleave(usable(val, block_size=cfg.block_size, max_len=cfg.max_len))[: cfg.val_seqs]
        if not self.train:
            raise TandemError("train-drafter: no usable training example (answers of at least 2 tokens)")
        self.lengths = [len(e.prompt) + len(e.answer) for e in self.train]
        eos = getattr(engine.tokenizer, "eos_token_ids", None) or []
        self.draft_vocab = draft_vocabulary(self.train, engine.target.vocab_size, always=sorted(int(e) for e in eos))
        self.state = TrainState(total_steps=cfg.steps)
        old = self.out / "checkpoint.old"
        if not self.ckpt.exists() and (old / "state.json").is_file():  # stopped while swapping checkpoints
            old.rename(self.ckpt)
        if (self.ckpt / "state.json").is_file():
            self.model = self._load_checkpoint()
        elif cfg.init_from:
            self.model = drafter_from_folder(engine, cfg.init_from)
            log(f"starting from the drafter in {cfg.init_from} (its weights, a fresh optimizer and schedule)")
            if cfg.grow_layers:
                self.model = grow_layers(self.model, cfg.grow_layers)
                log(f"grown by {cfg.grow_layers} layers that start as the identity: "
                    f"{self.model.config['num_hidden_layers']} layers")
        else:
            self.model = new_drafter(engine, cfg)
        adopt_architecture(cfg, self.model.config)
        self.taps = list(self.model.config["target_layer_ids"])
        self.mask_token_id = int(self.model.config["mask_token_id"])
        self.target.set_taps(self.taps)
        check_target_states(self.target, self.taps, self.train[0].ids[:64])
        self.optimizer = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
        self.optimizer.init(self.model.trainable_parameters())
        if self._opt_state is not None:
            from mlx.utils import tree_unflatten

            self.optimizer.state = tree_unflatten(list(self._opt_state.items()))
        self._loss_and_grad = nn.value_and_grad(self.model, lambda m, f, t, a: dspark_loss(m, f, t, a, cfg))
        mx.eval(self.model.parameters())

    # -- checkpoints --------------------------------------------------------------------
    _opt_state: dict | None = None

    def _load_checkpoint(self):
        import mlx.core as mx

        from engine.drafters import block, checkpoint

        state = json.loads((self.ckpt / "state.json").read_text())
        config = json.loads((self.ckpt / "config.json").read_text())
        model = block.DSparkModel(block.parse_config(config, f"checkpoint {self.ckpt}"))
        checkpoint.copy_target_embeddings(model, self.target)
        model.load_weights(list(mx.load(str(self.ckpt / "weights.safetensors")).items()), strict=False)
        model.config = config
        freeze_target_parts(model)
        self._opt_state = mx.load(str(self.ckpt / "optimizer.safetensors"))
        self.state = TrainState(**{k: v for k, v in state.items() if k in TrainState.__dataclass_fields__})
        if getattr(self.cfg, "_extend", False):  # more steps after a finished schedule: warm restart
            st = self.state
            st.restart_step, st.restart_lr = st.step, self.cfg.lr * 0.5
            st.total_steps = st.step + (self.cfg.steps if getattr(self.cfg, "_steps_given", False) else 10**9)
            self.log(f"extending from step {st.step}: learning rate restarts at {st.restart_lr:.2e}")
        elif self.cfg.steps != self.state.total_steps and getattr(self.cfg, "_steps_given", False):
            self.log(f"resume: total steps {self.state.total_steps} -> {self.cfg.steps}")
            self.state.total_steps = self.cfg.steps
        self.log(f"resumed from {self.ckpt} at step {self.state.step}/{self.state.total_steps}")
        return model

    def save_checkpoint(self) -> None:
        """Weights + optimizer + step, written to a temp folder and swapped in (an interrupted
        save leaves the previous checkpoint intact); then the exported drafter."""
        import mlx.core as mx
        from mlx.utils import tree_flatten

        tmp = self.out / "checkpoint.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        mx.save_safetensors(str(tmp / "weights.safetensors"), dict(tree_flatten(self.model.trainable_parameters())))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state)))
        (tmp / "config.json").write_text(json.dumps(self.model.config, indent=2))
        (tmp / "state.json").write_text(json.dumps(self.state.__dict__))
        old = self.out / "checkpoint.old"
        shutil.rmtree(old, ignore_errors=True)
        if self.ckpt.exists():
            self.ckpt.rename(old)
        tmp.rename(self.ckpt)
        shutil.rmtree(old, ignore_errors=True)
        self.export()
        if self.mirror is not None:
            self.mirror()

    def export(self) -> Path:
        from engine.drafters import checkpoint

        config = dict(self.model.config)
        config["tandem"] = {"trained_by": "tandem train-drafter", "step": self.state.step,
                            "train_examples": len(self.train), "anchors": self.cfg.anchors,
                            "loss": "0.1*CE + 0.9*L1 + 1.0*BCE, exp(-k/4)"}
        tmp = self.export_dir.with_name(self.export_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        # The draft vocabulary goes in draft_vocab.json only (most frequent first, --draft-vocab N).
        # No d2t/t2d: in the speculators convention other engines follow (vLLM, SGLang, mlx-dspark)
        # d2t says the head's rows are a reduced draft space, and this head covers every token.
        checkpoint.save_drafter(self.model, config, tmp, dtype=self.cfg.export_dtype)
        (tmp / checkpoint.DRAFT_VOCAB_FILE).write_text(json.dumps(self.draft_vocab) + "\n", encoding="utf-8")
        self.export_dir.mkdir(parents=True, exist_ok=True)
        for f in tmp.iterdir():
            f.replace(self.export_dir / f.name)
        shutil.rmtree(tmp, ignore_errors=True)
        return self.export_dir

    # -- steps ----------------------------------------------------------------------------
    def _batch(self, examples: list[Example], rng: np.random.Generator,
               positions: Sequence[Sequence[int]] | None = None) -> dict:
        b = make_batch(examples, block_size=self.cfg.block_size, num_anchors=self.cfg.anchors, rng=rng, pad_to=64,
                       positions=positions)
        a = batch_arrays(b, self.mask_token_id)
        a["sources"], a["keep"] = b.sources, b.keep
        return a

    def train_step(self) -> dict:
        import mlx.core as mx
        import mlx.optimizers as optim

        step = self.state.step
        idx = batch_at(self.lengths, self.cfg.batch_seqs, self.cfg.seed, step)
        arrays = self._batch([self.train[i] for i in idx], np.random.default_rng([self.cfg.seed, step, 7]))
        feats, tlogits = target_side(self.target, arrays, self.taps)
        (loss, metrics), grads = self._loss_and_grad(self.model, feats, tlogits, arrays)
        if self.cfg.grad_clip > 0:
            grads, gnorm = optim.clip_grad_norm(grads, self.cfg.grad_clip)
        else:
            gnorm = mx.array(0.0)
        self.optimizer.learning_rate = mx.array(self._lr(step), dtype=mx.float32)
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.trainable_parameters(), self.optimizer.state, metrics, gnorm)
        self.state.step += 1
        out = _summarise(metrics)
        out["grad_norm"] = gnorm.item()
        return out

    def _lr(self, step: int) -> float:
        st = self.state
        return lr_at(step, st.total_steps, self.cfg, st.restart_step, st.restart_lr)

    def evaluate(self) -> dict:
        """Loss and teacher-forced greedy acceptance on the held-out answers, by content class
        (fixed anchors, so successive evaluations compare)."""
        import mlx.core as mx

        if not self.val:
            return {}
        rng = np.random.default_rng([self.cfg.seed, 99])
        tot: dict[str, list[float]] = {}
        sums = {"loss": 0.0, "ce": 0.0, "l1": 0.0, "bce": 0.0}
        walked: dict[str, list[list[int]]] = {}  # per class, each answer's walked rounds
        nb = 0
        S = self.cfg.batch_seqs
        for i in range(0, len(self.val), S):
            exs = self.val[i : i + S]
            arrays = self._batch(exs, rng)
            states = target_states(self.target, arrays["ids"], self.taps)  # serves the walk's anchors too
            feats, tlogits = target_side(self.target, arrays, self.taps, states)
            _, m = dspark_loss(self.model, feats, tlogits, arrays, self.cfg)
            mx.eval(m)
            for k in sums:
                sums[k] += m[k].item()
            nb += 1
            tau, blocks = np.array(m["tau_sum"]), np.array(m["blocks"])
            for s, src in enumerate(arrays["sources"]):
                t = tot.setdefault(content_class(src), [0.0, 0.0])
                t[0] += float(tau[s])
                t[1] += float(blocks[s])
            for ex, taus in zip(exs, self._walk_batch(exs, states)):
                walked.setdefault(content_class(ex.source), []).append(taus)
        res = {f"val_{k}": v / nb for k, v in sums.items()}
        res.update({f"val_tau_{c}": t[0] / t[1] for c, t in sorted(tot.items()) if t[1] > 0})
        all_t = sum(t[0] for t in tot.values()), sum(t[1] for t in tot.values())
        if all_t[1]:
            res["val_tau"] = all_t[0] / all_t[1]
        for name, keep in (("val_walk", lambda taus: taus),
                           (f"val_walk{OPENING_TOKENS}", lambda taus: opening_rounds(taus, OPENING_TOKENS))):
            per_class = {c: [t for taus in lists for t in keep(taus)] for c, lists in sorted(walked.items())}
            res.update({f"{name}_{c}": sum(t) / len(t) for c, t in per_class.items() if t})
            every = [t for ts in per_class.values() for t in ts]
            if every:
                res[name] = sum(every) / len(every)
        return res

    def walk_rounds(self, examples: Sequence[Example]) -> list[list[int]]:
        """Each answer decoded as the loop would, greedy, the drafter's full block, no cut: from
        the answer's first token, a round at anchor p commits tau(p) tokens (the teacher-forced
        accepted drafts + the target's own) and the next round starts at p + tau(p). The tokens
        per round of these rounds is what ``tandem benchmark`` measures on the same greedy
        answer, where ``val_tau`` (every anchor alike) overweights easy stretches, which the
        walk crosses in few rounds. Every answer position is an anchor (``anchors`` per pass)."""
        S = self.cfg.batch_seqs
        return [taus for i in range(0, len(examples), S) for taus in self._walk_batch(list(examples[i : i + S]))]

    def _walk_batch(self, exs: list[Example], states: tuple[Any, Any] | None = None) -> list[list[int]]:
        """``walk_rounds`` of one batch; ``states``: the target's pass over these sequences
        (padded as ``_batch`` pads them), one pass serving every pass of anchors."""
        A = self.cfg.anchors
        tau_at: list[dict[int, int]] = [{} for _ in exs]
        for start in range(0, max(len(ex.answer) for ex in exs), A):
            positions = [range(len(ex.prompt) + start, len(ex.prompt) + start + A) for ex in exs]
            arrays = self._batch(exs, np.random.default_rng(0), positions)
            if states is None:
                states = target_states(self.target, arrays["ids"], self.taps)
            feats, tlogits = target_side(self.target, arrays, self.taps, states)
            _, m = dspark_loss(self.model, feats, tlogits, arrays, self.cfg)
            tau = np.array(m["tau_each"]).round().astype(int)
            anchors, keep = np.array(arrays["anchors"]), arrays["keep"]
            for s in range(len(exs)):
                tau_at[s].update(zip(anchors[s][keep[s]].tolist(), tau[s][keep[s]].tolist()))
        out = []
        for ex, at in zip(exs, tau_at):
            p, taus = len(ex.prompt), []
            while p in at:
                taus.append(at[p])
                p += at[p]
            out.append(taus)
        return out

    def fit(self, *, deadline: float | None = None) -> TrainState:
        """Train to ``total_steps`` or until ``deadline`` (time.time()); checkpoints on the way
        and at the end. With a deadline and no explicit step count, the step count is fixed
        after a few timed steps so the learning-rate schedule ends when time does."""
        cfg, st = self.cfg, self.state
        self.log(f"training: {len(self.train)} sequences ({batches_per_epoch(len(self.train), cfg.batch_seqs)} "
                 f"batches/epoch), {len(self.val)} held out; drafter {cfg.layers} layers, block {cfg.block_size}, "
                 f"markov rank {cfg.markov_rank}, taps {self.taps}, mask {self.mask_token_id}; "
                 f"{_count(self.model)/1e6:.2f}M trainable parameters")
        t_start = time.time()
        t_last = time.time()
        last_ckpt = time.time()
        window: list[dict] = []
        fitted = not (deadline is not None and getattr(cfg, "_fit_steps_to_time", False))
        first = st.step
        while st.step < st.total_steps:
            if deadline is not None and time.time() >= deadline:
                self.log(f"time budget reached at step {st.step}")
                break
            t0 = time.time()
            m = self.train_step()
            dt = time.time() - t0
            st.elapsed += dt
            m["lr"] = self._lr(st.step - 1)
            window.append(m)
            if st.step == first + 3:
                t_start = time.time()  # the first steps include kernel compilation: time the next 8
            if not fitted and st.step >= first + 11 and deadline is not None:
                per = (time.time() - t_start) / 8
                fit = st.step + int(max(0.0, deadline - time.time()) / per * 0.93)  # evals, checkpoints
                st.total_steps = max(st.step + 1, min(st.total_steps, fit))
                fitted = True
                self.log(f"{per:.3f} s/step: planning {st.total_steps} steps for the time budget")
            if st.step % cfg.log_every == 0 or st.step == st.total_steps:
                avg = {k: float(np.mean([w[k] for w in window])) for k in window[0]}
                rate = len(window) / max(1e-9, time.time() - t_last)
                eta = (st.total_steps - st.step) / max(rate, 1e-9)
                self.log(f"step {st.step}/{st.total_steps} loss {avg['loss']:.4f} ce {avg['ce']:.3f} "
                         f"l1 {avg['l1']:.3f} bce {avg['bce']:.4f} tau {avg['tau']:.2f} "
                         f"acc0 {avg['acc_0']:.3f} lr {avg['lr']:.2e} | {rate:.2f} step/s eta {_hms(eta)}")
                st.history.append({"step": st.step, "t": round(st.elapsed, 1), **{k: round(v, 5) for k, v in avg.items()}})
                window, t_last = [], time.time()
            if cfg.eval_every and st.step % cfg.eval_every == 0 and st.step < st.total_steps:
                self._eval_and_log()
            if st.step % cfg.checkpoint_every == 0 or time.time() - last_ckpt > 120:
                self.save_checkpoint()
                last_ckpt = time.time()
        self._eval_and_log()
        self.save_checkpoint()
        return st

    def _eval_and_log(self) -> None:
        ev = self.evaluate()
        if ev:
            self.log("eval step {}: ".format(self.state.step) + " ".join(f"{k} {v:.4f}" for k, v in ev.items()))
            self.state.history.append({"step": self.state.step, **{k: round(v, 5) for k, v in ev.items()}})


def opening_rounds(taus: Sequence[int], n: int) -> list[int]:
    """The walked rounds that write an answer's first ``n`` tokens (its first token is the
    prefill's, as in the loop): ``tandem benchmark`` stops answers at 128 tokens by default, and
    there the openings, harder than the long tails, weigh far more than in a whole answer."""
    out, written = [], 1
    for tau in taus:
        if written >= n:
            break
        out.append(tau)
        written += tau
    return out


def _interleave(examples: list[Example]) -> list[Example]:
    """Round-robin over prompt sets, so a held-out subset covers every content class."""
    groups: dict[str, list[Example]] = {}
    for ex in examples:
        groups.setdefault(ex.source, []).append(ex)
    out = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        out += [g[i] for g in groups.values() if i < len(g)]
    return out


def _summarise(metrics: dict) -> dict:
    blocks = float(np.array(metrics["blocks"]).sum())
    out = {k: metrics[k].item() for k in ("loss", "ce", "l1", "bce")}
    out["tau"] = float(np.array(metrics["tau_sum"]).sum()) / blocks if blocks else 1.0
    out["tau_prob"] = float(np.array(metrics["tau_prob_sum"]).sum()) / blocks if blocks else 1.0
    acc, n = np.array(metrics["acc_k"]), np.array(metrics["n_k"])
    for k in range(len(acc)):
        out[f"acc_{k}"] = float(acc[k] / n[k]) if n[k] else 0.0
    return out


def _count(model: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(model.trainable_parameters()))


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def acceptance_report(engine: Any, prompts: Sequence[tuple[str, str]], *, max_new_tokens: int,
                      log: Callable[[str], None] = print) -> dict:
    """Mean tokens per verify round (accepted drafts + the target's own) per content class,
    greedy, full block (--mode dspark --max-draft 0), and whether every output equals plain
    greedy decoding."""
    per: dict[str, list[tuple[int, int]]] = {}
    mismatches = 0
    for i, (cls, text) in enumerate(prompts):
        r = engine.generate(text, mode="dspark", max_new_tokens=max_new_tokens, max_draft=0)
        b = engine.generate(text, mode="baseline", max_new_tokens=max_new_tokens)
        mismatches += r.token_ids != b.token_ids
        rounds = r.rounds[1:]
        per.setdefault(cls, []).append((sum(a for _, a in rounds) + len(rounds), len(rounds)))
        log(f"  [{i + 1}/{len(prompts)}] {cls}: {r.mean_accepted:.2f} tokens/round over {len(rounds)} rounds")
    out = {c: round(sum(t for t, _ in v) / max(1, sum(n for _, n in v)), 3) for c, v in per.items()}
    return {"tokens_per_round": out, "prompts": {c: len(v) for c, v in per.items()},
            "max_new_tokens": max_new_tokens, "identical_to_baseline": mismatches == 0, "mismatches": mismatches}
