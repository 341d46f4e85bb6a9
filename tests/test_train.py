"""tandem train-drafter: the training forward is the engine's drafter, training learns, the
exported drafter loads through the normal DSpark loader, and an interrupted run resumes exactly.

All on tiny random targets built in-test (tests/tiny.py, tests/test_gguf.py): seconds on a CPU.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from engine.drafters.dspark import DSparkDrafter
from engine.sampling import Sampler, SamplingParams
from engine.train.config import TrainConfig
from engine.train.loss import block_forward, draft_outputs, target_states
from engine.train.trainer import Trainer, new_drafter, opening_rounds
from engine.train.data import Example, decode_all, load_examples, make_batch, save_examples

from tests.tiny import make_tiny_engine

GREEDY = Sampler(SamplingParams(0.0))


def small_config(**kw) -> TrainConfig:
    base = dict(layers=2, block_size=4, markov_rank=8, intermediate_size=None, steps=24, batch_seqs=4, anchors=6,
                lr=3e-3, log_every=1000, eval_every=0, checkpoint_every=1000, val_seqs=8, export_dtype="float32")
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def tiny():
    """A 6-layer random llama target with sharp logits, and its own greedy answers to 24 prompts."""
    eng = make_tiny_engine("llama", seed=0, layers=6, scale=3.0)
    rng = np.random.default_rng(0)
    exs = [Example(("gsm8k", "mbpp", "arena-hard-v2")[i % 3], [1] + [int(t) for t in rng.integers(2, 96, 6 + i % 9)])
           for i in range(24)]
    for ex, ans in zip(exs, decode_all(eng.model, [e.prompt for e in exs], batch_size=8, max_new_tokens=32, eos_ids=[0])):
        ex.answer = ans
    return eng, exs


def test_answers_are_the_targets_greedy_continuations(tiny):
    """Batched, left-padded decoding gives each prompt exactly the engine's greedy output."""
    eng, exs = tiny
    assert any(e.answer[-1] == 0 for e in exs) and any(len(e.answer) == 32 for e in exs)  # both endings seen
    for ex in exs[:8]:
        ref = eng.generate(ex.prompt, mode="baseline", max_new_tokens=32)
        n = len(ref.token_ids)  # the engine leaves EOS out of its output; the data keeps it
        assert ex.answer[:n] == ref.token_ids
        assert len(ex.answer) == n or ex.answer[n:] == [0]


def test_sampled_answers_differ_and_stop_at_eos(tiny):
    eng, exs = tiny
    prompts = [exs[0].prompt] * 6
    out = decode_all(eng.model, prompts, batch_size=6, max_new_tokens=12, eos_ids=[0], temperature=1.0, seed=5)
    assert len({tuple(o) for o in out}) > 1
    assert all(0 not in o[:-1] for o in out)
    again = decode_all(eng.model, prompts, batch_size=6, max_new_tokens=12, eos_ids=[0], temperature=1.0, seed=5)
    assert out == again  # seeded


def test_training_forward_is_the_engine_drafter(tiny):
    """Many anchors at once with the training mask give, anchor by anchor, the block states and
    greedy drafts of the engine's DSpark drafter run on the same committed context."""
    eng, exs = tiny
    model = new_drafter(eng, small_config(layers=2, block_size=5, markov_rank=8))
    ex = max(exs, key=lambda e: len(e.answer))
    ids = ex.ids
    taps = model.config["target_layer_ids"]
    eng.target.set_taps(taps)
    anchors = [len(ex.prompt), len(ex.prompt) + 3, len(ids) - 6]
    B, mask = 5, model.config["mask_token_id"]
    block_ids = mx.array([[[ids[p]] + [mask] * (B - 1) for p in anchors]])
    feats, _ = target_states(eng.target, mx.array([ids]), taps)
    h_train = block_forward(model, feats, mx.array([anchors]), block_ids)[0]

    drafter = DSparkDrafter(model, model.cfg, eng.target)
    _, hidden = eng.target.forward(mx.array([ids]), eng.target.new_cache(), tap=True)  # the engine's own tap
    for a, p in enumerate(anchors):
        drafter.begin(ids[:p], hidden[:p])
        h_inf = drafter.block_states(ids[: p + 1])
        assert mx.allclose(h_train[a], h_inf, atol=1e-4).item(), f"anchor {p}"
        draft = np.array(drafter.propose(ids[: p + 1], B, GREEDY).tokens).tolist()
        # teacher-forced training logits with the drafted tokens as the Markov inputs
        arrays = {"anchors": mx.array([[p]]), "block_ids": block_ids[:, a : a + 1],
                  "prev": mx.array([[[ids[p]] + draft[:-1]]])}
        logits, conf, _ = draft_outputs(model, feats, arrays)
        assert np.array(mx.argmax(logits[0, 0], axis=-1)).tolist() == draft
        assert conf.shape == (1, 1, B)


