"""Our drafters against the reference implementations themselves, not our reading of them: the
same tiny random checkpoint, in the published on-disk layout, loaded by our loader and by the
reference's (mlx-dspark 0.20.3 for DSpark and DFlash; mlx-vlm 0.7.10's ``speculative/drafters``
for DFlash 2, EAGLE-3 and Qwen3.5 MTP), fed the same target hidden states over several rounds;
every round's drafter logits and chained greedy drafts must agree. (mlx-dspark's own DFlash 2
forward agrees with neither mlx-vlm's nor ours on these checkpoints; mlx-vlm's is the reference.)

Rounds follow the loop: the drafter holds the rows of every position before the anchor, drafts
``K`` tokens, then the round commits ``a`` accepted tokens and the target's own (rows for the
anchor and the accepted drafts). The tokens committed are a fixed random sequence, the same for
both sides, so a round's inputs never depend on either side's drafts.

DeepSeek-V3 / GLM-4.5 nextn heads have no reference here: mlx-vlm 0.7.10 runs the later layouts
(DeepSeek-V4, GLM-4.7-Flash, GLM-5) that we refuse, not these.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_dspark  # noqa: F401  (its import shim must run before mlx-vlm's loaders)
import numpy as np
import pytest
from mlx_dspark.load import load_dflash, load_drafter as load_dspark
from mlx_dspark.target import Target
from mlx_vlm.speculative.drafters import load_drafter as load_vlm_drafter

from engine.api import load
from engine.sampling import Sampler, SamplingParams
from tests import drafter_ckpt as ck
from tests.test_mtp import qwen3_5_folder
from tests.test_train import tiny  # noqa: F401  (a fixture: a tiny target and its own answers)
from tests.tiny import make_tiny_engine

GREEDY = Sampler(SamplingParams())
K = 4  # drafts per round
PLAN = (2, 0, 3, 1, 0)  # accepted drafts per round
PROMPT = 9
LOGIT_TOL = 1e-4


def sequence(vocab: int, n: int = PROMPT + 24, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(2, vocab, n).tolist()


def target_rows(engine, taps, ids: list[int]) -> mx.array:
    """The target's tapped states of every position of ``ids`` [L, F] (one causal pass)."""
    engine.target.set_taps(taps)
    _, hidden = engine.target.forward(mx.array([ids]), engine.target.new_cache(), tap=True)
    return hidden


def run_rounds(ours, ref, ids: list[int], hidden: mx.array, plan=PLAN, prompt: int = PROMPT, distinct: int = 4
               ) -> list[tuple[list[int], list[int]]]:
    """Both drafters through the same rounds; asserts each round's logits and greedy drafts
    agree, and returns (our drafts, the reference's drafts) per round."""
    k = min(K, ours.max_draft)
    ours.begin(ids[:prompt], hidden[:prompt])
    ref.begin(ids[:prompt], hidden[:prompt], ids[prompt])
    done, out = prompt, []
    for accepted in plan:
        mine_logits, mine = ours_round(ours, ids[: done + 1], k)
        theirs_logits, theirs = ref.propose(ids[: done + 1], k)
        assert mine_logits.shape == theirs_logits.shape
        gap = mx.abs(mine_logits.astype(mx.float32) - theirs_logits.astype(mx.float32)).max().item()
        assert gap < LOGIT_TOL * max(1.0, mx.abs(theirs_logits).max().item()), f"round {len(out)}: logits differ by {gap}"
        assert mine == theirs, f"round {len(out)}: ours drafted {mine}, the reference {theirs}"
        out.append((mine, theirs))
        n = accepted + 1
        ours.commit(ids[: done + n + 1], n, hidden[done : done + n])
        ref.commit(ids, done, accepted, hidden[done : done + n])
        done += n
    assert len({t for mine, _ in out for t in mine}) >= distinct  # drafts that follow the context
    return out


