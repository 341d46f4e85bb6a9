"""A batch's full-attention keys and values kept in one buffer per layer (engine/slot_kv.py): rows
join and leave without losing a row, a batched forward over the slots gives each row its own
forward's logits, each row rolls back by its own accepted length, and the batch loop uses them."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine import batch_cache
from engine.batching import Batcher
from engine.caches import leaves
from engine.slot_kv import STEP, SlotKV, SlotLayer, Slots
from tests.lossless import assert_same_greedy
from tests.test_batch import PROMPTS, alone, assert_caches_clean, make_engine
from tests.tiny import make_tiny_engine


def slotted(cache):
    return any(type(c) is SlotKV for c in leaves(cache))


def prefilled(target, prompt):
    c = target.new_cache()
    target.prefill(prompt, c)
    return c


def test_rows_join_and_leave_with_their_rows_intact():
    rng = [mx.random.normal((1, 2, n, 8), key=mx.random.key(n)) for n in (5, 300, 17)]
    originals = []
    layer = SlotLayer()
    slots = []
    for x in rng:
        c = KVCache()
        c.update_and_fetch(x, -x)
        originals.append(c)
        slots.append(layer.join(c))
    assert layer.keys.shape[0] == 3 and layer.keys.shape[2] >= 300 and layer.keys.shape[2] % STEP == 0
    assert [s.offset for s in slots] == [5, 300, 17]
    middle = layer.leave(slots[1])  # the others close up and keep their rows
    assert type(middle) is KVCache and middle.offset == 300
    assert mx.array_equal(middle.keys, rng[1]) and mx.array_equal(middle.values, -rng[1])
    assert [s.index for s in (slots[0], slots[2])] == [0, 1]
    for s, x in ((slots[0], rng[0]), (slots[2], rng[2])):
        assert mx.array_equal(s.keys, x) and mx.array_equal(s.values, -x)
    for s in (slots[0], slots[2]):
        layer.leave(s)
    assert layer.keys is None and not layer.slots


def test_batched_forward_over_slots_is_each_rows_own_and_rolls_back_per_row():
    """Widths 1-5 on rows of different lengths, each keeping its own number of rows after each
    forward, across the buffer's growth: every row's logits equal its lone forward's over a
    plain cache that keeps the same rows."""
    eng = make_tiny_engine("llama")
    t = eng.target
    row_caches = [prefilled(t, p) for p in PROMPTS[:3]]
    lone = [prefilled(t, p) for p in PROMPTS[:3]]
    slots = Slots()
    for c in row_caches:
        slots.join(c)
    assert all(slotted(c) for c in row_caches)
    view = batch_cache.batch_view(row_caches)
    assert all(type(v) is SlotLayer for v in view)  # the fast path: the layer buffers themselves
    for step, width in enumerate((1, 4, 5, 2, 1, 3) * 20):
        ids = mx.array([[(7 * r + 3 * j + step) % 90 + 2 for j in range(width)] for r in range(3)], dtype=mx.uint32)
        logits, _, txns = t.verify_rows(ids, row_caches)
        for r in range(3):
            ref, _, ref_txn = t.verify(ids[r : r + 1], lone[r])
            gap = mx.abs(logits[r] - ref).max().item()
            assert gap < 1e-5, f"width {width} row {r}: {gap}"
            kept = 1 + (step + r) % width
            txns[r].commit(kept)
            ref_txn.commit(kept)
            assert row_caches[r][0].offset == lone[r][0].offset
    assert max(c[0].offset for c in row_caches) > STEP  # the buffer grew on the way
    for c, ref in zip(row_caches, lone):
        slots.leave(c)
        assert not slotted(c) and all(type(x) is KVCache for x in c)
        for x, y in zip(c, ref):  # to rounding: deeper layers' keys come from batched matmuls
            assert x.offset == y.offset
            assert mx.abs(x.keys[..., : x.offset, :] - y.keys[..., : y.offset, :]).max().item() < 1e-5
    assert not slots.layers


def test_a_forward_over_some_slots_only_takes_the_row_by_row_path():
    """A forward over a subset of the slots (or out of order) still gives each row its own
    logits, through ``RowBatch`` and each slot's own update."""
    t = make_tiny_engine("llama").target
    row_caches = [prefilled(t, p) for p in PROMPTS[:3]]
    lone = [prefilled(t, p) for p in PROMPTS[:3]]
    slots = Slots()
    for c in row_caches:
        slots.join(c)
    picked = [row_caches[2], row_caches[0]]
    assert all(type(v) is batch_cache.RowBatch for v in batch_cache.batch_view(picked))
    ids = mx.array([[5, 6, 7], [8, 9, 10]], dtype=mx.uint32)
    logits, _, txns = t.verify_rows(ids, picked)
    for b, r in enumerate((2, 0)):
        ref, _, ref_txn = t.verify(ids[b : b + 1], lone[r])
        assert mx.abs(logits[b] - ref).max().item() < 1e-5
        txns[b].commit(2)
        ref_txn.commit(2)
    assert row_caches[1][0].offset == lone[1][0].offset  # the row left out did not move


