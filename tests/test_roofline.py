"""Roofline: bytes per token from real models (untied, tied, mixture of experts), the ceiling,
and the plot points the app builds from real RoundEvents."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.roofline import KVProfile, RooflineModel, RooflineTracker, active_weight_bytes, kv_profile, measure_bandwidth
from tests.tiny import make_tiny_engine


def total_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def test_untied_model_reads_one_embedding_row(tiny_llama):
    model = tiny_llama.model
    embed = model.model.embed_tokens.weight
    expected = total_bytes(model) - embed.nbytes + embed.nbytes // embed.shape[0]
    assert active_weight_bytes(model) == expected


def test_tied_model_reads_the_whole_embedding():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=96, rms_norm_eps=1e-5,
                           tie_word_embeddings=True)
    model = llama.Model(args)
    mx.eval(model.parameters())
    assert active_weight_bytes(model) == total_bytes(model)  # the embedding is the head


def test_moe_counts_routed_experts_at_top_k_over_n():
    from mlx_lm.models import mixtral

    args = mixtral.ModelArgs(model_type="mixtral", vocab_size=96, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             num_local_experts=4, num_experts_per_tok=2)
    model = mixtral.Model(args)
    mx.eval(model.parameters())
    params = tree_flatten(model.parameters())
    experts = sum(v.nbytes for k, v in params if "switch_mlp" in k)
    embed = model.model.embed_tokens.weight
    assert experts > 0
    expected = total_bytes(model) - experts / 2 - embed.nbytes + embed.nbytes / embed.shape[0]
    assert active_weight_bytes(model) == int(expected)


def test_kv_bytes_per_token_match_the_config(tiny_llama):
    prof = kv_profile(tiny_llama.model)
    # 4 layers x (K + V) x 2 kv heads x head_dim 16 x 4 bytes
    assert prof.layers == ((2 * 2 * 16 * 4, None),) * 4
    assert prof.bytes_per_token == 4 * 2 * 2 * 16 * 4
    assert prof.bytes_at(100) == 100 * prof.bytes_per_token


def test_windowed_layers_stop_growing():
    prof = KVProfile(((100, None), (100, 64)), state_bytes=7)
    assert prof.bytes_at(32) == 7 + 3200 + 3200
    assert prof.bytes_at(1000) == 7 + 100_000 + 6400


def test_ceiling_and_fraction(tiny_llama):
    roof = RooflineModel.from_engine(tiny_llama, bandwidth=10e9)
    bpt = roof.bytes_per_token(512)
    assert bpt == active_weight_bytes(tiny_llama.model) + 512 * 1024
    assert roof.ceiling_tps(512) == pytest.approx(10e9 / bpt)
    assert roof.ceiling_tps(2048) < roof.ceiling_tps(512)  # the KV cache grows the bytes
    assert roof.fraction(roof.ceiling_tps(512) / 2, 512) == pytest.approx(0.5)
    s = roof.summary(512, baseline_tps=roof.ceiling_tps(512) / 4)
    assert s["baseline_fraction"] == pytest.approx(0.25) and s["bandwidth_gbs"] == pytest.approx(10.0)


def test_points_from_real_round_events(tiny_llama):
    events = []
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
    tiny_llama.generate(prompt, mode="lookup", max_draft=8, max_new_tokens=40, on_round=events.append)
    roof = RooflineModel.from_engine(tiny_llama, bandwidth=20e9)
    first = roof.point(events[0])  # the prefill's token: no round time of its own
    assert first["tps"] is None and first["x_roofline"] is None and first["context"] == len(prompt) + 1
    rounds = [ev for ev in events[1:] if ev.drafted]
    assert rounds  # the prompt repeats itself: lookup drafts
    for ev in rounds:
        pt = roof.point(ev)
        assert pt["tps"] == pytest.approx(ev.committed / (ev.draft_s + ev.verify_s))
        assert pt["x_roofline"] == pytest.approx(pt["tps"] / roof.ceiling_tps(ev.context))
        assert pt["bytes_per_token"] == roof.bytes_per_token(ev.context)
    for ev in events[1:]:  # a pipelined plain step (lookup had no match) has no round time of its own
        if not ev.drafted:
            assert ev.draft_s == ev.verify_s == 0.0 and roof.point(ev)["tps"] is None
    tracker = RooflineTracker(roof, window=4)
    points = [tracker.update(ev) for ev in events]
    last, back = events[-1], events[-5]
    assert points[-1]["tps"] == pytest.approx((last.generated - back.generated) / (last.t - back.t))
    assert all(p["ceiling_tps"] > 0 for p in points)
    # a new generation (round 0 again) restarts the window
    assert tracker.update(events[0])["tps"] is None


def test_measured_bandwidth_is_plausible():
    bw = measure_bandwidth(size_mb=32, repeats=2)
    assert math.isfinite(bw) and 1e8 < bw < 1e13  # between 0.1 GB/s and 10 TB/s
