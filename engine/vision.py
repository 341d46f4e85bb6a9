"""Vision targets through mlx-vlm: its processor, its vision tower, and its language model driven
by the verify loop like any target.

An mlx-vlm model is a vision tower (+ projector) and a language model. Tandem wraps the language
model so that it looks like an mlx-lm model (``TextModel``: logits out, ``cache=``, a trunk
``model`` with ``layers`` and a head), and ``engine.target.Target`` drives it as usual: taps,
cache transactions, the prefix cache. Images enter the prefill only: the processor turns a chat
with image parts into token ids with placeholder runs, the vision tower's features replace the
placeholders' embeddings (``ImagePrompt.embeddings``), and every token after the prompt, drafted
or verified, is text. A drafter reading hidden states sees the target's own states, as for text.

The prefix cache keys an image prompt by ``ImagePrompt.key``: its token ids with each image's
placeholders replaced by ids derived from the image's bytes (ids at or above 2**31, which no
vocabulary reaches), so the same image and question restores, another image does not, and a
second question on the same image prefills only the new tokens (the vision tower does not run).

At load (``attach``) a probe compares Tandem's prefill with image embeddings and the step after it
against mlx-vlm's own language-model call on a synthetic image; a model whose language model keeps
more per-sequence state than its caches (Qwen2-VL's 3-D rope positions) fails it, and images are
refused for it with that reason (the model still answers text).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.errors import TandemError
from engine.images import MAX_IMAGES, Image, ImageError

log = logging.getLogger("tandem.vision")

KEY_BASE = 1 << 31  # prefix-cache key ids for image positions: above any vocabulary
PROBE_SIZE = (48, 40)  # the synthetic image the load-time probe sends (w, h)


# ----------------------------------------------------------------------------------------
# Which loader
# ----------------------------------------------------------------------------------------
def vlm_installed() -> bool:
    return importlib.util.find_spec("mlx_vlm") is not None


def _mlx_lm_has(model_type: str) -> bool:
    try:
        from mlx_lm.utils import MODEL_REMAPPING
    except ImportError:  # older mlx-lm
        MODEL_REMAPPING = {}
    name = MODEL_REMAPPING.get(model_type, model_type)
    return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None


def takes_images(config: dict) -> bool:
    """The config describes a model with a vision tower."""
    return isinstance(config.get("vision_config"), dict)


def wants_vlm(config: dict) -> bool:
    """Load this folder through mlx-vlm: it has a vision tower, or only mlx-vlm implements it."""
    if not vlm_installed():
        return False
    model_type = str(config.get("model_type", "")).replace("-", "_")
    if takes_images(config):
        return True
    return not _mlx_lm_has(model_type) and importlib.util.find_spec(f"mlx_vlm.models.{model_type}") is not None


# ----------------------------------------------------------------------------------------
# mlx-vlm's language model as an mlx-lm model
# ----------------------------------------------------------------------------------------
class Trunk(nn.Module):
    """mlx-vlm's decoder (embeddings, layers, final norm) with mlx-lm's call: ``(ids, cache)``,
    and ``input_embeddings`` for an image prompt's rows."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    @property
    def layers(self) -> list:
        return self.inner.layers  # the same list: a tap swapped into it is the decoder's

    @property
    def embed_tokens(self) -> nn.Module:
        return self.inner.embed_tokens

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)  # norm, config, ...

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "norm":  # the final-norm tap replaces the decoder's own norm
            setattr(self.inner, name, value)
        else:
            super().__setattr__(name, value)

    def __call__(self, ids: mx.array, cache: list | None = None, input_embeddings: mx.array | None = None) -> mx.array:
        return self.inner(ids, inputs_embeds=input_embeddings, cache=cache)


