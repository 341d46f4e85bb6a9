"""Stable shapes (engine/shapes.py, forced on the CPU): padded verifies and capacity-shaped
attention leave outputs and caches exactly as without them, and after the warm-up a generation
meets no shape the warm-up did not run.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from engine.sampling import Sampler, SamplingParams
from engine.shapes import ShapePolicy, StableKVCache, capacity_mask
from tests.test_batch import _post
from tests.tiny import make_tiny_engine

PROMPT = [5, 9, 14, 3, 22, 7, 30, 11]


@pytest.fixture(scope="module")
def eng():
    return make_tiny_engine("qwen3", seed=2, scale=4.0)


def test_stable_cache_forwards_match_the_plain_cache_and_roll_back_exactly(eng):
    from mlx_lm.models.cache import make_prompt_cache

    model = eng.model
    plain, stable = make_prompt_cache(model), [StableKVCache(16) for _ in model.layers]
    ids = mx.array([[3, 8, 2, 9, 4, 7, 1, 5, 6, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]])
    for chunk in (ids[:, :7], ids[:, 7:8], ids[:, 8:13], ids[:, 13:21]):  # growth past one 16-row step
        want, got = model(chunk, cache=plain), model(chunk, cache=stable)
        assert np.allclose(np.array(got), np.array(want), atol=1e-4)
    assert stable[0].keys.shape[2] == 32 and stable[0].offset == plain[0].offset == 21
    for c in plain + stable:
        c.trim(6)  # rejected drafts and padding
    for chunk in (ids[:, 15:16], ids[:, 2:6]):
        want, got = model(chunk, cache=plain), model(chunk, cache=stable)
        assert np.allclose(np.array(got), np.array(want), atol=1e-4)
    assert np.array_equal(np.array(stable[0].keys[..., : stable[0].offset, :]),
                          np.array(plain[0].keys[..., : plain[0].offset, :]))
    mask = capacity_mask(3, 2, 8)
    assert mask.tolist() == [[True] * 4 + [False] * 4, [True] * 5 + [False] * 3]
    window = capacity_mask(5, 1, 8, window=2)
    assert window.tolist() == [[False] * 4 + [True] * 2 + [False] * 2]


def test_a_multi_row_forward_gets_one_additive_mask_bit_identical_to_the_bool_one(monkeypatch):
    # MLX's GPU attention takes additive masks and converts a bool one in every layer (on the
    # H200 that was 0.6 ms of a 2-row verify of the starter): the cache hands over one, made once.
    from engine import shapes
    from tests.tiny import make_tiny_model

    model = make_tiny_model("llama", seed=3)
    ids = mx.array([[3, 8, 2, 9, 4, 7, 1, 5, 6, 12, 13]])
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        model.set_dtype(dtype)
        outs = []
        for additive in (shapes.additive, lambda mask, dtype: mask):
            monkeypatch.setattr(shapes, "additive", additive)
            cache = [StableKVCache(16) for _ in model.layers]
            model(ids[:, :7], cache=cache)
            outs.append(model(ids[:, 7:11], cache=cache))
            assert cache[0].make_mask(1) is None  # a step keeps MLX's own path
        monkeypatch.undo()
        cache = [StableKVCache(16) for _ in model.layers]
        model(ids[:, :7], cache=cache)
        mask = cache[0].make_mask(4)
        assert mask.dtype == dtype and mask.shape == (4, 16)
        seen = capacity_mask(7, 4, 16)
        assert mx.array_equal(mask == 0, seen).item()
        lowest = mx.array(mx.finfo(dtype).min, dtype)
        assert mx.all(mx.where(seen, lowest, mask) == lowest).item()
        assert mx.array_equal(outs[0], outs[1]).item(), dtype


def test_stabilize_changes_only_the_full_attention_caches():
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    from engine.caches import stabilize

    policy = ShapePolicy(step=16)
    mixed = [RotatingKVCache(max_size=8), KVCache(), ArraysCache(size=2), CacheList(ArraysCache(size=2), KVCache())]
    out = stabilize(mixed, policy)
    assert [type(c) for c in out[:3]] == [RotatingKVCache, StableKVCache, ArraysCache]
    assert out[0] is mixed[0] and out[2] is mixed[2] and out[1].step == 16
    assert [type(c) for c in out[3].caches] == [ArraysCache, StableKVCache]
    recurrent = [ArraysCache(size=2), RotatingKVCache(max_size=8)]
    assert stabilize(recurrent, policy) is recurrent  # nothing to stabilize
    used = [KVCache(), RotatingKVCache(max_size=8)]
    used[0].update_and_fetch(mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)))
    assert stabilize(used, policy) is used  # a cache in use keeps its kind
    assert stabilize(mixed, None) is mixed


def test_a_low_precision_target_keeps_stable_shapes_within_its_rounding(monkeypatch):
    """On CUDA a bf16 verify over the whole masked buffer rounds about an ulp away from the sliced
    one (another reduction order). The shape probe allows a bf16 model its rounding (fp32's
    1e-3 refused the policy for every bf16 target on the H200: compile storms all round) and
    still refuses, saying why, a difference beyond it."""
    from engine.target import Target

    eng = make_tiny_engine("qwen3", seed=2, scale=4.0)
    eng.target.model.set_dtype(mx.bfloat16)
    two_step = Target._two_step_logits

    def stable_off_by(share):
        def logits(self, ids, cache):
            out = two_step(self, ids, cache)
            if not any(isinstance(c, StableKVCache) for c in cache):
                return out
            return out.astype(mx.float32) + share * mx.abs(out.astype(mx.float32)).max()
        return logits

    from engine.doctor import model_rows

    monkeypatch.setattr(Target, "_two_step_logits", stable_off_by(5e-3))
    eng.target.set_shapes(ShapePolicy(step=16))
    assert eng.target.shapes == ShapePolicy(step=16) and eng.target.shapes_refused == ""
    assert dict(model_rows(eng))["Shapes"].startswith("stable: KV buffers in steps of 16 rows")
    monkeypatch.setattr(Target, "_two_step_logits", stable_off_by(0.1))
    eng.target.set_shapes(ShapePolicy(step=16))
    assert eng.target.shapes is None and "differ" in eng.target.shapes_refused
    assert "refused: a padded verify's logits differ" in dict(model_rows(eng))["Shapes"]  # `tandem doctor` says so
    eng.target.model.set_dtype(mx.float32)  # fp32 keeps the strict bound
    monkeypatch.setattr(Target, "_two_step_logits", stable_off_by(5e-3))
    eng.target.set_shapes(ShapePolicy(step=16))
    assert eng.target.shapes is None and "float32" in eng.target.shapes_refused


@pytest.mark.parametrize("kind", ["lookup", "dspark"])
def test_padded_verifies_are_lossless_and_use_ladder_widths_only(kind, tmp_path):
    from tests.drafter_ckpt import target_config_of, dspark_checkpoint, copy_target_head, write

    eng = make_tiny_engine("qwen3", seed=4, scale=4.0)
    if kind == "dspark":
        cfg, w = dspark_checkpoint(target_config_of(eng.model), markov_rank=16, taps=[0, 1, 2])
        copy_target_head(w, eng.model)
        eng.drafter_path = str(write(tmp_path / "d", cfg, w))
    copy = PROMPT * 3
    base = eng.generate(copy, mode="baseline", max_new_tokens=60)
    eng.target.set_shapes(ShapePolicy(step=16, widths=(1, 2, 4, 8)))
    assert eng.target.shapes is not None and isinstance(eng.target.new_cache()[0], StableKVCache)
    widths = []
    forward = eng.target.forward
    eng.target.forward = lambda ids, cache, **kw: widths.append(ids.shape[1]) or forward(ids, cache, **kw)
    try:
        res = eng.generate(copy, mode=kind, max_new_tokens=60, max_draft=5)
    finally:
        eng.target.forward = forward
    assert res.token_ids == base.token_ids
    verifies = set(widths) - {len(copy)}  # all but the prefill
    assert res.drafted > 0 and verifies <= {1, 2, 4, 8} and verifies & {4, 8}
    if kind == "dspark":  # the drafter's attention sees its whole context buffer, masked
        drafter = eng.drafter("dspark")
        assert all(kv.stable and kv.keys.shape[2] % 16 == 0 for kv in drafter._caches)


def dspark_engine_under_policy(tmp_path):
    """A tiny Qwen3 with a DSpark drafter under a small shape policy (16-row steps, widths to 8)."""
    from tests.drafter_ckpt import target_config_of, dspark_checkpoint, copy_target_head, write

    eng = make_tiny_engine("qwen3", seed=4, scale=4.0)
    cfg, w = dspark_checkpoint(target_config_of(eng.model), markov_rank=16, taps=[0, 1, 2])
    copy_target_head(w, eng.model)
    eng.drafter_path = str(write(tmp_path / "d", cfg, w))
    eng.target.set_shapes(ShapePolicy(step=16, widths=(1, 2, 4, 8)))
    return eng


def test_after_the_warm_up_a_generation_meets_no_new_shape(tmp_path):
    eng = dspark_engine_under_policy(tmp_path)
    shapes: set = set()
    forward = eng.target.forward
    sdpa = mx.fast.scaled_dot_product_attention

    def record(q, k, v, **kw):  # every attention call: (query rows, key rows)
        shapes.add((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kw)

    mx.fast.scaled_dot_product_attention = record
    projected: set = set()  # rows per drafter context projection
    backbone = eng.drafter("dspark").model
    append_context = backbone.append_context
    backbone.append_context = lambda hidden, caches: projected.add(hidden.shape[0]) or append_context(hidden, caches)
    try:
        seen = []
        eng.warm_up(["lookup", "dspark"], tokens=48, progress=lambda d, t, s: seen.append((d, t)))
        assert seen[-1][0] == seen[-1][1]
        warm, warm_projected = set(shapes), set(projected)
        shapes.clear()
        projected.clear()
        eng.generate(PROMPT * 2, mode="dspark", max_new_tokens=24, max_draft=5)
        eng.generate(PROMPT * 2, mode="lookup", max_new_tokens=24, max_draft=7)
        # A parked stretch: 45 rows committed by plain steps wait, then one proposal projects them.
        drafter = eng.drafter("dspark")
        drafter.commit([], 45, mx.zeros((45, backbone.fc.weight.shape[-1]), dtype=drafter.dtype))
        drafter.reserve(drafter.context_len)
    finally:
        mx.fast.scaled_dot_product_attention = sdpa
        eng.target.forward = forward
        backbone.append_context = append_context
    # Context rows (the prompt's, a round's, a parked stretch's) are projected in power-of-two
    # pieces, each size warmed.
    assert {32, 8, 4, 1} <= projected <= warm_projected
    assert all(n & (n - 1) == 0 for n in projected)
    # Multi-row attention (verifies, drafter blocks) must all have been warmed. Prefill chunks go
    # by prompt length, and one-row steps see a slice that MLX serves from shape-stable kernels
    # (CUDA: a vector kernel, or cuDNN keyed on the buffer's capacity).
    decode_shapes = {s for s in shapes if 1 < s[0] <= 8}
    assert decode_shapes and decode_shapes <= warm
    assert {k for _, k in decode_shapes} <= {16, 32, 48}  # key rows: buffer capacities only


def test_a_draft_model_under_the_shape_policy_feeds_power_of_two_pieces_losslessly(monkeypatch):
    from engine.drafters.draft_model import DraftModelDrafter
    from tests.tiny import make_tiny_model

    eng = make_tiny_engine("qwen3", seed=4, scale=4.0)
    copy = PROMPT * 3
    base = eng.generate(copy, mode="baseline", max_new_tokens=48)
    policy = ShapePolicy(step=16, widths=(1, 2, 4, 8))
    eng.target.set_shapes(policy)
    draft_model = make_tiny_model("llama", seed=6)  # another class than the target's: its calls are its own
    widths: list[int] = []
    call = type(draft_model).__call__
    monkeypatch.setattr(type(draft_model), "__call__",
                        lambda self, ids, *a, **kw: widths.append(ids.shape[1]) or call(self, ids, *a, **kw))
    drafter = DraftModelDrafter(draft_model, max_draft=4, shapes=policy)
    drafter.warm_up(32)  # every piece width at a 32-row buffer, and nothing left behind
    assert widths == [1, 1, 2, 4, 8, 16] and drafter._cached == []
    eng.set_drafter("draft", drafter)
    for cap in (4, "auto"):  # auto parks on drafts that miss: pending rows pile up for the next probe
        widths.clear()
        res = eng.generate(copy, mode="draft", max_new_tokens=48, max_draft=cap)
        assert res.token_ids == base.token_ids
        assert widths and all(w & (w - 1) == 0 for w in widths), widths
        assert all(isinstance(c, StableKVCache) and c.keys.shape[2] % 16 == 0 for c in drafter._cache)
    # Nothing is fed at begin; the catch-up feeds the 23 prompt tokens before the anchor as
    # 16 + 4 + 2 + 1 rows, and a proposal the 13 tokens behind the draft cache as 8 + 4 + 1.
    widths.clear()
    drafter.begin(copy, None)
    assert widths == [] and drafter.state() is None
    assert drafter.catch_up(copy) == len(copy) - 1 and widths == [16, 4, 2, 1]
    assert drafter.catch_up(copy + [3]) == 0  # a short backlog waits for the proposal's graph
    widths.clear()
    drafter.propose(copy + list(range(3, 15)), 2, Sampler(SamplingParams()))
    assert widths == [8, 4, 1, 1]  # the pieces, then one draft step


def attention_shapes(monkeypatch) -> set:
    """The (rows, query rows, key rows) of every attention call from now on, on any thread."""
    shapes: set = set()
    sdpa = mx.fast.scaled_dot_product_attention

    def record(q, k, v, **kw):
        shapes.add((q.shape[0], q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", record)
    return shapes


def test_after_the_batch_warm_up_a_batch_meets_no_new_shape(tmp_path, monkeypatch):
    """A batch multiplies the shapes by its row count: after ``batching.warm_up`` for 3 rows, three
    requests of different lengths decoding together (lookup and DSpark) run only warmed
    multi-row attention shapes (rows, query rows, key rows)."""
    from engine.api import generate_batch
    from engine.batching import warm_up

    eng = dspark_engine_under_policy(tmp_path)
    prompts = [PROMPT * 2, PROMPT * 3 + [4], PROMPT[:5] * 2]
    shapes = attention_shapes(monkeypatch)
    seen = []
    warm_up(eng, ["lookup", "dspark"], 3, lambda d, t, s: seen.append((d, t, s)), tokens=64)
    assert seen[-1][0] == seen[-1][1] and any("3-row batch shapes" in s for _, _, s in seen)
    warm = set(shapes)
    shapes.clear()
    for mode in ("dspark", "lookup"):
        got = generate_batch(eng, prompts, max_batch=3, mode=mode, max_new_tokens=24, max_draft=5)
        assert max(r.batch_width for r in got) == 3
    batched = {s for s in shapes if s[0] > 1 and 1 < s[1] <= 8}
    assert batched and batched <= warm, sorted(batched - warm)
    assert {k for _, _, k in batched} <= {16, 32, 48, 64}


LONG_TEXT = " ".join(f"w{(7 * i) % 23}" for i in range(60))  # past the 32 tokens warmed at load


def _idle_warming_server(eng, monkeypatch):
    """``tandem serve --max-batch 2 --mode dspark`` on ``eng``, warmed at load to 32 tokens, idle
    steps 10 ms apart; started and ready."""
    from engine.batching import warm_up
    from engine.serve import worker
    from engine.serve.server import make_server

    monkeypatch.setattr(worker, "IDLE_WARM_S", 0.01)

    def load():
        warm_up(eng, ["dspark"], 2, tokens=32)
        return eng

    srv = make_server(load, port=0, max_batch=2, mode="dspark", max_draft=5).start()
    srv.wait_ready(60)
    assert eng.warmed.tokens == 32
    return srv


def test_an_idle_server_compiles_the_shapes_past_its_longest_request(tmp_path, monkeypatch):
    """Under a shape policy, ``tandem serve``'s engine thread, idle, compiles the KV capacities past
    its warm-up up to one step beyond the longest request it served (an agent's next request is
    longer): a batch at that length then meets only compiled multi-row attention shapes, and its
    answers are the lone ones."""
    from engine.api import generate_batch

    eng = dspark_engine_under_policy(tmp_path)  # KV capacities in steps of 16
    shapes = attention_shapes(monkeypatch)
    srv = _idle_warming_server(eng, monkeypatch)
    try:
        status, _, body = _post(srv.url, {"prompt": LONG_TEXT, "max_tokens": 8})  # one row: no batch shape
        assert status == 200, body
        longest = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        assert longest > 48
        want = -(-(longest + 16) // 16) * 16
        deadline = time.monotonic() + 60
        while eng.warmed.tokens < want and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.warmed.tokens == want
    finally:
        srv.stop()
    warm = {s for s in shapes if s[0] > 1}
    assert {k for _, _, k in warm} >= set(range(48, want + 1, 16))  # the idle steps' capacities
    shapes.clear()
    prompts = [PROMPT * 8, (PROMPT * 9)[:-3]]  # 64 and 69 tokens: past the load-time warm-up
    got = generate_batch(eng, prompts, max_batch=2, mode="dspark", max_new_tokens=12, max_draft=5)
    assert max(r.batch_width for r in got) == 2
    batched = {s for s in shapes if s[0] > 1 and 1 < s[1] <= 8}
    assert batched and batched <= warm, sorted(batched - warm)
    for p, r in zip(prompts, got):
        assert r.token_ids == eng.generate(p, mode="dspark", max_new_tokens=12, max_draft=5, prefix_cache=False).token_ids


def test_a_failed_idle_warm_up_step_leaves_the_server_serving(tmp_path, monkeypatch):
    """A step of the idle warm-up that fails (out of memory at a long context, say) is logged and
    ends the idle warm-up; the engine thread goes on answering, with the same text."""
    from engine import warmup

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    eng = dspark_engine_under_policy(tmp_path)
    srv = _idle_warming_server(eng, monkeypatch)
    monkeypatch.setattr(warmup, "_target_shapes", out_of_memory)  # after the load-time warm-up
    try:
        replies = []
        for _ in range(2):
            status, _, body = _post(srv.url, {"prompt": LONG_TEXT, "max_tokens": 8})
            assert status == 200, body
            replies.append(body["choices"][0]["text"])
            deadline = time.monotonic() + 30
            while srv.worker.warm_ahead and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not srv.worker.warm_ahead and eng.warmed.tokens == 32
        assert replies[0] == replies[1]
    finally:
        srv.stop()


def test_a_benchmark_warms_up_to_its_longest_context(monkeypatch):
    """Under a shape policy the benchmark compiles every context its prompts reach before timing
    (not only the load-time default): no timed pass, and no arm, pays another's compiles."""
    from engine import warmup
    from engine.benchmark import Arm, run_benchmark

    monkeypatch.setattr(warmup, "WARM_TOKENS", 32)
    eng = make_tiny_engine("llama", seed=4, scale=4.0)
    eng.target.set_shapes(ShapePolicy(step=16, widths=(1, 2, 4)))
    run_benchmark(eng, [("chat", PROMPT * 8)], [Arm("baseline")], trials=1, max_new_tokens=8, bandwidth=1e9)
    assert eng.warmed.tokens == 80  # 64 prompt tokens and 8 new ones: the 80-row capacity
