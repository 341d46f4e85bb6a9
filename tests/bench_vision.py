"""Vision figures on this CPU (a benchmark, not a test: pytest does not collect it).

    PYTHONPATH=$PWD python tests/bench_vision.py [--reps 3] [--tokens 128] [--out FILE.json]

No package registry this project reaches ships a vision model's weights (issue 44's search:
pypi.tsv's VLM packages are clients that download from the hub at run time), so the figures come
from a LLaVA folder built here: the real starter language model (SmolLM2-135M-Instruct, its GGUF
converted by Tandem) behind a random CLIP tower the size of SmolVLM-256M's (12 layers, width
768, 224 px, 16 px patches: 196 image rows). The tower is random, so the answers are not about
the image; what the figures show is the machinery's cost on a real-sized model: time to first
token (vision tower + prefill), decode tok/s by mode, the same tokens as baseline in every mode,
a second question on the same image restored from the prefix cache, and the peak memory of a
vision load vs the same language model loaded text-only.

Questions: an OCR-style one (an image of rendered text, "write it out") and a description one
(a drawn scene). Every figure is a median over ``--reps`` runs; the machine may be shared.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGE_TOKEN = "<filename>"  # one of SmolLM2's unused control tokens stands for an image row
TOWER = dict(model_type="clip_vision_model", num_hidden_layers=12, hidden_size=768, intermediate_size=3072,
             num_attention_heads=12, image_size=224, patch_size=16, projection_dim=512)
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "{{ '" + IMAGE_TOKEN + "' }}{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
RECEIPT = ["CORNER BAKERY  #0412", "2 x Sourdough loaf    8.40", "1 x Almond croissant 3.10",
           "1 x Flat white        3.60", "SUBTOTAL             15.10", "VAT 7%                1.06",
           "TOTAL                16.16", "Paid by card **** 4417"]
QUESTIONS = {
    "ocr": "Read the text in this image and write it out exactly, line by line.",
    # (a random tower: "Describe this image." gets an empty answer; naming the scene's parts gets one)
    "describe": "Describe the scene in this picture: the sky, the ground and the house.",
}
FOLLOW_UP = "What is the total?"


def build(folder: Path) -> Path:
    """The LLaVA folder: the starter's language model, a random tower, a processor."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import llava
    from mlx_vlm.models.llava.processing_llava import LlavaProcessor
    from transformers import AutoTokenizer, CLIPImageProcessor

    from engine.loading import resolve_model_path

    if (folder / "config.json").is_file():
        return folder
    starter = resolve_model_path(None)
    text = json.loads((starter / "config.json").read_text())
    text = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype")}
    tokenizer = AutoTokenizer.from_pretrained(str(starter))
    config = dict(model_type="llava", text_config=text, vision_config=TOWER,
                  image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                  vision_feature_select_strategy="default", vision_feature_layer=-2,
                  vocab_size=text["vocab_size"], eos_token_id=text.get("eos_token_id"))
    mx.random.seed(0)
    model_config = llava.ModelConfig.from_dict(config)
    model_config.text_config = llava.TextConfig.from_dict(text)
    model_config.vision_config = llava.VisionConfig.from_dict(TOWER)
    model = llava.Model(model_config)
    weights = dict(tree_flatten(model.parameters()))
    lm = mx.load(str(starter / "model.safetensors"))
    embed_std = float(mx.std(lm["model.embed_tokens.weight"].astype(mx.float32)).item())
    weights.update({f"language_model.{k}": v for k, v in lm.items()})
    # The projector's rows join the text embeddings at their scale.
    weights["multi_modal_projector.linear_2.weight"] = weights["multi_modal_projector.linear_2.weight"] * embed_std
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), {k: v.astype(mx.float32) for k, v in weights.items()})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}),
        tokenizer=tokenizer, patch_size=16, vision_feature_select_strategy="default", chat_template=TEMPLATE,
        num_additional_image_tokens=1, image_token=IMAGE_TOKEN)
    processor.save_pretrained(str(folder))
    return folder


def images() -> dict[str, bytes]:
    """A receipt (text to read) and a drawn scene, as PNG bytes."""
    from PIL import Image, ImageDraw

    receipt = Image.new("RGB", (448, 224), "white")
    draw = ImageDraw.Draw(receipt)
    for i, line in enumerate(RECEIPT):
        draw.text((16, 10 + 26 * i), line, fill="black")
    scene = Image.new("RGB", (448, 300), (120, 180, 240))
    draw = ImageDraw.Draw(scene)
    draw.rectangle((0, 200, 448, 300), fill=(60, 150, 60))
    draw.ellipse((330, 30, 400, 100), fill=(250, 220, 60))
    draw.polygon([(80, 200), (150, 110), (220, 200)], fill=(150, 90, 60))
    draw.rectangle((100, 200, 200, 260), fill=(200, 200, 190))
    out = {}
    for name, img in (("ocr", receipt), ("describe", scene)):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out[name] = buf.getvalue()
    return out