class TextModel(nn.Module):
    """mlx-vlm's language model with mlx-lm's interface: ``model(ids, cache=...)`` returns logits,
    ``model.model`` is the trunk, ``lm_head`` the head (absent when tied)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.model = Trunk(lm.model)
        head = getattr(lm, "lm_head", None)
        if head is not None:
            self.lm_head = head
        # mlx-vlm's text config (hidden_size, vocab_size, ...), as mlx-lm's ModelArgs would be
        self.args = getattr(lm, "config", None) or SimpleNamespace(tie_word_embeddings=head is None)
        object.__setattr__(self, "_lm", lm)  # not a child: its modules are reachable above already
        if hasattr(lm, "make_cache"):
            object.__setattr__(self, "make_cache", self._make_cache)

    @property
    def layers(self) -> list:
        return self.model.layers

    def _make_cache(self) -> list:
        return [to_mlx_lm_cache(c) for c in self._lm.make_cache()]

    def __call__(self, ids: mx.array, cache: list | None = None, input_embeddings: mx.array | None = None) -> mx.array:
        out = self._lm(ids, inputs_embeds=input_embeddings, cache=cache)
        return getattr(out, "logits", out)


def to_mlx_lm_cache(c: Any) -> Any:
    """mlx-lm's cache of the same kind as mlx-vlm's ``c`` (engine/caches.py knows mlx-lm's kinds:
    their rollback and prefix snapshots are proved there)."""
    from mlx_lm.models import cache as lm_cache

    kind = type(c).__name__
    if kind == "KVCache":
        return lm_cache.KVCache()
    if kind == "RotatingKVCache":
        return lm_cache.RotatingKVCache(max_size=c.max_size, keep=getattr(c, "keep", 0))
    if kind == "ArraysCache":
        return lm_cache.ArraysCache(size=len(c.cache))
    if kind == "ChunkedKVCache":
        return lm_cache.ChunkedKVCache(c.chunk_size)
    if kind == "CacheList":
        return lm_cache.CacheList(*(to_mlx_lm_cache(x) for x in c.caches))
    raise TandemError(f"mlx-vlm cache kind {kind} has no mlx-lm counterpart; this model cannot be driven by Tandem")


# ----------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------
@dataclass
class Vision:
    """What a vision target adds to its language model."""

    model: Any  # the whole mlx-vlm model: vision tower, projector, language model
    processor: Any  # its processor: image preprocessing, chat template with image placeholders
    model_type: str
    image_token: int | None  # the placeholder id the processor writes for image positions
    fingerprint: str = ""  # of the vision tower's weights (part of an image's prefix-cache key)
    refused: str | None = None  # why images are refused for this model (None: they are not)

    @property
    def takes_images(self) -> bool:
        return self.refused is None


def _image_token(processor: Any, config: dict) -> int | None:
    for key in ("image_token_index", "image_token_id"):
        for where in (config, config.get("text_config") or {}):
            if isinstance(where.get(key), int):
                return where[key]
    for obj in (processor, getattr(processor, "tokenizer", None)):
        value = getattr(obj, "image_token_id", None)
        if isinstance(value, int):
            return value
    tok = getattr(processor, "tokenizer", processor)
    text = getattr(processor, "image_token", None)
    if isinstance(text, str):
        ids = tok.convert_tokens_to_ids(text)
        return ids if isinstance(ids, int) else None
    return None


def load_vlm(folder: Path, set_precision: Callable[[nn.Module], None]) -> tuple[TextModel, Any, Vision, dict]:
    """Load an mlx-vlm folder: (language model as mlx-lm model, tokenizer wrapper, Vision, config).
    ``set_precision``: engine.loading's dtype policy, applied to the lazily loaded weights. Raises
    whatever mlx-vlm raises (engine.loading turns it into a one-line TandemError)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_vlm.utils import load

    vlm, processor = load(str(folder), lazy=True)
    set_precision(vlm)
    vlm.eval()
    lm = getattr(vlm, "language_model", None)
    if lm is None or not hasattr(getattr(lm, "model", None), "layers"):
        raise TandemError(f"{folder}: mlx-vlm's {type(vlm).__module__} has no language model Tandem can drive")
    config = _config_dict(vlm, folder)
    hf_tok = getattr(processor, "tokenizer", processor)
    if not getattr(hf_tok, "chat_template", None) and getattr(processor, "chat_template", None):
        hf_tok.chat_template = processor.chat_template  # text-only turns render as image ones do
    eos = config.get("eos_token_id") or (config.get("text_config") or {}).get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else (list(eos) if eos else None)
    tokenizer = TokenizerWrapper(hf_tok, eos_token_ids=eos)
    vision = Vision(vlm, processor, str(config.get("model_type", "")), _image_token(processor, config))
    if vision.image_token is None or not takes_images(config):
        vision.refused = f"{vision.model_type} loads through mlx-vlm but has no image input Tandem can find"
    return TextModel(lm), tokenizer, vision, config


