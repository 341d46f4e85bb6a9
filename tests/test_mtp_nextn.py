"""DeepSeek-V3 and GLM-4.5 MTP heads ("nextn": ``model.layers.{N}.*``, N = the trunk's layer
count), in the HF key layout (per-expert tensors, DeepSeek's kv_b_proj): the head's decoder layer
equals mlx-lm's own layer of that family, the rest matches NumPy, the loop stays lossless (GLM
from a model folder, which mlx-lm loads without the head; DeepSeek's MLA from a sidecar file), an
exact head is accepted in full blocks, sampled output is the target's, and misfits are refused."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from engine.drafters import formats
from engine.drafters.mtp import NextNDrafter, NextNHead
from engine.errors import TandemError
from engine.generate import Engine
from engine.sampling import Sampler, SamplingParams
from tests import drafter_ckpt as ck
from tests.lossless import assert_same_greedy
from tests.test_block_drafters import prompts, rms
from tests.test_sampling import VOCAB, assert_exact, sample_paths
from tests.tiny import make_tokenizer

GREEDY = Sampler(SamplingParams())
COMMON = dict(vocab_size=48, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
              n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0, num_experts_per_tok=2, n_group=1,
              topk_group=1, norm_topk_prob=True, first_k_dense_replace=1, num_hidden_layers=2,
              max_position_embeddings=4096, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
              attention_bias=False, num_nextn_predict_layers=1)
CONFIGS = {
    "glm4_moe": dict(COMMON, model_type="glm4_moe", num_key_value_heads=2, head_dim=16, use_qk_norm=True,
                     partial_rotary_factor=0.5, rms_norm_eps=1e-5),
    "deepseek_v3": dict(COMMON, model_type="deepseek_v3", num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
                        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, rms_norm_eps=1e-6),
}


def build(kind: str, layers: int, seed: int = 0, vocab: int = 48):
    """An mlx-lm model of the family with ``layers`` decoder layers."""
    from mlx_lm.models import deepseek_v3, glm4_moe

    mod = glm4_moe if kind == "glm4_moe" else deepseek_v3
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(dict(CONFIGS[kind], num_hidden_layers=layers, vocab_size=vocab)))
    mx.eval(model.parameters())
    model.eval()
    return model


def hf_layer(kind: str, layer, prefix: str) -> dict[str, np.ndarray]:
    """An mlx-lm decoder layer's weights in the HF checkpoint layout (what the released files hold)."""
    out = {}
    for k, v in tree_flatten(layer.parameters()):
        v = np.array(v, dtype=np.float32)
        if ".switch_mlp." in k:  # stacked experts -> one tensor per expert
            proj = k.split(".")[-2]
            for e in range(v.shape[0]):
                out[f"{prefix}mlp.experts.{e}.{proj}.weight"] = v[e]
        elif k.endswith(("embed_q.weight", "unembed_out.weight")):
            continue
        else:
            out[prefix + k] = v
    if kind == "deepseek_v3":  # MLA: mlx-lm splits kv_b_proj into embed_q / unembed_out
        attn = layer.self_attn
        wk = np.array(attn.embed_q.weight, dtype=np.float32).swapaxes(-1, -2)  # [heads, nope, rank]
        wv = np.array(attn.unembed_out.weight, dtype=np.float32)  # [heads, v, rank]
        out[prefix + "self_attn.kv_b_proj.weight"] = np.concatenate([wk, wv], axis=1).reshape(-1, wk.shape[-1])
    return out


def nextn_tensors(kind: str, engine_model, donor, *, seed: int = 1, scale: float = 0.05) -> dict[str, np.ndarray]:
    """The released layout of the head: ``model.layers.{N}.`` + enorm, hnorm, eh_proj, shared_head,
    the target's embedding/head copies, and ``donor`` (an mlx-lm layer) as its decoder layer."""
    n = engine_model.args.num_hidden_layers
    p = f"model.layers.{n}."
    rng = np.random.default_rng(seed)
    h = engine_model.args.hidden_size
    out = hf_layer(kind, donor, p)
    out.update({p + "enorm.weight": 1 + 0.1 * rng.standard_normal(h), p + "hnorm.weight": 1 + 0.1 * rng.standard_normal(h),
                p + "eh_proj.weight": scale * rng.standard_normal((h, 2 * h)),
                p + "shared_head.norm.weight": 1 + 0.1 * rng.standard_normal(h),
                p + "embed_tokens.weight": np.array(engine_model.model.embed_tokens.weight),
                p + "shared_head.head.weight": np.array(engine_model.lm_head.weight)})
    return {k: np.asarray(v, dtype=np.float32) for k, v in out.items()}