def ours_round(drafter, ids: list[int], k: int) -> tuple[mx.array, list[int]]:
    """Our drafter's logits for this round (the block's draft slots, or a chain head's first
    draft) and its greedy draft through ``propose``, the loop's own call."""
    if hasattr(drafter, "block_states"):
        start = drafter.cfg.logits_start
        head = drafter.model.logits if drafter.name == "dspark" else drafter.logits  # DSpark's before the Markov bias
        logits = head(drafter.block_states(ids)[start : start + k])
    else:
        drafter._feed(ids)  # propose's first step: the anchor's row, whose output is the seed
        logits = drafter.logits(drafter._seed)[None]
    return logits, drafter.propose(ids, k, GREEDY).tokens.tolist()


# ----------------------------------------------------------------------------------------
# mlx-dspark: DSpark, DFlash, DFlash 2
# ----------------------------------------------------------------------------------------
class DSparkRef:
    """mlx-dspark's ``DSparkDrafter`` driven as its ``speculative_generate`` drives it."""

    def __init__(self, path, target_model):
        self.model, self.cfg = load_dspark(str(path), quantize=False)
        self.model.set_dtype(mx.float32)  # the dtype ours computes in on this CPU (a float16 file stays exact)
        target = Target(target_model, None)
        if not self.cfg.has_own_lm_head:  # train-drafter's: the target's embedding and head
            self.model.bind_lm_head(target.lm_head_proj)
        if not self.cfg.has_own_embed:
            self.model.bind_embed(target.draft_embed)

    def begin(self, prompt, rows, first):
        self.ctx = self.model.make_ctx_cache()
        self.model.update_context(rows[None], 0, self.ctx)
        self.n = len(prompt)

    def propose(self, ids, k):
        anchor = int(ids[-1])
        block = mx.array([[anchor] + [self.cfg.mask_token_id] * (self.model.block_size - 1)])
        hidden = self.model.backbone(self.model.embed(block), self.n, self.ctx)
        logits = self.model.compute_logits(self.model.head_slice(hidden, k))[0]
        return logits, self.model.sample_block(logits, first_prev_token=anchor).tolist()

    def commit(self, ids, done, accepted, rows):
        self.model.update_context(rows[None], self.n, self.ctx)
        self.n += int(rows.shape[0])


class DFlashRef:
    """mlx-dspark's ``DFlashDraftModel`` as ``dflash_generate`` drives it: each round's call
    appends the rows committed since the last one."""

    def __init__(self, path, target_model):
        self.model, _ = load_dflash(str(path), quantize=False)
        self.model.bind(target_model)
        self.twin, _ = load_dflash(str(path), quantize=False)  # the logits, on a cache of its own
        self.twin.bind(target_model)
        self.mask = self.model.config.mask_token_id

    def begin(self, prompt, rows, first):
        self.cache, self.twin_cache, self.pending = self.model.make_cache(), self.twin.make_cache(), rows[None]

    def propose(self, ids, k):
        anchor = int(ids[-1])
        block = mx.array([[anchor] + [self.mask] * (self.model.config.block_size - 1)])
        logits = self.twin(block, self.pending, self.twin_cache, logits_start=1)[0][:k]
        tokens = mx.argmax(self.model(block, self.pending, self.cache, logits_start=1)[0][:k], axis=-1)
        return logits, tokens.tolist()

    def commit(self, ids, done, accepted, rows):
        self.pending = rows[None]


class VlmDFlashRef:
    """mlx-vlm's DFlash / DFlash 2 drafter as its round loop drives it: each ``draft_block``
    appends the rows committed since the last one (its block's argmax, or DFlash 2's
    candidate-selector walk)."""

    def __init__(self, path, target_model):
        self.model, kind = load_vlm_drafter(str(path), kind="dflash")
        self.twin, _ = load_vlm_drafter(str(path), kind="dflash")  # the logits, on a cache of its own
        assert kind == "dflash"
        from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashDraftModel

        for model in (self.model, self.twin):  # the target's embedding and head (its check wants an mlx-vlm target)
            DFlashDraftModel.bind(model, target_model)

    def begin(self, prompt, rows, first):
        self.cache, self.twin_cache, self.pending = self.model.make_cache(), self.twin.make_cache(), rows[None]

    def propose(self, ids, k):
        anchor = int(ids[-1])
        width = self.model.config.block_size  # the full block, as ours runs it (its attention is bidirectional)
        block = mx.array([[anchor] + [self.model.config.mask_token_id] * (width - 1)])
        logits = self.twin(block, self.pending, self.twin_cache)[0, 1 : 1 + k]
        tokens = self.model.draft_block(anchor, self.pending, self.cache, width, lambda x: mx.argmax(x, axis=-1))
        return logits, tokens[0, :k].tolist()

    def commit(self, ids, done, accepted, rows):
        self.pending = rows[None]