def test_batches_follow_the_anchor_rule():
    ex = [Example("gsm8k", [5, 6, 7], [8, 9, 10, 11]), Example("mbpp", [5], [20, 21])]
    b = make_batch(ex, block_size=3, num_anchors=4, rng=np.random.default_rng(0), pad_to=8)
    assert b.ids.shape == (2, 8)
    assert sorted(b.anchors[0][b.keep[0]].tolist()) == [3, 4, 5]  # answer tokens with an answer token after
    assert b.anchors[1][b.keep[1]].tolist() == [1]
    a = b.anchors[0].tolist().index(3)
    assert b.labels[0, a].tolist() == [9, 10, 11] and b.prev[0, a].tolist() == [8, 9, 10]
    assert b.rows[0, a].tolist() == [3, 4, 5]
    a = b.anchors[0].tolist().index(5)
    assert b.valid[0, a].tolist() == [True, False, False]
    assert not b.valid[1, ~b.keep[1]].any()


def test_a_few_steps_reduce_the_loss(tiny, tmp_path):
    eng, exs = tiny
    trainer = Trainer(eng, exs, exs[:8], tmp_path, small_config(steps=30))
    before = trainer.evaluate()
    trainer.fit()
    after = trainer.evaluate()
    assert after["val_loss"] < 0.8 * before["val_loss"]
    assert after["val_tau"] > before["val_tau"]
    assert trainer.state.history and (tmp_path / "drafter" / "config.json").is_file()


def test_walked_rounds_are_the_loops_rounds_on_the_same_greedy_answer(tiny, tmp_path):
    """``val_walk`` decodes each held-out answer as the loop does: round by round, the tokens
    ``Trainer.walk_rounds`` commits are those of the real loop (greedy, the drafter's full
    block, no cut) on the same prompt, whose greedy answer it is; only the last round, which the
    answer's end cuts short, may differ."""
    from engine.speculative import DecodeStats, FixedCap, decode

    eng, exs = tiny
    val = exs[:8]
    trainer = Trainer(eng, exs, val, tmp_path, small_config(steps=30))
    trainer.fit()
    drafter = DSparkDrafter(trainer.model, trainer.model.cfg, eng.target, confidence_threshold=0.0)
    assert drafter.max_draft == trainer.cfg.block_size
    compared = []
    for ex, walked in zip(trainer.val, trainer.walk_rounds(trainer.val)):
        if len(ex.answer) < 2:  # EOS at once: no anchor, no round
            assert walked == []
            continue
        assert sum(walked) >= len(ex.answer) - 1 and sum(walked[:-1]) < len(ex.answer) - 1
        stats = DecodeStats()
        for _ in decode(eng.target, drafter, ex.prompt, GREEDY, max_new_tokens=len(ex.answer) + drafter.max_draft + 1,
                        cap_policy=FixedCap(drafter.max_draft), stats=stats, eos_ids=[0]):
            pass
        looped = [accepted + 1 for _, accepted in stats.rounds[1:]]
        assert looped[: len(walked) - 1] == walked[:-1], (ex.prompt, looped, walked)
        compared += walked[:-1]
    assert len(compared) > 20 and max(compared) > 2  # many rounds, drafts accepted in some
    report = trainer.evaluate()
    every = [t for w in trainer.walk_rounds(trainer.val) for t in w]
    assert report["val_walk"] == pytest.approx(sum(every) / len(every))
    assert {k for k in report if k.startswith("val_walk_")} == {"val_walk_chat", "val_walk_code", "val_walk_math"}


