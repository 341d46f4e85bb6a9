"""A batch's rows whose drafters share one model propose together (``propose_rows``): EAGLE-3 and
MTP heads run each chain step once over every row (their attention over a left-padded copy of each
row's committed rows, their own caches untouched), DFlash and DFlash 2 one block forward and one
head forward, DSpark those and its Markov chain (keeping each row's confidence cut), a draft model
each of its forwards through every row's own cache, and lookup-first rows take their own lookup
drafts. Each row's drafts and q are those it gets proposing alone, with rows of different context
lengths and caps; sampled rows proposing together sample the target exactly."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import caches
from engine.batch import BatchRow
from engine.drafters import formats
from engine.sampling import Sampler, SamplingParams
from engine.shapes import ShapePolicy
from engine.speculative import FixedCap
from tests import drafter_ckpt as ck
from tests.test_block_drafters import bigram_engine, drafter_for, write_dflash, write_dspark
from tests.test_dflash2 import write_dflash2
from tests.test_mtp import sidecar_config
from tests.test_mtp_nextn import CONFIGS, build, nextn_tensors
from tests.test_sampling import assert_exact
from tests.tiny import make_tiny_engine, make_tokenizer

GREEDY = Sampler(SamplingParams())
KINDS = ["eagle3", "mtp", "deepseek_v3", "glm4_moe", "dflash", "dflash2"]


def drafter_of(kind: str, tmp_path):
    """(engine, drafter) with random weights, so attention and every draft depend on the context."""
    from engine.generate import Engine

    if kind in ("deepseek_v3", "glm4_moe"):
        model = build(kind, 2, seed=3)
        tensors = nextn_tensors(kind, model, build(kind, 3, seed=4).model.layers[2], scale=0.5)
        engine = Engine(model, make_tokenizer(model.args.vocab_size), name=f"tiny-{kind}")
        head = formats.load_mtp_head(engine.target, dict(CONFIGS[kind]), {k: mx.array(v) for k, v in tensors.items()},
                                     where="test")
        return engine, formats.mtp_drafter(head, engine.target)
    if kind == "mtp":
        engine = bigram_engine()
        config = sidecar_config(engine)
        tensors = ck.mtp_tensors(config["text_config"], seed=1, prefix="")
        head = formats.load_mtp_head(engine.target, config, {k: mx.array(v) for k, v in tensors.items()}, where="test")
        return engine, formats.mtp_drafter(head, engine.target)
    engine = make_tiny_engine("qwen3", seed=3)
    if kind == "eagle3":
        # Attention spread over every row (small queries) and weighing in the output (large
        # o_proj): a padded or foreign row in a row's attention would show.
        cfg, w = ck.eagle3_checkpoint(ck.target_config_of(engine.model), aux=[1, 2], scale=0.5)
        w["layers.0.self_attn.q_proj.weight"] *= 0.05
        w["layers.0.self_attn.o_proj.weight"] *= 8
        return engine, drafter_for(engine, ck.write(tmp_path / kind, cfg, w), kind)
    write = {"dflash": write_dflash, "dflash2": write_dflash2}[kind]
    return engine, drafter_for(engine, write(tmp_path / kind, engine, taps=[0, 2], scale=0.5), "dflash")


def started_rows(engine, drafter, contexts):
    """One fork of ``drafter`` per context, begun on its prompt (the last token is the anchor)."""
    target = engine.target
    target.set_taps(drafter.tap_layers)
    rows = []
    for ids in contexts:
        d = drafter.fork()
        _, hidden = target.prefill(ids[:-1], target.new_cache(), tap=True)
        d.begin(ids[:-1], hidden)
        rows.append((d, ids))
    return rows


def committed(drafter) -> list[np.ndarray]:
    """Each layer's committed keys and values (a buffer's rows past its offset are scratch)."""
    return [np.array(a[..., : c.offset, :]) for c in drafter._caches for a in (c.keys, c.values)]


@pytest.mark.parametrize("kind", KINDS)
def test_rows_propose_together_what_each_proposes_alone(kind, tmp_path, monkeypatch):
    engine, drafter = drafter_of(kind, tmp_path)
    vocab = engine.target.vocab_size
    contexts = [[(7 * i + 3) % vocab for i in range(n)] for n in (9, 4, 14)]
    rows = started_rows(engine, drafter, contexts)
    caps = [drafter.max_draft, 2, 3]
    # How many rows each forward of the drafter's own layers carried.
    forwards: list[int] = []
    if kind.startswith("dflash"):
        model_type, name = type(drafter.model), "block_rows"
    else:
        model_type, name = type(drafter), "run_rows"
    original = getattr(model_type, name)
    monkeypatch.setattr(model_type, name, lambda self, x, *a: forwards.append(x.shape[0]) or original(self, x, *a))

    alone = [d.propose(ids, cap, GREEDY) for (d, ids), cap in zip(rows, caps)]
    before = [committed(d) for d, _ in rows]
    forwards.clear()
    together = type(drafter).propose_rows([(d, ids, cap, GREEDY) for (d, ids), cap in zip(rows, caps)])
    assert [a.tokens.tolist() for a in alone] == [t.tokens.tolist() for t in together]
    assert [len(t) for t in together] == [min(c, drafter.max_draft) for c in caps]
    assert forwards and set(forwards) == {3}  # every forward carried the three rows
    for (d, _), cached in zip(rows, before):  # the rows' committed state is only read
        assert all(np.array_equal(a, b) for a, b in zip(committed(d), cached))

    # A row with nothing to draft (cap 0) gets None; the others still propose together.
    forwards.clear()
    mixed = type(drafter).propose_rows([(d, ids, cap, GREEDY) for (d, ids), cap in zip(rows, [0, 2, 3])])
    assert mixed[0] is None
    assert [m.tokens.tolist() for m in mixed[1:]] == [a.tokens.tolist()[:cap] for a, cap in zip(alone[1:], (2, 3))]
    assert set(forwards) == {2}

    samplers = lambda: [Sampler(SamplingParams(0.9, 1.0, 0, seed=s)) for s in (1, 2, 3)]  # noqa: E731
    alone = [d.propose(ids, cap, s) for (d, ids), cap, s in zip(rows, caps, samplers())]
    together = type(drafter).propose_rows([(d, ids, cap, s) for (d, ids), cap, s in zip(rows, caps, samplers())])
    for a, t in zip(alone, together):
        assert a.tokens.tolist() == t.tokens.tolist()
        assert np.abs(np.array(a.probs) - np.array(t.probs)).max() < 1e-5
    first_q = [np.array(a.probs[0]) for a in alone]  # the rows' distributions differ: nothing above is vacuous
    assert min(np.abs(p - q).max() for i, p in enumerate(first_q) for q in first_q[i + 1:]) > 1e-3




def draft_cache_rows(cache) -> list[np.ndarray]:
    """A draft cache's rows the next query sees, per layer: a full-attention cache's up to its
    offset (a buffer's rows past it are scratch), a sliding window's last ``max_size - 1`` in
    temporal order (a multi-row update and a one-row one lay the same window out differently)."""
    from mlx_lm.models.cache import ArraysCache, RotatingKVCache

    out = []
    for c in caches.leaves(cache):
        if type(c) is ArraysCache:
            out += [np.array(a) for a in c.cache if a is not None]
        elif type(c) is RotatingKVCache:
            seen = min(c.offset, c.max_size - 1)
            out += [np.array(c._temporal_order(a)[..., -seen:, :]) for a in (c.keys, c.values)] + [np.array(c.offset)]
        else:
            out += [np.array(a[..., : c.offset, :]) for a in (c.keys, c.values)]
    return out


@pytest.mark.parametrize("arch,policy", [("llama", None), ("llama", ShapePolicy()), ("llama-sliding", None),
                                         ("gemma3", ShapePolicy()), ("qwen3_5", None), ("nemotron_h", ShapePolicy()),
                                         ("lfm2", None)])
def test_draft_model_rows_propose_together_what_each_proposes_alone(arch, policy, monkeypatch):
    """A draft model's rows run each forward once over the rows that need it, through their own
    caches: the first over every row's pending tokens (ragged: padded, the padding dropped by a
    transaction per row), then one a draft over the rows still drafting. With full attention,
    a shape policy's buffers (power-of-two padding), sliding windows past their size and
    recurrent state (no padding: a forward per pending length, each row's state cut out), each
    row's drafts, q, cache rows and bookkeeping are those its own ``propose`` leaves, over two
    rounds (the second after commits that leave 1 or 2 tokens pending, or roll a window back)."""
    from engine.drafters.draft_model import DraftModelDrafter
    from tests.tiny import make_tiny_model

    engine = make_tiny_engine("llama", seed=4)
    base = DraftModelDrafter(make_tiny_model(arch, seed=5), max_draft=4, shapes=policy)
    vocab = engine.target.vocab_size
    contexts = [[(7 * i + 3) % vocab for i in range(n)] for n in (9, 4, 14)]
    caps = [4, 2, 3]
    rows_in_forward: list[int] = []
    model_type = type(base.model)
    call = model_type.__call__
    monkeypatch.setattr(model_type, "__call__",
                        lambda self, x, *a, **k: rows_in_forward.append(x.shape[0]) or call(self, x, *a, **k))

    def check(alone_rows, together_rows, sampler, accepted=None):
        """One round each way; then, with ``accepted`` per row, the commits a verify would make."""
        samplers = sampler()
        alone = [d.propose(ids, cap, s) for (d, ids), cap, s in zip(alone_rows, caps, samplers)]
        rows_in_forward.clear()
        samplers = sampler()
        together = DraftModelDrafter.propose_rows([(d, ids, cap, s) for (d, ids), cap, s
                                                   in zip(together_rows, caps, samplers)])
        # The pending tokens in one forward (recurrent state: one per pending length, in pieces
        # under a shape policy), then the chain: caps 4, 2, 3, and a row feeds its first cap - 1 drafts.
        assert rows_in_forward[-3:] == [3, 2, 1]
        assert rows_in_forward[:-3] == [3] or caches.has_recurrent(together_rows[0][0]._cache)
        for a, t, (da, _), (dt, _) in zip(alone, together, alone_rows, together_rows):
            assert a.tokens.tolist() == t.tokens.tolist()
            assert (a.probs is None) == (t.probs is None)
            if a.probs is not None:
                assert np.abs(np.array(a.probs) - np.array(t.probs)).max() < 1e-5
            assert da._cached == dt._cached and da._uncommitted.tolist() == dt._uncommitted.tolist()
            assert [type(c) for c in caches.leaves(dt._cache)] == [type(c) for c in caches.leaves(da._cache)]
            held_alone, held_together = draft_cache_rows(da._cache), draft_cache_rows(dt._cache)
            assert [a.shape for a in held_alone] == [t.shape for t in held_together]
            assert all(np.allclose(a, t, atol=1e-5) for a, t in zip(held_alone, held_together))
        if accepted is None:
            return
        for rows in (alone_rows, together_rows):
            for i, ((d, ids), draft, n) in enumerate(zip(rows, alone, accepted)):
                new = ids + draft.tokens.tolist()[:n] + [(ids[-1] + 5) % vocab]
                d.commit(new, n + 1, None)
                rows[i] = (d, new)

    greedy = lambda: [GREEDY] * 3  # noqa: E731
    alone_rows, together_rows = started_rows(engine, base, contexts), started_rows(engine, base, contexts)
    check(alone_rows, together_rows, greedy, accepted=[4, 0, 2])  # row 0 then has two tokens pending
    check(alone_rows, together_rows, greedy)
    sampled = lambda: [Sampler(SamplingParams(0.9, 1.0, 0, seed=s)) for s in (1, 2, 3)]  # noqa: E731
    check(started_rows(engine, base, contexts), started_rows(engine, base, contexts), sampled)

@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_dspark_rows_propose_together_what_each_proposes_alone(tmp_path, head, monkeypatch):
    """A batch's DSpark rows share one block forward and one head forward (``propose_rows``):
    each row's drafts, its q and its confidence cut are those ``propose`` gives it alone, greedy
    and sampling."""
    from engine.drafters.dspark import DSparkDrafter

    engine = make_tiny_engine("qwen3", seed=3)
    path = write_dspark(tmp_path / head, engine, markov_rank=16, markov_head_type=head, taps=[0, 2], markov_scale=40.0)
    base = drafter_for(engine, path, "dspark")
    rows = started_rows(engine, base, [[7, 8, 9, 10, 11, 12], [3, 4, 5, 6], [20, 21, 22, 23, 24, 25, 26, 27]])
    caps = [base.max_draft, 3, 5]
    block_rows, batched = type(base.model).block_rows, []
    monkeypatch.setattr(type(base.model), "block_rows",
                        lambda model, x, caches: batched.append(x.shape[0]) or block_rows(model, x, caches))
    cut = 0
    for threshold in (0.0, 0.3, 0.45, 0.5, 0.55, 0.7):  # no cut, then confidence cuts per row
        base._threshold = lambda t=threshold: t
        for d, _ in rows:
            d._threshold = base._threshold
        greedy = [d.propose(ids, cap, GREEDY) for (d, ids), cap in zip(rows, caps)]
        together = DSparkDrafter.propose_rows([(d, ids, cap, GREEDY) for (d, ids), cap in zip(rows, caps)])
        assert [None if g is None else g.tokens.tolist() for g in greedy] == \
            [None if t is None else t.tokens.tolist() for t in together]
        cut += sum(g is None or len(g) < cap for g, cap in zip(greedy, caps))
    assert cut > 0  # some cut cut something
    assert batched and set(batched) == {3}  # one block forward over the three rows each time
    base._threshold = lambda: 0.0
    for d, _ in rows:
        d._threshold = base._threshold
    samplers = lambda: [Sampler(SamplingParams(0.8, 1.0, 20, seed=s)) for s in (1, 2, 3)]  # noqa: E731
    alone = [d.propose(ids, cap, s) for (d, ids), cap, s in zip(rows, caps, samplers())]
    together = DSparkDrafter.propose_rows([(d, ids, cap, s) for (d, ids), cap, s in zip(rows, caps, samplers())])
    for a, t in zip(alone, together):
        assert a.tokens.tolist() == t.tokens.tolist()
        assert np.abs(np.array(a.probs) - np.array(t.probs)).max() < 1e-6

def test_lookup_first_rows_take_their_lookup_drafts_and_the_rest_propose_together(tmp_path, monkeypatch):
    """Behind lookup-first (the starter's DSpark mode), a row whose context repeats takes its n-gram
    draft as alone, and the rows lookup leaves without one propose together through DSpark."""
    from engine.drafters.dspark import DSparkDrafter
    from engine.drafters.lookup_first import LookupFirst

    engine = make_tiny_engine("qwen3", seed=3)
    engine.lookup_first = True
    drafter = drafter_for(engine, write_dspark(tmp_path / "dspark", engine, markov_rank=16, taps=[0, 2]), "dspark")
    assert isinstance(drafter, LookupFirst)
    contexts = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 40, 3, 29, 17], [60, 2, 33, 48, 9, 21, 70]]
    rows = started_rows(engine, drafter, contexts)
    alone = [d.propose(ids, 4, GREEDY) for d, ids in rows]
    inner: list[int] = []
    propose_rows = DSparkDrafter.propose_rows
    monkeypatch.setattr(DSparkDrafter, "propose_rows",
                        staticmethod(lambda requests: inner.append(len(requests)) or propose_rows(requests)))
    together = LookupFirst.propose_rows([(d, ids, 4, GREEDY) for d, ids in rows])
    assert [a.source for a in alone] == [t.source for t in together] == ["lookup", "dspark", "dspark"]
    assert [a.tokens.tolist() for a in alone] == [t.tokens.tolist() for t in together]
    assert inner == [2]


def test_chain_rows_drafting_together_sample_the_target_exactly(tmp_path, monkeypatch):
    """Three rows at a time on one EAGLE-3 head, their sampled multi-token drafts proposed
    together (q sharper than p: rejections at every position): every row's tokens follow the
    target's exact conditionals."""
    from engine.drafters.eagle3 import Eagle3Drafter
    from tests.test_batch import tally_batches
    from tests.test_eagle3 import exact_eagle3
    from tests.test_sampling import CAP, LENGTH, PROMPT, VOCAB

    engine = bigram_engine(seed=5, vocab=VOCAB, scale=2.0)
    base = drafter_for(engine, exact_eagle3(tmp_path / "sharp", engine, sharpen=1.2, aux=[1, 2]), "eagle3")
    engine.target.set_taps(base.tap_layers)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    together: list[int] = []
    propose_rows = Eagle3Drafter.propose_rows
    monkeypatch.setattr(Eagle3Drafter, "propose_rows",
                        staticmethod(lambda requests: together.append(len(requests)) or propose_rows(requests)))

    def row(seed: int) -> BatchRow:
        # A seeded key stream (a deterministic test) on a request marked unseeded, as a server's
        # are: only unseeded rows propose together.
        sampler = Sampler(SamplingParams(1.0, 0.95, seed=2000 + seed))
        sampler.params = params
        return BatchRow(list(PROMPT), sampler, LENGTH, drafter=base.fork(), cap_policy=FixedCap(CAP))

    tally, widest = tally_batches(engine.target, row, params)
    assert widest == 3 and max(together) == 3
    assert_exact(tally)