@pytest.fixture(scope="module")
def llama():
    return make_tiny_engine("llama", seed=3)


def _drafter(engine, path, kind):
    engine.drafter_path = str(path)
    engine._drafters.clear()
    return engine.drafter(kind)


@pytest.mark.parametrize("variant", ["markov", "plain"])
def test_dspark_matches_mlx_dspark(llama, tmp_path, variant):
    tc = ck.target_config_of(llama.model)
    rank = 16 if variant == "markov" else 0
    cfg, w = ck.dspark_checkpoint(tc, layers=2, markov_rank=rank, taps=[0, 1, 2], seed=5, scale=0.2)
    ck.copy_target_head(w, llama.model)  # as DeepSpec trains them: drafts that vary with the context
    w = {k: v * 4 if k.startswith("markov_head.") else v for k, v in w.items()}
    path = ck.write(tmp_path / variant, cfg, w)
    ours = _drafter(llama, path, "dspark")
    ids = sequence(tc["vocab_size"])
    run_rounds(ours, DSparkRef(path, llama.model), ids, target_rows(llama, ours.tap_layers, ids))


def test_dflash_matches_mlx_dspark(llama, tmp_path):
    tc = ck.target_config_of(llama.model)
    cfg, w = ck.dflash_checkpoint(tc, layers=2, block_size=6, taps=[0, 2], seed=1, scale=0.5)
    path = ck.write(tmp_path / "dflash", cfg, w)
    ours = _drafter(llama, path, "dflash")
    ids = sequence(tc["vocab_size"], seed=1)
    run_rounds(ours, DFlashRef(path, llama.model), ids, target_rows(llama, ours.tap_layers, ids))


def test_dflash2_matches_mlx_vlm(llama, tmp_path):
    tc = ck.target_config_of(llama.model)
    cfg, w = ck.dflash2_checkpoint(tc, layers=2, block_size=6, taps=[0, 2], rank=8, top_k=6, seed=7, scale=0.2)
    w = {k: v * 10 if "codebook" in k else v for k, v in w.items()}  # edges that change the walk
    path = ck.write(tmp_path / "dflash2", cfg, w)
    ours = _drafter(llama, path, "dflash")
    ids = sequence(tc["vocab_size"], seed=2)
    run_rounds(ours, VlmDFlashRef(path, llama.model), ids, target_rows(llama, ours.tap_layers, ids))


# ----------------------------------------------------------------------------------------
# mlx-vlm: EAGLE-3 (both layouts), Qwen3.5 MTP
# ----------------------------------------------------------------------------------------
class ChainRef:
    """An mlx-vlm chain drafter (``prefill_from_target_hidden`` / ``draft_block`` /
    ``accept_verified_tokens``, as its round loop calls them)."""

    def __init__(self, model, target_model):
        self.model = model
        self.model.reset(target_model)

    def begin(self, prompt, rows, first):
        self.model.prefill_from_target_hidden(mx.array([prompt]), rows[None], first, None, greedy=True)

    def propose(self, ids, k):
        m = self.model
        logits = m._logits(m._seed_hidden)[0] if hasattr(m, "_logits") else m._lm_head_fn(m._seed_hidden)[0]
        tokens = m.draft_block(int(ids[-1]), None, None, k + 1, None, greedy=True)
        return logits, tokens[0].tolist()

    def commit(self, ids, done, accepted, rows):
        drafts = mx.array([ids[done + 1 : done + 1 + K]])  # what the round accepted comes first
        self.model.accept_verified_tokens(rows[None], drafts, accepted, [ids[done + accepted + 1]], None, greedy=True)