def test_opening_walk_counts_the_rounds_the_loop_runs_for_the_first_tokens(tiny, tmp_path, monkeypatch):
    """``val_walk128`` reads as ``tandem benchmark``'s tokens/round at its default 128 tokens: the
    walked rounds that write an answer's first n tokens are the rounds the loop runs when
    stopped at n new tokens (here n = 6, inside the tiny answers)."""
    from engine.speculative import DecodeStats, FixedCap, decode
    from engine.train import trainer as trainer_module

    eng, exs = tiny
    trainer = Trainer(eng, exs, exs[:8], tmp_path, small_config(steps=30))
    trainer.fit()
    drafter = DSparkDrafter(trainer.model, trainer.model.cfg, eng.target, confidence_threshold=0.0)
    n, openings = 6, []
    for ex, walked in zip(trainer.val, trainer.walk_rounds(trainer.val)):
        opening = opening_rounds(walked, n)
        assert opening == walked[: len(opening)] and sum(opening[:-1]) < n - 1
        if len(ex.answer) <= n + drafter.max_draft:
            continue
        assert sum(opening) >= n - 1  # the answer runs on: the rounds reach the n-th token
        stats = DecodeStats()
        for _ in decode(eng.target, drafter, ex.prompt, GREEDY, max_new_tokens=n, cap_policy=FixedCap(drafter.max_draft),
                        stats=stats, eos_ids=[0]):
            pass
        assert len(stats.rounds[1:]) == len(opening), (stats.rounds, walked)
        openings += opening
    assert len(openings) > 5
    monkeypatch.setattr(trainer_module, "OPENING_TOKENS", n)
    report = trainer.evaluate()
    every = [t for w in trainer.walk_rounds(trainer.val) for t in opening_rounds(w, n)]
    assert report["val_walk6"] == pytest.approx(sum(every) / len(every))
    assert report["val_walk6"] != pytest.approx(report["val_walk"])  # the openings are their own measure
    assert {k for k in report if k.startswith("val_walk6_")} == {"val_walk6_chat", "val_walk6_code", "val_walk6_math"}


def test_saved_drafter_reloads_through_the_loader_and_drafts_identically(tiny, tmp_path):
    eng, exs = tiny
    trainer = Trainer(eng, exs, [], tmp_path, small_config(steps=6))
    trainer.fit()
    out = trainer.export_dir
    config = json.loads((out / "config.json").read_text())
    saved = mx.load(str(out / "model.safetensors"))
    assert config["use_target_embeddings"] is True
    assert "embed_tokens.weight" not in saved and "lm_head.weight" not in saved  # the target's, not shipped
    assert "markov_head.markov_w1.weight" in saved and "confidence_head.proj.weight" in saved
    vocab = json.loads((out / "draft_vocab.json").read_text())  # every answer token, most frequent first
    assert {t for e in exs for t in e.answer} <= set(vocab["token_ids"]) and vocab["coverage"] == 1.0
    # ... and only there: d2t/t2d would tell other engines the head is over a reduced draft space
    assert "d2t" not in saved and "t2d" not in saved and "draft_vocab_size" not in config

    eng.drafter_path = str(out)
    eng._drafters.clear()
    loaded = eng.drafter("dspark")
    mine = DSparkDrafter(trainer.model, trainer.model.cfg, eng.target)
    ex = max(exs, key=lambda e: len(e.answer))
    eng.target.set_taps(loaded.tap_layers)
    _, hidden = eng.target.forward(mx.array([ex.ids]), eng.target.new_cache(), tap=True)
    for p in range(len(ex.prompt), len(ex.ids) - 1, 5):
        for d in (loaded, mine):
            d.begin(ex.ids[:p], hidden[:p])
        a = loaded.propose(ex.ids[: p + 1], 4, GREEDY).tokens
        b = mine.propose(ex.ids[: p + 1], 4, GREEDY).tokens
        assert np.array(a).tolist() == np.array(b).tolist()
    # and through the engine loop: lossless, and drafting something
    r = eng.generate(exs[0].prompt, mode="dspark", max_new_tokens=24, max_draft=0)
    assert r.token_ids == eng.generate(exs[0].prompt, mode="baseline", max_new_tokens=24).token_ids


