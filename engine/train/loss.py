"""The DSpark training forward and DeepSpec's loss, on the frozen target's tapped states.

Training follows DeepSpec's ``Qwen3DSparkModel.forward`` and ``dspark/loss.py``: per sequence,
``--anchors`` random answer positions p each get a block ``[x_p, MASK...]`` at positions
p..p+B-1; the block's queries see the context rows strictly before p (the target's tapped states
through ``fc`` + ``hidden_norm``) and their own block bidirectionally, exactly what the engine's
drafter sees at inference when p is the anchor. Slot k predicts x_{p+k+1}; its logits are
``lm_head(h_k) + W2·W1[x_{p+k}]`` (teacher-forced Markov head). Loss, with position weights
``exp(-k/gamma)``: ``ce·CE(label) + tv·‖p_d − p_t‖₁ + bce·BCE(c_k, c*_k)`` where
``c*_k = 1 − ½‖p_d − p_t‖₁`` (DeepSpec's ``l1_loss`` term is the full L1 distance, twice the TV
distance). ``embed_tokens`` and ``lm_head`` are copies of the target's and stay frozen.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from engine.errors import TandemError
from engine.train.config import TrainConfig
from engine.train.data import Batch

NEG = -1e9  # masked attention score (every block row always sees its own block, so no row is all-masked)


def target_states(target: Any, ids: Any, taps: Sequence[int]) -> tuple[Any, Any]:
    """Batched frozen-target forward over right-padded ``ids`` [S, T]: the tapped residual rows
    [S, T, n_taps*H] (decoder-layer outputs, as the engine's tap) and the final normed rows
    [S, T, H] (the head's input). Causal attention, so padding never reaches a real row."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask

    trunk = target.trunk
    h = trunk.embed_tokens(ids)
    mask = create_attention_mask(h, None)
    want = {int(t): None for t in taps}
    for i, layer in enumerate(trunk.layers):
        h = layer(h, mask, None)
        if i in want:
            want[i] = h
    feats = mx.concatenate([want[int(t)] for t in taps], axis=-1)
    return mx.stop_gradient(feats), mx.stop_gradient(trunk.norm(h))


def check_target_states(target: Any, taps: Sequence[int], ids: Sequence[int], tol: float = 2e-2) -> None:
    """Refuse to train when the batched forward does not reproduce the engine's own tap and
    logits for this architecture (it replicates embed -> layers -> norm). The tolerance only
    has to catch a structural difference (an embedding scale, a missing layer), which is O(1);
    GPU matmuls may run float32 in a reduced-precision mode, so it is not tight."""
    import mlx.core as mx

    target.set_taps(taps)
    seq = mx.array([[int(t) for t in ids]], dtype=mx.int32)
    logits, hidden = target.forward(seq, target.new_cache(), tap=True)
    target.forwards -= 1
    feats, final = target_states(target, seq, taps)
    mine = target.head(final)[0]
    scale = max(1.0, mx.abs(logits).max().item())
    d_logits = mx.abs(mine - logits).max().item() / scale
    d_feats = (mx.abs(feats[0] - hidden).max() / mx.maximum(mx.abs(hidden).max(), 1.0)).item()
    if not (d_logits <= tol and d_feats <= tol):
        raise TandemError(f"train-drafter: the batched target forward does not reproduce the engine's tap for "
                          f"{target.name} (logits off by {d_logits:.3g}, tapped states by {d_feats:.3g})")


def _block_attention(attn: Any, x: Any, ctx: Any, anchors: Any, ctx_visible: Any, A: int, B: int) -> Any:
    """Block self-attention of one drafter layer, for S sequences x A anchors at once.

    x [S, A*B, H] block rows (normed), ctx [S, T, H] projected context rows, anchors [S, A],
    ctx_visible [S, A, T] (key j visible to anchor a iff j < p_a). Same projections, norms,
    RoPE and scale as ``block.Attention`` at inference."""
    import mlx.core as mx

    S, _, _ = x.shape
    T = ctx.shape[1]
    nh, nkv, d = attn.n_heads, attn.n_kv, attn.head_dim
    rep = nh // nkv
    offs = anchors.reshape(-1)  # RoPE offset of each block: its anchor's position

    q = attn.q_norm(attn.q_proj(x).reshape(S, A, B, nh, d)).transpose(0, 1, 3, 2, 4).reshape(S * A, nh, B, d)
    q = attn.rope(q, offset=offs).reshape(S, A, nkv, rep, B, d) * attn.scale
    kb = attn.k_norm(attn.k_proj(x).reshape(S, A, B, nkv, d)).transpose(0, 1, 3, 2, 4).reshape(S * A, nkv, B, d)
    kb = attn.rope(kb, offset=offs).reshape(S, A, nkv, 1, B, d)
    vb = attn.v_proj(x).reshape(S, A, B, nkv, d).transpose(0, 3, 1, 2, 4)[:, :, :, None]  # [S, nkv, A, 1, B, d]
    kc = attn.rope(attn.k_norm(attn.k_proj(ctx).reshape(S, T, nkv, d)).transpose(0, 2, 1, 3), offset=0)
    vc = attn.v_proj(ctx).reshape(S, T, nkv, d).transpose(0, 2, 1, 3)  # [S, nkv, T, d]

    qc = q.transpose(0, 2, 1, 3, 4, 5)  # [S, nkv, A, rep, B, d]
    sc = (qc.reshape(S, nkv, A * rep * B, d) @ kc.swapaxes(-1, -2)).reshape(S, nkv, A, rep, B, T)
    sc = mx.where(ctx_visible[:, None, :, None, None, :], sc, NEG)
    sb = (q @ kb.swapaxes(-1, -2)).transpose(0, 2, 1, 3, 4, 5)  # [S, nkv, A, rep, B, B]
    p = mx.softmax(mx.concatenate([sc, sb], axis=-1), axis=-1, precise=True)
    out = (p[..., :T].reshape(S, nkv, A * rep * B, T) @ vc).reshape(S, nkv, A, rep, B, d) + p[..., T:] @ vb
    out = out.transpose(0, 2, 4, 1, 3, 5).reshape(S, A * B, nh * d)  # head h = kv*rep + r, as SDPA's GQA
    return attn.o_proj(out)


def block_forward(model: Any, feats: Any, anchors: Any, block_ids: Any) -> Any:
    """Training forward of the DSpark backbone: final-normed block states [S, A, B, H].

    feats [S, T, n_taps*H] tapped target rows; anchors [S, A]; block_ids [S, A, B] =
    [x_p, MASK...] per anchor."""
    import mlx.core as mx

    S, T, _ = feats.shape
    _, A, B = block_ids.shape
    ctx = model.hidden_norm(model.fc(feats))
    x = model.embed_tokens(block_ids).reshape(S, A * B, -1)
    visible = mx.arange(T)[None, None, :] < anchors[:, :, None]
    for layer in model.layers:
        x = x + _block_attention(layer.self_attn, layer.input_layernorm(x), ctx, anchors, visible, A, B)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).reshape(S, A, B, -1)


def markov_bias(model: Any, prev: Any, h: Any) -> tuple[Any, Any]:
    """(bias [..., B, V], W1[prev] [..., B, r]) of the Markov head, teacher-forced on ``prev``
    [..., B] (the token before each slot); the same maths as ``MarkovHead.step`` slot by slot."""
    import mlx.core as mx

    head = model.markov_head
    e = head.markov_w1(prev)
    if head.kind == "vanilla":
        return head.markov_w2(e), e
    if head.kind == "gated":
        return head.markov_w2(mx.sigmoid(head.gate_proj(mx.concatenate([h, e], axis=-1))) * e), e
    state = mx.zeros(e.shape[:-2] + (head.rank,), dtype=e.dtype)  # rnn: unrolled over the block
    outs = []
    for k in range(e.shape[-2]):
        gate, cand, out = mx.split(head.joint_proj(mx.concatenate([state, e[..., k, :], h[..., k, :]], axis=-1)), 3, axis=-1)
        gate = mx.sigmoid(gate)
        state = gate * state + (1.0 - gate) * mx.tanh(cand)
        outs.append(mx.tanh(out))
    return head.markov_w2(mx.stack(outs, axis=-2)), e


def draft_outputs(model: Any, feats: Any, arrays: dict) -> tuple[Any, Any, Any]:
    """Drafter logits [S, A, B, V], confidence logits [S, A, B] (or None) and block states."""
    import mlx.core as mx

    h = block_forward(model, feats, arrays["anchors"], arrays["block_ids"])
    logits = model.logits(h)
    e = None
    if getattr(model, "markov_head", None) is not None:
        bias, e = markov_bias(model, arrays["prev"], h)
        logits = logits + bias
    conf = None
    if getattr(model, "confidence_head", None) is not None:
        f = mx.concatenate([h, e.astype(h.dtype)], axis=-1) if model.cfg.confidence_head_with_markov else h
        conf = model.confidence_head.proj(f)[..., 0]
    return logits, conf, h


def dspark_loss(model: Any, feats: Any, target_logits: Any, arrays: dict, cfg: TrainConfig) -> tuple[Any, dict]:
    """DeepSpec's DSpark loss and its metrics (see the module doc)."""
    import mlx.core as mx

    logits, conf, _ = draft_outputs(model, feats, arrays)
    S, A, B, V = logits.shape
    logits = logits.reshape(S, A * B, V).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p_d = mx.exp(logp)
    p_t = mx.stop_gradient(mx.softmax(target_logits.astype(mx.float32), axis=-1, precise=True))
    labels = arrays["labels"].reshape(S, A * B)
    valid = arrays["valid"].reshape(S, A * B).astype(mx.float32)
    w = valid * mx.tile(mx.exp(-mx.arange(B, dtype=mx.float32) / cfg.gamma), (A,))[None]
    den = w.sum() + 1e-6
    ce = -mx.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    l1 = mx.abs(p_d - p_t).sum(axis=-1)
    accept = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))  # c*: the probability this slot is accepted
    ce_loss, l1_loss = (ce * w).sum() / den, (l1 * w).sum() / den
    loss = cfg.ce_weight * ce_loss + cfg.tv_weight * l1_loss
    bce_loss = mx.array(0.0)
    if conf is not None:
        z = conf.reshape(S, A * B).astype(mx.float32)
        bce = mx.maximum(z, 0) - z * accept + mx.log1p(mx.exp(-mx.abs(z)))
        bce_loss = (bce * w).sum() / den
        loss = loss + cfg.bce_weight * bce_loss
    # Greedy acceptance, teacher-forced: slot k is accepted iff the drafter's argmax is the
    # target's argmax and every earlier slot was (the Markov input is then the true token).
    match = (mx.argmax(logits, axis=-1) == mx.argmax(target_logits, axis=-1)).astype(mx.float32) * valid
    full = valid.reshape(S, A, B)[..., -1]  # blocks whose B labels all exist
    run = mx.cumprod(match.reshape(S, A, B), axis=-1)
    tau = 1.0 + run.sum(axis=-1)  # tokens per round with the full block: accepted drafts + the bonus
    prob_run = mx.cumprod((accept * valid).reshape(S, A, B), axis=-1)
    metrics = {
        "loss": loss, "ce": ce_loss, "l1": l1_loss, "bce": bce_loss,
        "tau_each": tau,  # [S, A]: each anchor's round, a block cut short by the answer's end included
        "tau_sum": (tau * full).sum(axis=-1), "tau_prob_sum": ((1.0 + prob_run.sum(axis=-1)) * full).sum(axis=-1),
        "blocks": full.sum(axis=-1),  # per sequence [S], so metrics split by content class
        "acc_k": (match.reshape(S, A, B) * valid.reshape(S, A, B)).sum(axis=(0, 1)),
        "n_k": valid.reshape(S, A, B).sum(axis=(0, 1)),
    }
    return loss, metrics