def _eagle3_reference(path, layout: str):
    """mlx-vlm reads the speculators layout itself; for SafeAILab's (``midlayer.*``, flat
    config), which it does not read, the same tensors go to its model under speculators names."""
    if layout == "speculators":
        model, kind = load_vlm_drafter(str(path), kind="eagle3")
        assert kind == "eagle3"
        if model.embed_tokens is None:  # its loader drops a module the file has no weights for,
            import mlx.nn as nn         # then its bind() needs one to swap the target's in

            model.embed_tokens = nn.Embedding(model.target_vocab_size, model.hidden_size)
        return model
    import json

    from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config
    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

    flat = json.loads((path / "config.json").read_text())
    config = Eagle3Config.from_dict({"transformer_layer_config": flat, "draft_vocab_size": flat["draft_vocab_size"],
                                     "eagle_aux_hidden_state_layer_ids": flat["eagle_config"]["eagle_aux_hidden_state_layer_ids"]})
    model = Eagle3DraftModel(config)
    weights = {k.replace("midlayer.", "layers.0."): v for k, v in mx.load(str(path / "model.safetensors")).items()}
    model.load_weights(list(model.sanitize(weights).items()), strict=False)
    return model


@pytest.mark.parametrize("layout,norm_before_residual,own_embedding", [
    ("speculators", True, True), ("speculators", False, False), ("safeailab", False, False)])
def test_eagle3_matches_mlx_vlm(llama, tmp_path, layout, norm_before_residual, own_embedding):
    tc = ck.target_config_of(llama.model)
    listed = sorted(np.random.default_rng(3).choice(tc["vocab_size"], 64, replace=False).tolist())
    cfg, w = ck.eagle3_checkpoint(tc, draft_tokens=listed, aux=[1, 2, 3], layout=layout, seed=8, scale=0.5,
                                  norm_before_residual=norm_before_residual, own_embedding=own_embedding)
    if own_embedding:  # a frozen copy of the target's, as speculators trains it (mlx-vlm's bind() uses the
        w["embed_tokens.weight"] = np.array(llama.model.model.embed_tokens.weight)  # target's whenever shapes match)
    path = ck.write(tmp_path / layout, cfg, w)
    ours = _drafter(llama, path, "eagle3")
    ids = sequence(tc["vocab_size"], seed=4)
    rounds = run_rounds(ours, ChainRef(_eagle3_reference(path, layout), llama.model), ids,
                        target_rows(llama, ours.tap_layers, ids))
    assert {t for mine, _ in rounds for t in mine} <= set(listed)  # d2t applied on both sides


def test_qwen3_5_mtp_matches_mlx_vlm(tmp_path):
    """mlx-vlm keeps the head's own rows for accepted drafts where we (as vLLM) re-run them with
    the target's states, so the rounds accept none: every row then comes from the target."""
    folder = qwen3_5_folder(tmp_path / "q35", seed=2)
    engine = load(str(folder))
    ours = engine.drafter("mtp")
    model, kind = load_vlm_drafter(str(folder), kind="mtp")
    assert kind == "mtp"
    ids = sequence(engine.target.vocab_size, seed=5)
    run_rounds(ours, ChainRef(model, engine.model), ids, target_rows(engine, ours.tap_layers, ids), plan=(0,) * 5)


# ----------------------------------------------------------------------------------------
# The peer loads what train-drafter writes, and drafts the same tokens
# ----------------------------------------------------------------------------------------
class OursAsRef:
    """Our own DSpark drafter behind the reference's interface (an old folder against a new one)."""

    def __init__(self, drafter):
        self.drafter = drafter

    def begin(self, prompt, rows, first):
        self.drafter.begin(prompt, rows)

    def propose(self, ids, k):
        return ours_round(self.drafter, ids, k)

    def commit(self, ids, done, accepted, rows):
        self.drafter.commit(ids[: done + accepted + 2], accepted + 1, rows)