def test_resume_continues_from_the_last_checkpoint(tiny, tmp_path):
    eng, exs = tiny
    straight = Trainer(eng, exs, [], tmp_path / "a", small_config(steps=6))
    straight.fit()

    first = Trainer(eng, exs, [], tmp_path / "b", small_config(steps=6))
    for _ in range(3):
        first.train_step()
    first.save_checkpoint()
    first.train_step()  # work after the checkpoint is lost with the "crash"
    del first
    resumed = Trainer(eng, exs, [], tmp_path / "b", small_config(steps=6))
    assert resumed.state.step == 3
    resumed.fit()
    a = dict(tree_flatten(straight.model.trainable_parameters()))
    b = dict(tree_flatten(resumed.model.trainable_parameters()))
    assert a.keys() == b.keys()
    assert all(mx.allclose(a[k], b[k], atol=1e-6).item() for k in a)


def test_init_from_an_exported_drafter_continues_from_its_weights(tiny, tmp_path):
    eng, exs = tiny
    first = Trainer(eng, exs, exs[:8], tmp_path / "a", small_config(steps=20))
    first.fit()
    trained = first.evaluate()["val_loss"]
    fresh = Trainer(eng, exs, exs[:8], tmp_path / "fresh", small_config(steps=20)).evaluate()["val_loss"]
    # another block size on the command line: the drafter's own (4) wins, batches are cut for it
    more = Trainer(eng, exs, exs[:8], tmp_path / "b", small_config(steps=10, block_size=6, init_from=str(first.export_dir)))
    assert more.cfg.block_size == 4 and more.model.cfg.block_size == 4
    assert more.state.step == 0  # a fresh schedule and optimizer
    assert more.evaluate()["val_loss"] == pytest.approx(trained, rel=1e-5) and trained < 0.9 * fresh
    more.fit()
    assert more.evaluate()["val_loss"] < trained


def test_grown_drafter_starts_where_the_old_one_was_and_trains_its_new_layers(tiny, tmp_path):
    from engine.drafters import checkpoint

    eng, exs = tiny
    first = Trainer(eng, exs, exs[:8], tmp_path / "a", small_config(steps=20))
    first.fit()
    grown = Trainer(eng, exs, exs[:8], tmp_path / "b", small_config(steps=10, init_from=str(first.export_dir),
                                                                    grow_layers=2))
    n = first.model.config["num_hidden_layers"]
    assert len(grown.model.layers) == n + 2 and grown.model.config["num_hidden_layers"] == n + 2
    # the new layers are the identity: same draft logits, confidences and loss as the old drafter
    assert grown.evaluate()["val_loss"] == pytest.approx(first.evaluate()["val_loss"], rel=1e-6)
    arrays = first._batch(exs[:4], np.random.default_rng(3))
    feats, _ = target_states(eng.target, arrays["ids"], first.taps)
    old_logits, old_conf, _ = draft_outputs(first.model, feats, arrays)
    new_logits, new_conf, _ = draft_outputs(grown.model, feats, arrays)
    assert mx.allclose(old_logits, new_logits, atol=1e-5).item() and mx.allclose(old_conf, new_conf, atol=1e-5).item()
    before = float(grown.evaluate()["val_loss"])
    grown.fit()
    assert mx.abs(grown.model.layers[-1].self_attn.o_proj.weight).max().item() > 0  # trained away from zero
    assert grown.evaluate()["val_loss"] < before
    # the export loads in the engine with its new depth
    model, _ = checkpoint.load_checkpoint(grown.export_dir, eng.target, mode="dspark")
    assert len(model.layers) == n + 2