def glm_engine(tmp_path: Path, *, seed: int = 0, exact: bool = False) -> Engine:
    """A GLM-4.5-style model folder (trunk in MLX layout, the head in the released layout) loaded
    through mlx-lm, which drops ``model.layers.2.*`` as it does for the real model's layer 92."""
    from engine.api import load

    model = build("glm4_moe", 2, seed)
    donor = build("glm4_moe", 3, seed + 1).model.layers[2]
    tensors = nextn_tensors("glm4_moe", model, donor)
    if exact:
        make_exact(model, tensors)
    ck.write_model_folder(tmp_path / "glm", model, dict(CONFIGS["glm4_moe"]), make_tokenizer(48), tensors)
    return load(str(tmp_path / "glm"))


def silence(model) -> None:
    """Every layer of the trunk adds nothing: the next token depends on the current one only."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        for name, m in layer.mlp.named_modules():
            if name.endswith("down_proj"):
                m.weight = mx.zeros_like(m.weight)
    model.lm_head.weight = 2.0 * model.lm_head.weight
    mx.eval(model.parameters())


def make_exact(model, tensors: dict[str, np.ndarray], sharpen: float = 1.0) -> None:
    """Head tensors that draft what a silenced (bigram) trunk says after each token."""
    silence(model)
    n, h = model.args.num_hidden_layers, model.args.hidden_size
    p = f"model.layers.{n}."
    tensors[p + "enorm.weight"] = np.ones(h, np.float32)
    tensors[p + "eh_proj.weight"] = np.concatenate([np.eye(h), np.zeros((h, h))], axis=1).astype(np.float32)
    tensors[p + "shared_head.norm.weight"] = sharpen * np.array(model.model.norm.weight, dtype=np.float32)
    for k in tensors:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[k] = np.zeros_like(tensors[k])


# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["glm4_moe", "deepseek_v3"])
def test_head_matches_mlx_lm_s_layer_and_numpy(kind):
    model = build(kind, 2)
    donor = build(kind, 3, seed=5).model.layers[2]
    tensors = nextn_tensors(kind, model, donor)
    from engine.target import Target

    target = Target(model)
    head = formats.load_mtp_head(target, dict(CONFIGS[kind]), {k: mx.array(v) for k, v in tensors.items()}, where="t")
    assert isinstance(head, NextNHead) and not any("embed_tokens" in k or "shared_head.head" in k
                                                   for k, _ in tree_flatten(head.parameters()))
    # The decoder layer: the same as mlx-lm's own (weights through mlx-lm's sanitize, MLA split).
    for (k, a), (_, b) in zip(sorted(tree_flatten(head.layers[0].parameters())), sorted(tree_flatten(donor.parameters()))):
        assert np.allclose(np.array(a), np.array(b), atol=1e-6), k
    # Around it: eh_proj([enorm(e); hnorm(h)]) with e zeroed at position 0, then the layer.
    rng = np.random.default_rng(0)
    e, hid = rng.standard_normal((5, 64)).astype(np.float32), rng.standard_normal((5, 64)).astype(np.float32)
    drafter = NextNDrafter(head, target)
    got = np.array(head(mx.array(e[None]), mx.array(hid[None]), drafter.new_cache())[0])
    p, eps = "model.layers.2.", CONFIGS[kind]["rms_norm_eps"]
    e0 = e.copy()
    e0[0] = 0
    x = np.concatenate([rms(e0, tensors[p + "enorm.weight"], eps), rms(hid, tensors[p + "hnorm.weight"], eps)], -1)
    x = x @ tensors[p + "eh_proj.weight"].T
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    want = np.array(donor(mx.array(x[None].astype(np.float32)), cache.make_mask(5, return_array=True, window_size=None),
                          cache)[0])
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    logits = np.array(drafter.logits(mx.array(got[-1])))
    head_w = np.array(model.lm_head.weight, dtype=np.float64)
    assert np.allclose(logits, head_w @ rms(got[-1].astype(np.float64), tensors[p + "shared_head.norm.weight"], eps), atol=1e-3)


def test_glm_from_its_folder_is_lossless_and_an_exact_head_takes_full_blocks(tmp_path):
    engine = glm_engine(tmp_path)  # a random head: rejections
    assert engine.mode_support()["mtp"] is None and isinstance(engine.drafter("mtp"), NextNDrafter)
    exact = glm_engine(tmp_path / "x", exact=True)
    for eng in (engine, exact):
        drafted = 0
        for i, ids in enumerate(prompts(8, 48, seed=2)):
            n = [2, 6, 12, 20][i % 4]
            base = eng.generate(ids, mode="baseline", max_new_tokens=n)
            for cap in (1, 3):
                res = eng.generate(ids, mode="mtp", max_new_tokens=n, max_draft=cap)
                assert_same_greedy(eng.model, ids, base.token_ids, res.token_ids, f"{eng.name}/prompt {i}/cap {cap}")
                drafted += res.drafted
        assert drafted > 0
    res = exact.generate([3, 4, 5], mode="mtp", max_new_tokens=30, max_draft=3)
    assert res.accepted == res.drafted > 0 and all(d == 3 for d, _ in res.rounds[1:-1])


def test_deepseek_sidecar_is_lossless_and_sampling_exact(tmp_path):
    model = build("deepseek_v3", 2, seed=3, vocab=VOCAB)
    donor = build("deepseek_v3", 3, seed=4, vocab=VOCAB).model.layers[2]
    tensors = nextn_tensors("deepseek_v3", model, donor)
    make_exact(model, tensors, sharpen=1.3)  # q sharper than p: rejections at every depth
    engine = Engine(model, make_tokenizer(VOCAB), name="tiny-deepseek")
    engine.drafter_path = str(tmp_path / "mtp.safetensors")
    from safetensors.numpy import save_file

    save_file(tensors, engine.drafter_path)
    drafter = engine.drafter("mtp")  # the sidecar passed its probe
    assert isinstance(drafter, NextNDrafter)
    for ids in prompts(8, VOCAB, seed=4):
        base = engine.generate(ids, mode="baseline", max_new_tokens=16)
        res = engine.generate(ids, mode="mtp", max_new_tokens=16, max_draft=3)
        assert_same_greedy(model, ids, base.token_ids, res.token_ids, "deepseek nextn")
    assert_exact(sample_paths(model, drafter, SamplingParams(temperature=1.0, top_p=0.95), target=engine.target), cap=3)


def test_misfits_are_refused(tmp_path):
    model = build("glm4_moe", 2)
    tensors = nextn_tensors("glm4_moe", model, build("glm4_moe", 3, seed=1).model.layers[2])
    from engine.target import Target

    target = Target(model)

    def refused(config=None, **changes) -> str:
        t = {k: mx.array(v) for k, v in tensors.items()}
        for k, v in changes.items():
            k = "model.layers.2." + k.replace("__", ".")
            if v is None:
                t.pop(k)
            else:
                t[k] = mx.array(v)
        with pytest.raises(TandemError) as err:
            formats.load_mtp_head(target, config or dict(CONFIGS["glm4_moe"]), t, where="head")
        return str(err.value)

    assert "required keys missing: hnorm.weight" in refused(hnorm__weight=None)
    assert "wrong shape for layers.0.self_attn.q_proj.weight" in refused(self_attn__q_proj__weight=np.zeros((8, 64)))
    assert "hidden size mismatch" in refused(eh_proj__weight=np.zeros((64, 64)))
    assert "the MTP layer's tensors are incomplete" in refused(mlp__experts__3__up_proj__weight=None)
    assert "with 2 MTP layers" in refused(dict(CONFIGS["glm4_moe"], num_nextn_predict_layers=2))
    assert "deepseek_v4 MTP heads are not supported" in formats.mtp_layout_problem({"model_type": "deepseek_v4"}, "x")