def dspark_drafter(engine, folder, draft_vocab: int | None = 0):
    """Our DSpark drafter for ``folder``, no confidence cut; ``draft_vocab=0``: over the full
    vocabulary, as the peer drafts from a head without ``d2t``; None: the folder's list."""
    from engine.drafters.checkpoint import load_checkpoint
    from engine.drafters.dspark import DSparkDrafter

    model, cfg = load_checkpoint(folder, engine.target, mode="dspark", draft_vocab=draft_vocab)
    return DSparkDrafter(model, cfg, engine.target, confidence_threshold=0)


def peer_round_trip(engine, folder, prompt: list[int], answer: list[int], max_new_tokens: int, distinct: int = 4) -> None:
    """``folder`` loads in mlx-dspark with no error, drafts there what it drafts here over the
    rounds of ``answer``, and its greedy speculative output there is the peer's own baseline."""
    from mlx_dspark import greedy_generate, speculative_generate

    peer = DSparkRef(folder, engine.model)  # load_drafter refuses a folder it cannot run
    ours = dspark_drafter(engine, folder)
    ids = prompt + answer
    run_rounds(ours, peer, ids, target_rows(engine, ours.tap_layers, ids), plan=(1, 0, 2, 0, 1), prompt=len(prompt),
               distinct=distinct)
    target = Target(engine.model, engine.tokenizer)
    common = dict(prompt_ids=prompt, max_new_tokens=max_new_tokens, temperature=0.0)
    spec = speculative_generate(target, engine.tokenizer, peer.model, lookup_drafts=False,
                                max_draft_tokens=peer.model.max_draft, **common)
    base = greedy_generate(target, engine.tokenizer, **common)
    n = len(base.token_ids)
    assert len(spec.token_ids) >= n and spec.token_ids[:n] == base.token_ids  # (its last round may pass the budget)
    assert spec.num_rounds < len(spec.token_ids) - 1  # drafts were accepted there


@pytest.mark.slow
def test_shipped_drafter_round_trips_through_mlx_dspark(starter_engine, tmp_path):
    """The shipped starter drafter (train-drafter's, re-exported without d2t/t2d) runs in the
    peer; and the folder as it was shipped before, with d2t/t2d, drafts exactly as it does now."""
    import json
    import shutil

    from engine.drafters.checkpoint import DRAFT_VOCAB_FILE, vocab_tensors
    from engine.paths import resources_dir

    engine = starter_engine
    folder = resources_dir() / "drafters" / "smollm2-135m-dspark"
    prompt = engine.encode("Write a Python function that returns the squares of a list of numbers.")
    answer = engine.generate(prompt, mode="baseline", max_new_tokens=12).token_ids
    peer_round_trip(engine, folder, prompt, answer, max_new_tokens=12)  # the peer decodes slowly on a CPU
    # The old folder: the same tensors plus d2t/t2d listing draft_vocab.json's tokens.
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    listed = json.loads((folder / DRAFT_VOCAB_FILE).read_text())["token_ids"]
    weights, meta = mx.load(str(folder / "model.safetensors"), return_metadata=True)
    assert "d2t" not in weights and "t2d" not in weights
    mx.save_safetensors(str(old / "model.safetensors"), {**weights, **vocab_tensors(listed, engine.target.vocab_size)},
                        metadata=meta)
    now, before = (dspark_drafter(engine, f, draft_vocab=None) for f in (folder, old))
    assert now.cfg.draft_vocab == before.cfg.draft_vocab == tuple(listed)  # FR-Spec here, from draft_vocab.json
    ids = prompt + answer
    run_rounds(now, OursAsRef(before), ids, target_rows(engine, now.tap_layers, ids), prompt=len(prompt))


def test_trained_drafter_round_trips_through_mlx_dspark(tiny, tmp_path):
    """A drafter freshly trained by train-drafter's Trainer on a tiny target (whose answers
    repeat a token or two: the drafts do too)."""
    from engine.train.trainer import Trainer
    from tests.test_train import small_config

    engine, examples = tiny
    trainer = Trainer(engine, examples, [], tmp_path, small_config(steps=60))
    trainer.fit()
    ex = max(examples, key=lambda e: len(e.answer))
    peer_round_trip(engine, trainer.export_dir, list(ex.prompt), list(ex.answer), max_new_tokens=24, distinct=2)