def batch_arrays(batch: Batch, mask_token_id: int) -> dict:
    import mlx.core as mx

    S, A, B = batch.labels.shape
    block = np.full((S, A, B), mask_token_id, dtype=np.int32)
    block[:, :, 0] = np.take_along_axis(batch.ids, batch.anchors, axis=1)
    return {"ids": mx.array(batch.ids), "anchors": mx.array(batch.anchors), "block_ids": mx.array(block),
            "labels": mx.array(batch.labels), "prev": mx.array(batch.prev), "valid": mx.array(batch.valid),
            "rows": mx.array(batch.rows.reshape(S, A * B))}


def target_side(target: Any, arrays: dict, taps: Sequence[int], states: tuple[Any, Any] | None = None
                ) -> tuple[Any, Any]:
    """Tapped features [S, T, nH] and the target's logits at each slot's row [S, A*B, V].
    ``states``: ``target_states`` of these ids, already computed (other anchors, same sequences)."""
    import mlx.core as mx

    feats, final = states if states is not None else target_states(target, arrays["ids"], taps)
    rows = arrays["rows"]
    picked = mx.take_along_axis(final, rows[..., None], axis=1)
    return feats, mx.stop_gradient(target.head(picked))


# ========================================================================================
# Trainer
# ========================================================================================