def test_a_slot_refuses_a_restore():
    layer = SlotLayer()
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, 2, 4)), mx.zeros((1, 1, 2, 4)))
    slot = layer.join(c)
    assert type(slot) is SlotKV
    try:
        slot.state = (None, None)
    except TypeError as e:
        assert "leaving the batch" in str(e)
    else:
        raise AssertionError("a slot took a state")
    try:
        layer.update_and_fetch(mx.zeros((2, 1, 1, 4)), mx.zeros((2, 1, 1, 4)))
    except ValueError as e:
        assert "2 rows over 1 slots" in str(e)
    else:
        raise AssertionError("a forward of more rows than slots")


def test_batch_loop_decodes_on_slots_and_hands_rows_plain_caches_back(monkeypatch):
    """In a batched run every round's full-attention layers are the slot buffers, each answer
    equals its lone one, and each finished row's caches are plain again and clean."""
    eng = make_engine("llama")
    kinds = []
    view = batch_cache.batch_view

    def spy(row_caches):
        out = view(row_caches)
        kinds.append({type(v).__name__ for v in out})
        return out

    monkeypatch.setattr(batch_cache, "batch_view", spy)
    budgets = (24, 9, 30, 16)
    batcher = Batcher(eng, 3)
    tickets = [batcher.submit(p, prefix_cache=False, mode="lookup", max_new_tokens=n, max_draft=3)
               for p, n in zip(PROMPTS, budgets)]
    while batcher.busy:
        batcher.step()
    assert kinds and all(k == {"SlotLayer"} for k in kinds), kinds
    assert not batcher.loop.slots.layers  # every row left, every buffer went
    for p, n, t in zip(PROMPTS, budgets, tickets):
        want = alone(eng, p, mode="lookup", max_new_tokens=n, max_draft=3)
        assert_same_greedy(eng.model, p, want.token_ids, t.result.token_ids, "lookup on slots")
        assert all(type(c) is KVCache for c in t.row.cache)
        assert_caches_clean(eng, t)


def test_rows_under_a_shape_policy_batch_on_whole_buffers():
    """CUDA's stable shapes (engine/shapes.py): rows whose full-attention layers are
    ``StableKVCache`` batch too (they decoded one at a time before), their slot layers attend over
    the whole buffer for several rows per sequence (shapes change once per step of columns), every
    answer is the lone one and each row leaves with a ``StableKVCache`` again."""
    from engine.shapes import ShapePolicy, StableKVCache

    eng = make_engine("llama")
    eng.target.set_shapes(ShapePolicy(step=16))
    assert eng.target.shapes is not None and eng.target.batch_blocker() is None
    t = eng.target
    row_caches = [prefilled(t, p) for p in PROMPTS[:3]]
    assert all(type(c) is StableKVCache for c in row_caches[0])
    lone = [prefilled(t, p) for p in PROMPTS[:3]]
    slots = Slots()
    for c in row_caches:
        slots.join(c)
    layer = slots.layers[0]
    assert layer.stable and layer.step == 16
    fetched = []
    fetch = layer.update_and_fetch

    def spy(keys, values):
        out = fetch(keys, values)
        fetched.append(out[0].shape[2])
        return out

    layer.update_and_fetch = spy
    for step, width in enumerate((3, 1, 4, 2) * 4):
        ids = mx.array([[(5 * r + 2 * j + step) % 90 + 2 for j in range(width)] for r in range(3)], dtype=mx.uint32)
        logits, _, txns = t.verify_rows(ids, row_caches)
        for r in range(3):
            ref, _, ref_txn = t.verify(ids[r : r + 1], lone[r])
            assert mx.abs(logits[r] - ref).max().item() < 1e-5
            kept = 1 + (step + r) % width
            txns[r].commit(kept)
            ref_txn.commit(kept)
        assert layer.keys.shape[2] % 16 == 0
        if width > 1:  # the whole buffer; a plain step reads up to the longest row, as StableKVCache does
            assert fetched[-1] == layer.keys.shape[2]
        else:
            assert fetched[-1] == max(s.offset for s in layer.slots)
    for c in row_caches:
        slots.leave(c)
        assert all(type(x) is StableKVCache for x in c)
    answers = Batcher(eng, 3)
    tickets = [answers.submit(p, prefix_cache=False, mode="lookup", max_new_tokens=n, max_draft=3)
               for p, n in zip(PROMPTS, (24, 9, 30, 16))]
    answers.run()
    for p, n, tk in zip(PROMPTS, (24, 9, 30, 16), tickets):
        assert tk.result.batch_width == 3 or n == 9
        want = alone(eng, p, mode="lookup", max_new_tokens=n, max_draft=3)
        assert_same_greedy(eng.model, p, want.token_ids, tk.result.token_ids, "stable shapes on slots")
        assert all(type(x) is StableKVCache for x in tk.row.cache)
        assert_caches_clean(eng, tk)