def test_init_from_refuses_a_drafter_of_another_target(tiny, tmp_path):
    eng, exs = tiny
    other = make_tiny_engine("llama", seed=1, layers=6, hidden=96)
    t = Trainer(other, exs, [], tmp_path / "other", small_config(steps=1))
    t.fit()
    from engine.errors import TandemError

    with pytest.raises(TandemError, match="hidden size mismatch: the drafter has 96, tiny-llama has 64"):
        Trainer(eng, exs, [], tmp_path / "b", small_config(init_from=str(t.export_dir)))
    with pytest.raises(TandemError, match="not found"):
        Trainer(eng, exs, [], tmp_path / "c", small_config(init_from=str(tmp_path / "nowhere")))
    (t.export_dir / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(TandemError, match="model.safetensors: safetensors file is corrupt"):
        Trainer(other, exs, [], tmp_path / "d", small_config(init_from=str(t.export_dir)))
    (t.export_dir / "model.safetensors").unlink()
    with pytest.raises(TandemError, match="model.safetensors is missing"):
        Trainer(other, exs, [], tmp_path / "e", small_config(init_from=str(t.export_dir)))


def test_self_prompt_openings_come_from_a_name_or_a_file(tmp_path):
    from engine.errors import TandemError
    from engine.train.data import BUILTIN_OPENINGS, self_prompt_openings

    assert self_prompt_openings("none") == [""] and self_prompt_openings("builtin") == list(BUILTIN_OPENINGS)
    assert any("Python" in o for o in BUILTIN_OPENINGS) and "" in BUILTIN_OPENINGS
    f = tmp_path / "o.txt"
    f.write_text("Write code\\n```python\\n\n\nExplain\n", encoding="utf-8")
    assert self_prompt_openings(str(f)) == ["Write code\n```python\n", "", "Explain"]
    with pytest.raises(TandemError, match="not 'none', 'builtin' or a text file"):
        self_prompt_openings(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(TandemError, match="is empty"):
        self_prompt_openings(str(tmp_path / "empty.txt"))


def test_examples_file_roundtrip(tmp_path):
    exs = [Example("gsm8k", [1, 2], [3, 0]), Example("mt-bench", [4], [])]
    for name in ("x.jsonl", "x.jsonl.gz"):
        save_examples(tmp_path / name, exs)
        assert load_examples(tmp_path / name) == exs


def test_cli_runs_every_stage_on_a_tiny_gguf(tmp_path, monkeypatch, capsys):
    """tandem train-drafter end to end: encode, generate, train, report (acceptance through the
    engine loop, identical to baseline output)."""
    from engine.cli import main
    from tests.test_gguf import write_tiny_gguf

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, "llama")
    for name, n in (("gsm8k", 6), ("mt-bench", 2)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [f"the low {i} is a"]}) + "\n" for i in range(n)))
    openings = tmp_path / "openings.txt"
    openings.write_text("the low\n\na\\nb\n")
    out = tmp_path / "run"
    argv = ["train-drafter", "--model", str(gguf), "--out", str(out), "--data", str(tmp_path / "gsm8k.jsonl"),
            "--eval-data", str(tmp_path / "mt-bench.jsonl"), "--max-new-tokens", "16", "--tap-layers", "0",
            "--layers", "1", "--block-size", "3", "--markov-rank", "4", "--intermediate-size", "0", "--steps", "3",
            "--batch-seqs", "2", "--anchors", "4", "--report-prompts", "1", "--report-max-new-tokens", "8",
            "--benchmark-trials", "0", "--self-prompts", "8", "--samples-per-prompt", "1",
            "--self-prompt-openings", str(openings), "--mirror", str(tmp_path / "mirror")]
    assert main(argv) == 0
    assert len(load_examples(out / "data" / "train.jsonl.gz")) == 6
    extra = load_examples(out / "data" / "extra.jsonl.gz")  # 6 sampled answers + the self-prompted ones
    assert sum(e.source == "gsm8k" for e in extra) == 6 and all(e.answer for e in extra)
    # self-prompts start, in turn, from the openings file's lines (one of them left to the target)
    from engine.loading import load_model
    from engine.train.pipeline import chat_frame

    tok = load_model(str(gguf)).tokenizer
    before, _ = chat_frame(tok)
    opened = [tok.encode(o, add_special_tokens=False) for o in ("the low", "a\nb")]
    starts = [next((k for k, o in enumerate(opened) if e.prompt[len(before):len(before) + len(o)] == o), None)
              for e in extra if e.source == "self"]
    assert all(e.prompt[:len(before)] == before for e in extra if e.source == "self")
    assert {0, 1} <= set(starts), starts  # seeded: 4 of the 8 turns end in time, both openings among them
    report = json.loads((out / "report.json").read_text())
    assert report["acceptance"]["identical_to_baseline"] is True
    assert report["acceptance"]["tokens_per_round"]["chat"] >= 1.0
    assert (tmp_path / "mirror" / "drafter-model.safetensors").is_file()
    assert main(argv[:-2] + ["--stages", "train"]) == 0  # resumes: already at its last step
    assert "resumed from" in (out / "train.log").read_text()
    assert main(argv[:-2] + ["--stages", "train", "--extend", "--steps", "2"]) == 0  # two more, lr restarted
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 5 and state["restart_step"] == 3
    capsys.readouterr()
    assert main(argv[:-2] + ["--stages", "train", "--grow-layers", "1"]) == 1  # nothing to grow
    assert "--grow-layers adds layers to the drafter --init-from names" in capsys.readouterr().err


