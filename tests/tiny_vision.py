"""A tiny random vision model (mlx-vlm's own LLaVA classes: a CLIP tower, a projector, a llama
language model) saved as a model folder with its processor, so tests load it the way a real one
loads: through engine.loading and mlx-vlm. Milliseconds to build, no downloads."""

from __future__ import annotations

import io
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

VOCAB = 96
IMAGE_TOKEN = VOCAB - 1  # "<image>": the processor expands it to one placeholder per patch
IMAGE_SIZE, PATCH = 28, 14  # 2 x 2 patches + CLS: 4 image rows after the "default" feature selection
# Roles are words of the tiny vocabulary, so every prompt token means something to the model.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ 'w3' if m.role == 'user' else ('w4' if m.role == 'assistant' else 'w2') }} "
    "{% if m.content is string %}{{ m.content }} {% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}<image> {% else %}{{ c.text }} {% endif %}{% endfor %}{% endif %}</s> {% endfor %}"
    "{% if add_generation_prompt %}w4{% endif %}")


def make_vision_tokenizer():
    """The word-level tokenizer of tests/tiny.py with ``<image>`` as its last id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"</s>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, VOCAB - 1)}, "<image>": IMAGE_TOKEN}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>",
                                   additional_special_tokens=["<image>"])


def write_tiny_llava(folder: Path, seed: int = 0, scale: float = 4.0, layers: int = 4, hidden: int = 64) -> Path:
    """A random LLaVA model folder (config, weights, processor). ``scale`` stretches the logits so
    greedy choices are not near-ties."""
    from mlx_vlm.models import llava
    from transformers import CLIPImageProcessor

    from mlx_vlm.models.llava.processing_llava import LlavaProcessor

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = dict(model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
    vision = dict(model_type="clip_vision_model", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                  num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    config = dict(model_type="llava", text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN,
                  vision_feature_select_strategy="default", vision_feature_layer=-2, vocab_size=VOCAB,
                  eos_token_id=0)
    mx.random.seed(seed)
    model_config = llava.ModelConfig.from_dict(config)
    model_config.text_config = llava.TextConfig.from_dict(text)
    model_config.vision_config = llava.VisionConfig.from_dict(vision)
    model = llava.Model(model_config)
    weights = dict(tree_flatten(model.parameters()))
    head = "language_model.lm_head.weight"
    weights[head] = weights[head] * scale
    # The projector's output joins the text embeddings at their scale.
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                           crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=make_vision_tokenizer(), patch_size=PATCH, vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE, num_additional_image_tokens=1)
    processor.save_pretrained(str(folder))
    return folder


def write_tiny_gemma3(folder: Path, seed: int = 0, scale: float = 4.0, window: int = 8) -> Path:
    """A random Gemma 3 vision model folder: a SigLIP tower, sliding-window layers (every other
    one) in the language model, so its caches are RotatingKVCache and KVCache."""
    from mlx_vlm.models import gemma3
    from mlx_vlm.models.gemma3.processing_gemma3 import Gemma3Processor
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Gemma3ImageProcessor, PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = {"</s>": 0, "<s>": 1, **{f"w{i}": i for i in range(2, VOCAB - 3)}, "<boi>": VOCAB - 3,
             "<eoi>": VOCAB - 2, "<img>": IMAGE_TOKEN}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", extra_special_tokens={
        "boi_token": "<boi>", "eoi_token": "<eoi>", "image_token": "<img>"})
    text = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                num_attention_heads=4, head_dim=16, num_key_value_heads=2, vocab_size=VOCAB, query_pre_attn_scalar=16,
                sliding_window=window, sliding_window_pattern=2, mm_tokens_per_image=4)
    vision = dict(model_type="siglip_vision_model", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                  num_attention_heads=2, patch_size=PATCH, image_size=IMAGE_SIZE)
    config = dict(model_type="gemma3", text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN,
                  vocab_size=VOCAB, hidden_size=64, eos_token_id=[0])
    mx.random.seed(seed)
    model_config = gemma3.ModelConfig.from_dict(config)
    model_config.text_config = gemma3.TextConfig.from_dict(text)
    model_config.vision_config = gemma3.VisionConfig.from_dict(vision)
    weights = dict(tree_flatten(gemma3.Model(model_config).parameters()))
    embed = "language_model.model.embed_tokens.weight"  # tied: the head is the embedding
    weights[embed] = weights[embed] * scale
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    template = CHAT_TEMPLATE.replace("<image> ", "<boi> ")  # Gemma 3's processor expands its begin-of-image token
    Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
                    tokenizer=fast, chat_template=template, image_seq_length=4).save_pretrained(str(folder))
    return folder


def png_bytes(seed: int = 0, size: tuple[int, int] = (40, 32), fmt: str = "PNG") -> bytes:
    """A random RGB image, encoded."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format=fmt)
    return out.getvalue()