def _config_dict(vlm: Any, folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"model_type": getattr(getattr(vlm, "config", None), "model_type", "")}


def attach(engine: Any, vision: Vision, fingerprint: Callable[[nn.Module], str]) -> Vision:
    """Check on ``engine``'s target that image prompts run as mlx-vlm runs them; refuse images
    (with the reason) when they do not. ``fingerprint``: a module's weights -> a short hash
    (engine.prefix_cache's)."""
    if vision.refused is None:
        towers = [m for name, m in vision.model.children().items() if name != "language_model" and isinstance(m, nn.Module)]
        vision.fingerprint = fingerprint(nn.Sequential(*towers)) if towers else ""
        try:
            vision.refused = _probe(engine, vision)
        except TandemError as e:
            vision.refused = str(e)
        except Exception as e:  # a processor or tower that fails on a plain image
            vision.refused = f"the image probe failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        if vision.refused:
            log.warning("images off for %s: %s", engine.name, vision.refused)
    return vision


def _probe(engine: Any, vision: Vision) -> str | None:
    """Tandem's prefill with image embeddings and one step after it must give the logits of
    mlx-vlm's own language-model call on the same embeddings."""
    from mlx_vlm.models.cache import make_prompt_cache
    from PIL import Image as PILImage

    from engine.target import _close, _tolerance

    w, h = PROBE_SIZE
    pixels = (np.add.outer(np.arange(h) * 5, np.arange(w) * 3)[..., None] + np.array([0, 60, 120])) % 256
    image = Image(PILImage.fromarray(pixels.astype(np.uint8), "RGB"), "probe", "PNG", 0)
    prompt = image_prompt(engine, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}],
                          [image], vision=vision)
    target = engine.target
    step = mx.array([[prompt.ids[-1]]])
    with target.uncounted():
        cache = target.new_cache()
        with target.prompt_embeddings(prompt.embeddings):
            want_first, _ = target.prefill(prompt.ids, cache)
        want_next = target.forward(step, cache)[0][-1]
    lm = vision.model.language_model
    ref_cache = make_prompt_cache(lm)
    ids = mx.array([prompt.ids])
    features = prompt.features()
    extra = {k: v for k, v in vars(features).items() if k != "inputs_embeds" and v is not None} \
        if hasattr(features, "__dict__") else {}
    got_first = _logits(lm(ids, inputs_embeds=features.inputs_embeds, cache=ref_cache, **extra))[0, -1]
    got_next = _logits(lm(step, cache=ref_cache))[0, -1]
    mx.eval(want_first, want_next, got_first, got_next)
    tolerance = _tolerance(got_first)
    if not _close(want_first, got_first, tolerance):
        return (f"{vision.model_type}: Tandem's prefill with the image differs from mlx-vlm's "
                f"(its language model needs inputs Tandem does not pass)")
    if not _close(want_next, got_next, tolerance):
        return (f"{vision.model_type}: the step after an image differs from mlx-vlm's (its language model keeps "
                f"per-sequence position state, e.g. 3-D rope, that Tandem's verify does not carry yet)")
    return None


def _logits(out: Any) -> mx.array:
    return getattr(out, "logits", out)


# ----------------------------------------------------------------------------------------
# Image prompts
# ----------------------------------------------------------------------------------------
class ImagePrompt:
    """A chat with images, as the target sees it: token ids with placeholder runs, the pixel
    inputs, the prefix-cache key, and the merged embeddings for the rows that need them."""

    def __init__(self, vision: Vision, text: str, ids: list[int], inputs: dict, images: Sequence[Image]):
        self.vision = vision
        self.text = text  # the rendered chat
        self.ids = ids
        self.inputs = inputs  # pixel_values and whatever else the processor gave the tower (numpy)
        self.images = list(images)
        positions = [i for i, t in enumerate(ids) if t == vision.image_token]
        if not positions:
            raise ImageError(f"{vision.model_type}: the prompt has no image placeholder (the chat template dropped the image)")
        self.start, self.end = positions[0], positions[-1] + 1  # rows whose embeddings the tower changes
        self.key = _key(ids, positions, self.images, vision.fingerprint)
        self._features: Any = None

    def features(self) -> Any:
        """mlx-vlm's ``get_input_embeddings`` on the whole prompt (runs the vision tower once)."""
        if self._features is None:
            ids = mx.array([self.ids])
            # made here, in the thread that runs the engine (the server renders prompts elsewhere)
            inputs = {k: mx.array(v) for k, v in self.inputs.items()}
            self._features = self.vision.model.get_input_embeddings(ids, **inputs)
        return self._features

    def embeddings(self, start: int, end: int) -> mx.array | None:
        """Input embeddings for prompt rows [start, end), or None when no image row is among them
        (then the tokens embed as text: the same values, and the vision tower need not run)."""
        if end <= self.start or start >= self.end:
            return None
        embeds = self.features().inputs_embeds
        return embeds[:, start:end]


