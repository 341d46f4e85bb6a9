"""The peer's side of ``tests/peer/compare.py``: mlx-dspark in its own virtualenv, driven over
stdin/stdout with one JSON object per line, so the driver can interleave its runs with Tandem's.

Run by the driver as ``<peer python> tests/peer/peer_worker.py`` from the repository root.
Commands: ``{"cmd": "load", "model": DIR, "drafter": DIR}`` and
``{"cmd": "run", "mode": "baseline"|"lookup"|"dspark", "ids": [...], "max_new_tokens": N}``.
Each gets one reply line: ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``.

OpenBLAS is preloaded the way Tandem does it, by importing ``engine`` (its ``__init__`` is
stdlib-only) before ``mlx.core``; the driver sets ``TANDEM_NO_SKINNY=1`` unless it asks for the
peer to get Tandem's skinny matmuls too. The setup mirrors ``mlx-dspark generate``: the same
``apply_*`` probes, its measured ``static_cap`` for DSpark, lookup's CLI defaults (6 / 32).
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Replies go to the real stdout; anything the libraries print goes to stderr.
_reply = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

sys.path.insert(0, ROOT)
import engine  # noqa: E402,F401  (OpenBLAS preload, before mlx.core)
from engine import platform  # noqa: E402

import mlx.core as mx  # noqa: E402

STATE: dict = {}


def load(model: str, drafter: str) -> dict:
    import importlib

    cal = importlib.import_module("mlx_dspark.calibrate")  # the package exports a function of that name
    from mlx_dspark.load import load_drafter, load_target, lookup_drafts_default, resolve_drafter_window

    target, tok = load_target(model, require_tap=True)
    dspark, _ = load_drafter(drafter, quantize=False)  # --drafter-bits 0
    dspark.ctx_window = resolve_drafter_window(None, model)
    cal.apply_small_m(target, dspark, target_repo=model, drafter_repo=drafter)
    cal.apply_sdpa_split(target, target_repo=model)
    cal.apply_multirow_attn(target, dspark)
    cal.apply_wide_gemm(target, dspark, target_repo=model)
    cal.apply_cpu_split(target, dspark, target_repo=model)
    cap = cal.static_cap(target, dspark, mode="dspark", target_repo=model, drafter_repo=drafter)
    STATE.update(target=target, tok=tok, dspark=dspark, cap=cap, lookup=lookup_drafts_default(model))
    blas = platform.blas_status()
    return {"dspark_cap": cap, "dspark_lookup_drafts": STATE["lookup"], "blas": blas.state, "skinny": blas.skinny,
            "mlx": mx.__version__}


def run(mode: str, ids: list[int], max_new_tokens: int) -> dict:
    from mlx_dspark.generate import eos_token_ids, greedy_generate, speculative_generate
    from mlx_dspark.lookup import lookup_generate

    target, tok = STATE["target"], STATE["tok"]
    prefilled: list[float] = []

    def on_prefill(cache, *_):  # the end of prefill, the same way for every mode (lookup does not time it)
        mx.eval([c.state for c in cache])
        prefilled.append(time.perf_counter())

    common = dict(prompt_ids=ids, max_new_tokens=max_new_tokens, temperature=0.0, on_prefill=on_prefill)
    t0 = time.perf_counter()
    if mode == "baseline":
        res = greedy_generate(target, tok, **common)
    elif mode == "lookup":
        res = lookup_generate(target, tok, max_draft_tokens=6, long_draft_tokens=32, **common)
    elif mode == "dspark":
        res = speculative_generate(target, tok, STATE["dspark"], max_draft_tokens=STATE["cap"],
                                   lookup_drafts=STATE["lookup"], lookup_long_draft=32, **common)
    else:
        raise ValueError(f"unknown mode {mode}")
    end = time.perf_counter()
    eos = eos_token_ids(tok)
    tokens = [int(t) for t in res.token_ids]
    while tokens and tokens[-1] in eos:  # the peer keeps the EOS it stopped at; Tandem does not
        tokens.pop()
    rounds = len(res.token_ids) - 1 if mode == "baseline" else int(res.num_rounds)  # verify rounds after prefill
    return {"tokens": tokens, "rounds": rounds, "target_forwards": int(res.target_forwards),
            "decode_s": end - prefilled[-1], "prefill_s": prefilled[-1] - t0,
            "lookup_rounds": int(getattr(res, "lookup_rounds", 0) or 0)}


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        t0 = time.perf_counter()
        try:
            if msg["cmd"] == "load":
                out = load(msg["model"], msg["drafter"])
            elif msg["cmd"] == "run":
                out = run(msg["mode"], msg["ids"], int(msg["max_new_tokens"]))
            else:
                raise ValueError(f"unknown command {msg['cmd']}")
            out.update(ok=True, wall_s=time.perf_counter() - t0)
        except Exception as e:  # report, keep serving
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _reply.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