def peak_rss_mb(spec: str) -> float:
    """Peak resident memory (VmHWM, Linux) of a fresh process that loads ``spec`` with Tandem."""
    code = ("import engine, sys; from engine.api import load; load(sys.argv[1]); "
            "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) / 1024)")
    out = subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True, check=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return round(float(out.stdout.strip().splitlines()[-1]), 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--modes", default="baseline,lookup,dspark,auto")
    p.add_argument("--folder", default=str(Path.home() / ".cache/tandem/bench/smollm2-llava-random-tower"))
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import engine  # noqa: F401  (OpenBLAS before mlx.core)
    from engine.api import load
    from engine.images import decode_image
    from engine.loading import resolve_model_path

    folder = build(Path(args.folder).expanduser())
    t0 = time.perf_counter()
    eng = load(str(folder))
    load_s = time.perf_counter() - t0
    assert eng.takes_images, eng.image_refusal()
    drafter = ROOT / "resources/drafters/smollm2-135m-dspark"
    pics = {k: decode_image(v) for k, v in images().items()}

    def ask(kind: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image", "image": pics[kind]},
                                             {"type": "text", "text": QUESTIONS[kind]}]}]

    report: dict = {
        "command": "PYTHONPATH=$PWD python tests/bench_vision.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "model": ("LLaVA: SmolLM2-135M-Instruct (the starter, converted GGUF, float32) + a random CLIP tower "
                  "(12 x 768, 224 px / 16 px patches: 196 image rows) + a random projector; no real vision "
                  "model is on the registries"),
        "load_s": round(load_s, 2), "tokens": args.tokens, "reps": args.reps, "runs": {},
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],  # the machine is shared
    }
    modes = args.modes.split(",")
    assert modes[0] == "baseline", "--modes starts with baseline (the reference of each rep)"

    def run(kind: str, mode: str, tokens: int):
        eng.drafter_path = str(drafter) if mode == "dspark" else None
        return eng.generate(ask(kind), mode=mode, max_new_tokens=tokens, prefix_cache=False)

    for kind in QUESTIONS:
        for mode in modes:  # drafters loaded, first-call costs paid
            run(kind, mode, 8)
        # Modes interleaved within each rep, so the shared machine's load shifts reach them alike.
        runs: dict[str, list] = {m: [] for m in modes}
        for _ in range(args.reps):
            for mode in modes:
                runs[mode].append(run(kind, mode, args.tokens))
        base = runs["baseline"]
        for mode in modes:
            rs = runs[mode]
            row = {
                "mode_ran": rs[0].mode, "prompt_tokens": rs[0].prompt_tokens, "generated": rs[0].generated,
                "ttft_s": round(statistics.median(r.ttft_s for r in rs), 3),
                "decode_tok_s": round(statistics.median(r.decode_tps for r in rs), 2),
                "speedup_vs_baseline_same_rep": round(statistics.median(
                    r.decode_tps / b.decode_tps for r, b in zip(rs, base) if b.decode_tps), 2),
                "accept_per_round": round(statistics.median(r.mean_accepted for r in rs), 2),
                "same_tokens_as_baseline": all(r.token_ids == base[0].token_ids for r in rs),
                "answer_head": rs[0].text[:120],
            }
            report["runs"][f"{kind}/{mode}"] = row
            print(f"{kind:9s} {mode:9s} ran {row['mode_ran']:8s} ttft {row['ttft_s']:6.2f}s  "
                  f"decode {row['decode_tok_s']:6.2f} tok/s  x{row['speedup_vs_baseline_same_rep']:.2f}  "
                  f"tau {row['accept_per_round']:.2f}  same {row['same_tokens_as_baseline']}", flush=True)
    # A second question on the same image: restored from the prefix cache (the tower does not run).
    eng.drafter_path = None
    eng.clear_prefix_cache()
    first = eng.generate(ask("ocr"), mode="baseline", max_new_tokens=args.tokens)
    history = ask("ocr") + [{"role": "assistant", "content": first.text}, {"role": "user", "content": FOLLOW_UP}]
    warm = eng.generate(history, mode="baseline", max_new_tokens=16)
    cold = eng.generate(history, mode="baseline", max_new_tokens=16, prefix_cache=False)
    report["follow_up"] = {"prompt_tokens": warm.prompt_tokens, "cached_tokens": warm.cached_tokens,
                           "ttft_warm_s": round(warm.ttft_s, 3), "ttft_cold_s": round(cold.ttft_s, 3),
                           "same_tokens": warm.token_ids == cold.token_ids}
    print("follow-up:", report["follow_up"], flush=True)
    report["peak_rss_mb"] = {"vision_load": peak_rss_mb(str(folder)),
                             "text_only_load_same_language_model": peak_rss_mb(str(resolve_model_path(None)))}
    print("peak RSS MB:", report["peak_rss_mb"], flush=True)
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
