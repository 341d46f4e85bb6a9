"""Average two DSpark drafter folders of one lineage (a "model soup": a drafter and its own
continuation trained on new answers), as the fifth starter drafter was made:

    python3 tests/device/soup_drafters.py resources/drafters/smollm2-135m-dspark /tmp/drafter5 /tmp/soup

Every floating tensor becomes ``(1 - w) * A + w * B`` (``--weight w``, default 0.5), computed in
float32 and stored in B's dtype. The draft vocabulary (``d2t``/``t2d`` and ``draft_vocab.json``)
comes from A whole: it is a set of token ids, not something to average. ``config.json`` is B's;
its ``tandem`` block says where the weights came from. Both folders must hold the same tensor
names and shapes (apart from the vocabulary), i.e. the same architecture.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx

VOCAB_TENSORS = ("d2t", "t2d")


def soup(a: Path, b: Path, out: Path, weight: float = 0.5) -> None:
    wa, wb = mx.load(str(a / "model.safetensors")), mx.load(str(b / "model.safetensors"))
    if set(wa) != set(wb):
        raise SystemExit(f"different tensors: {sorted(set(wa) ^ set(wb))}")
    mixed = {}
    for name, x in wa.items():
        if name in VOCAB_TENSORS:
            mixed[name] = x
            continue
        if x.shape != wb[name].shape:
            raise SystemExit(f"{name}: shape {x.shape} in {a}, {wb[name].shape} in {b}")
        avg = (1.0 - weight) * x.astype(mx.float32) + weight * wb[name].astype(mx.float32)
        mixed[name] = avg.astype(wb[name].dtype)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), mixed, metadata={"format": "mlx"})
    if (a / "draft_vocab.json").exists():
        shutil.copy(a / "draft_vocab.json", out / "draft_vocab.json")
    config = json.loads((b / "config.json").read_text())
    mix = f"{1 - weight:g} x {a.name} + {weight:g} x {b.name}; vocabulary from {a.name}"
    config.setdefault("tandem", {})["soup"] = mix
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="drafter folder whose draft vocabulary is kept")
    p.add_argument("b", type=Path, help="drafter folder whose config is kept")
    p.add_argument("out", type=Path)
    p.add_argument("--weight", type=float, default=0.5, help="share of B (0..1)")
    args = p.parse_args()
    if not 0.0 <= args.weight <= 1.0:
        raise SystemExit(f"--weight must be within 0..1, got {args.weight}")
    soup(args.a, args.b, args.out, args.weight)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