@pytest.mark.slow
def test_shipped_starter_drafter_is_registered_trained_and_lossless(starter_engine):
    """resources/drafters/smollm2-135m-dspark: small, without the target's embedding/head (the
    loader takes them from the starter), what --mode auto runs on the starter (behind n-gram
    lookup, as its registry row says), trained (drafts land: a random drafter gives 1.0 token
    per round), and drafting for the real starter changes no token."""
    from engine import registry
    from engine.drafters.lookup_first import LookupFirst
    from engine.paths import resources_dir
    from tests.lossless import assert_same_greedy

    folder = resources_dir() / "drafters" / "smollm2-135m-dspark"
    config = json.loads((folder / "config.json").read_text())
    assert config["use_target_embeddings"] and config["target_layer_ids"] == [1, 8, 14, 20, 27]
    assert (folder / "model.safetensors").stat().st_size < 24 * 2**20  # a small repo
    assert "embed_tokens.weight" not in mx.load(str(folder / "model.safetensors"))
    eng = starter_engine
    assert eng.drafter_path is None and eng.lookup_first is None
    assert registry.usable_row(eng, "dspark")["drafter"] == "resources:drafters/smollm2-135m-dspark"
    assert registry.auto_mode(eng) == "dspark" and isinstance(eng.drafter("dspark"), LookupFirst)
    prompt = eng.encode("Write a Python function that returns the squares of a list of numbers.")
    base = eng.generate(prompt, mode="baseline", max_new_tokens=40)
    # the drafter's own cap: --max-draft auto would first calibrate this machine (80 s here), not what this checks
    both = eng.generate(prompt, mode="auto", max_new_tokens=40, max_draft=0)
    assert_same_greedy(eng.model, prompt, base.token_ids, both.token_ids, "auto (shipped drafter + lookup)")
    eng.lookup_first = False  # the drafter alone
    try:
        spec = eng.generate(prompt, mode="dspark", max_new_tokens=40, max_draft=0)
    finally:
        eng.lookup_first = None
    assert_same_greedy(eng.model, prompt, base.token_ids, spec.token_ids, "dspark (shipped drafter)")
    assert spec.mean_accepted >= 2.0, spec.mean_accepted  # 3.9 tokens per round with the fifth drafter