def _key(ids: list[int], positions: list[int], images: Sequence[Image], salt: str) -> list[int]:
    """``ids`` with each image position replaced by an id (>= 2**31) derived from the image's bytes.
    Runs of placeholders map to images in order when there is one run per image; otherwise (tiled
    images) every position is keyed by all the images."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][-1] == p - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    if len(runs) == len(images):
        digests = [hashlib.sha256(f"{salt}|{im.sha256}".encode()).digest() for im in images]
    else:
        everything = hashlib.sha256(f"{salt}|{'|'.join(im.sha256 for im in images)}".encode()).digest()
        digests = [everything] * len(runs)
    key = list(ids)
    for run, digest in zip(runs, digests):
        words = [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 32, 4)]
        for j, p in enumerate(run):
            key[p] = KEY_BASE | ((words[j % 8] + j) & 0x7FFFFFFF)
    return key


def split_images(messages: Sequence[dict]) -> tuple[list[dict], list[Image]]:
    """Messages whose content parts may carry images ({"type": "image", "image": Image}) ->
    (messages with bare {"type": "image"} placeholders for the chat template, the images in order)."""
    out, images = [], []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(dict(m))
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image":
                image = part.get("image")
                if not isinstance(image, Image):
                    raise ImageError("an image part without a decoded image")
                images.append(image)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    return out, images


def has_images(messages: Any) -> bool:
    return isinstance(messages, (list, tuple)) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for m in messages)


def text_only(messages: Sequence[dict]) -> list[dict]:
    """Messages whose content lists hold only text parts, flattened to strings."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        out.append({**m, "content": content})
    return out


def image_prompt(engine: Any, messages: Sequence[dict], images: Sequence[Image], *,
                 vision: Vision | None = None) -> ImagePrompt:
    """Render ``messages`` (with {"type": "image"} parts, one per image in order) with the
    processor's chat template and preprocess the images."""
    vision = vision or getattr(engine, "vision", None)
    if vision is None:
        raise ImageError(f"{engine.name} takes no images (a text-only model)")
    if vision.refused:
        raise ImageError(f"{engine.name} cannot take images here: {vision.refused}")
    if len(images) > MAX_IMAGES:
        raise ImageError(f"{len(images)} images in one request; at most {MAX_IMAGES}", status=413)
    processor = vision.processor
    renderer = processor if getattr(processor, "chat_template", None) else getattr(processor, "tokenizer", processor)
    try:
        text = renderer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    except Exception as e:
        raise TandemError(f"{engine.name}: its chat template failed on this conversation ({_first_line(e)})") from None
    inputs = _process(processor, text, [im.pil for im in images], vision.image_token)
    ids = [int(t) for t in _as_list(inputs.pop("input_ids"))]
    mask = inputs.pop("attention_mask", None)
    if mask is not None:  # mlx-vlm's generate hands it to get_input_embeddings as ``mask`` (Gemma 3 reads it)
        inputs["mask"] = mask
    pixels = {k: np.asarray(v) for k, v in inputs.items() if v is not None}
    return ImagePrompt(vision, text, ids, pixels, images)


def _process(processor: Any, text: str, images: list, image_token: int | None) -> dict:
    """The processor's token ids and pixel inputs for one prompt. mlx-vlm's ``prepare_inputs``
    first (its per-model handling); a processor that refuses its padding arguments (llava's under
    transformers 5) is called plainly."""
    from mlx_vlm.utils import prepare_inputs

    try:
        return dict(prepare_inputs(processor, images=images, prompts=text, image_token_index=image_token))
    except ValueError as first:
        try:
            return dict(processor(text=text, images=images))
        except Exception:
            raise ImageError(f"the model's processor refused the image ({_first_line(first)})") from None


def _as_list(ids: Any) -> list:
    arr = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return arr[0] if arr and isinstance(arr[0], list) else arr


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
