"""Vision targets through mlx-vlm, on a tiny random LLaVA model folder (tests/tiny_vision.py):
it loads through mlx-vlm and says it takes images; with an image, Tandem's baseline is mlx-vlm's
own greedy decode and every mode gives the baseline's tokens; seeded sampling is the same with and
without the prefix cache; a second question on the same image prefills only the new tokens and
the vision tower does not run again; bad images and images for a text-only model are refused in
one line."""

from __future__ import annotations

import struct
import zlib

import mlx.core as mx
import pytest

from engine.api import load
from engine.drafters.draft_model import DraftModelDrafter
from engine.errors import TandemError
from engine.images import ImageError, decode_image, parse_data_url
from tests.tiny import make_tiny_engine, make_tiny_model
from tests.tiny_vision import IMAGE_TOKEN, png_bytes, write_tiny_llava

N = 16
QUESTION = "w5 w6 w7 w5 w6"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return load(str(write_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))))


@pytest.fixture(scope="module")
def image():
    return decode_image(png_bytes(1))


def ask(text: str, *images) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": text}]}]


def test_a_vision_folder_loads_through_mlx_vlm_and_says_it_takes_images(vlm):
    from engine.doctor import model_rows

    assert vlm.takes_images and vlm.vision.model_type == "llava" and vlm.image_refusal() is None
    assert type(vlm.vision.model).__module__.startswith("mlx_vlm.models.llava")
    assert vlm.target._split, "the trunk/head split reproduces mlx-vlm's language model"
    rows = dict(model_rows(vlm))
    assert rows["Images"].startswith("yes (llava through mlx-vlm")
    assert "only baseline" not in rows["--mode lookup"]


def test_baseline_with_an_image_is_mlx_vlms_own_greedy_decode(vlm, image):
    from mlx_vlm.models.cache import make_prompt_cache

    from engine.vision import image_prompt, split_images

    result = vlm.generate(ask(QUESTION, image), mode="baseline", max_new_tokens=N, prefix_cache=False)
    prompt = image_prompt(vlm, *split_images(ask(QUESTION, image)))
    assert prompt.ids.count(IMAGE_TOKEN) == 4 and result.prompt_tokens == len(prompt.ids)
    lm, cache = vlm.vision.model.language_model, None
    cache = make_prompt_cache(lm)
    embeds = vlm.vision.model.get_input_embeddings(mx.array([prompt.ids]), mx.array(prompt.inputs["pixel_values"]))
    logits = lm(mx.array([prompt.ids]), inputs_embeds=embeds.inputs_embeds, cache=cache).logits
    want = []
    while len(want) < N:
        token = int(mx.argmax(logits[0, -1]).item())
        if token == 0:
            break
        want.append(token)
        logits = lm(mx.array([[token]]), cache=cache).logits
    assert result.token_ids == want
    # The image matters: another image, another answer.
    other = vlm.generate(ask(QUESTION, decode_image(png_bytes(7))), mode="baseline", max_new_tokens=N,
                         prefix_cache=False)
    assert other.token_ids != want


def set_up(vlm, mode: str, tmp_path) -> str:
    """Point ``vlm`` at a random drafter for ``mode`` (tests/drafter_ckpt.py's checkpoints)."""
    from tests.test_block_drafters import write_dflash, write_dspark
    from tests.test_eagle3 import write_eagle3

    vlm.drafter_path = None
    if mode == "draft":
        vlm.set_drafter("draft", DraftModelDrafter(make_tiny_model("llama", seed=9), max_draft=3))
    elif mode == "dspark":
        vlm.drafter_path = str(write_dspark(tmp_path / "dspark", vlm, layers=2, taps=[0, 1, 2], markov_scale=10.0))
    elif mode == "dflash":
        vlm.drafter_path = str(write_dflash(tmp_path / "dflash", vlm, layers=2, taps=[1, 2]))
    elif mode == "eagle3":
        vlm.drafter_path = str(write_eagle3(tmp_path / "eagle3", vlm, aux=[1, 2], scale=0.3, draft_tokens=range(2, 90)))
    return mode


@pytest.mark.parametrize("mode", ["lookup", "draft", "dspark", "dflash", "eagle3", "auto"])
def test_every_mode_gives_the_baseline_tokens_with_an_image(vlm, image, mode, tmp_path):
    want = vlm.generate(ask(QUESTION, image), mode="baseline", max_new_tokens=N, prefix_cache=False)
    got = vlm.generate(ask(QUESTION, image), mode=set_up(vlm, mode, tmp_path), max_new_tokens=N,
                       prefix_cache=False)
    assert got.token_ids == want.token_ids, f"{mode} ({got.mode}) diverged from baseline"
    if mode != "auto":
        assert got.mode == mode and got.drafted > 0, "the drafter drafted on the answer"


@pytest.mark.parametrize("mode", ["baseline", "dspark"])
def test_seeded_sampling_is_the_same_with_and_without_the_prefix_cache(vlm, image, mode, tmp_path):
    mode = set_up(vlm, mode, tmp_path)
    vlm.clear_prefix_cache()
    kw = dict(mode=mode, max_new_tokens=N, temperature=0.9, seed=11)
    cold = vlm.generate(ask(QUESTION, image), prefix_cache=False, **kw)
    vlm.generate(ask(QUESTION, image), **kw)  # stores the prompt
    warm = vlm.generate(ask(QUESTION, image), **kw)
    assert warm.cached_tokens > 0 and warm.token_ids == cold.token_ids


def test_a_second_question_on_the_same_image_prefills_only_the_new_tokens(vlm, image):
    vlm.clear_prefix_cache()
    tower = vlm.vision.model
    calls = []
    original = tower.get_input_embeddings
    tower.get_input_embeddings = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        first = vlm.generate(ask(QUESTION, image), mode="lookup", max_new_tokens=8)
        history = ask(QUESTION, image) + [{"role": "assistant", "content": first.text}]
        rows: list[int] = []
        forward = vlm.target.forward
        vlm.target.forward = lambda ids, cache, **kw: rows.append(int(ids.shape[1])) or forward(ids, cache, **kw)
        try:
            second = vlm.generate(history + [{"role": "user", "content": "w9 w10"}], mode="lookup", max_new_tokens=8)
        finally:
            del vlm.target.forward
        assert len(calls) == 1, "the vision tower ran for the first question only"
        assert second.cached_tokens >= first.prompt_tokens
        assert rows[0] == second.prompt_tokens - second.cached_tokens, "the prefill ran over the new tokens only"
        cold = vlm.generate(history + [{"role": "user", "content": "w9 w10"}], mode="lookup", max_new_tokens=8,
                            prefix_cache=False)
        assert second.token_ids == cold.token_ids
        # Another image with the same words: restored only up to the image.
        other = ask(QUESTION, decode_image(png_bytes(2)))
        third = vlm.generate(other, mode="lookup", max_new_tokens=8)
        assert 0 < third.cached_tokens <= third.prompt_tokens - 4 - len(QUESTION.split())
        assert third.token_ids == vlm.generate(other, mode="lookup", max_new_tokens=8, prefix_cache=False).token_ids
    finally:
        tower.get_input_embeddings = original


def test_images_for_a_text_only_model_are_refused_in_one_line(image):
    engine = make_tiny_engine("llama", seed=0)
    with pytest.raises(ImageError, match="takes no images"):
        engine.generate("w5", images=[image], max_new_tokens=2)
    assert engine.generate("w5", max_new_tokens=2).generated >= 1


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (the pixel data is not there)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("data, status, words", [
    (b"not an image at all", 400, "not an image"),
    (png_header(10_000, 10_000), 413, "100 megapixels"),
    (png_bytes(0, fmt="TIFF"), 415, "TIFF images are not supported"),
    (png_bytes(0)[:60], 400, "corrupt PNG"),
    (b"", 400, "empty image"),
], ids=["garbage", "100MP", "tiff", "truncated", "empty"])
def test_bad_images_are_refused_before_their_pixels_are_decoded(data, status, words):
    with pytest.raises(ImageError, match=words) as e:
        decode_image(data, label="photo")
    assert e.value.status == status and str(e.value).startswith("photo: ")


def test_oversized_bytes_and_bad_data_urls_are_refused():
    with pytest.raises(ImageError, match="over the 1 MiB image limit"):
        decode_image(b"\0" * (2 << 20), max_bytes=1 << 20)
    with pytest.raises(ImageError, match="invalid base64"):
        parse_data_url("data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="not an image"):
        parse_data_url("data:text/plain;base64,aGk=")
    assert parse_data_url("data:image/png;base64,aGk=") == b"hi"


def test_tandem_generate_takes_images_and_says_what_is_wrong_with_a_bad_one(vlm, tmp_path, capsys):
    from engine.cli import main

    folder = vlm.loaded.path
    good = tmp_path / "good.png"
    good.write_bytes(png_bytes(1))
    assert main(["generate", "--model", str(folder), "--image", str(good), "--prompt", QUESTION, "--mode", "lookup",
                 "--max-new-tokens", "8", "--json"]) == 0
    out = capsys.readouterr().out
    want = vlm.generate(ask(QUESTION, decode_image(png_bytes(1))), mode="baseline", max_new_tokens=8,
                        prefix_cache=False)
    assert out.startswith(want.text)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"garbage")
    assert main(["generate", "--model", str(folder), "--image", str(bad), "--prompt", "w5"]) != 0
    assert f"{bad}: not an image" in capsys.readouterr().err
    assert main(["generate", "--image", str(tmp_path / "missing.png"), "--prompt", "w5"]) != 0
    assert "missing.png: cannot read" in capsys.readouterr().err


def test_a_model_whose_image_prefill_differs_from_mlx_vlms_is_refused_images(vlm):
    from engine import vision

    lm = vlm.vision.model.language_model
    original = type(lm).__call__
    try:  # a language model that shifts what follows an image (as 3-D rope positions would)
        type(lm).__call__ = lambda self, *a, **k: _shifted(original(self, *a, **k)) if k.get("inputs_embeds") is not None \
            else original(self, *a, **k)
        probe = vision.Vision(vlm.vision.model, vlm.vision.processor, "llava", IMAGE_TOKEN)
        vision.attach(vlm, probe, lambda module: "test")
    finally:
        type(lm).__call__ = original
    assert probe.refused and "differs from mlx-vlm's" in probe.refused
    with pytest.raises(TandemError, match="cannot take images here"):
        vision.image_prompt(vlm, *vision.split_images(ask("w5", decode_image(png_bytes(1)))), vision=probe)


def _shifted(out):
    out.logits = out.logits + 1.0 * (mx.arange(out.logits.shape[-1]) % 3 == 0)
    return out


# ----------------------------------------------------------------------------------------
# The server
# ----------------------------------------------------------------------------------------
def post(url: str, body: dict) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                   "anthropic-version": "2023-06-01"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def data_url(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def openai_chat(*parts: dict) -> dict:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        *parts, {"type": "text", "text": QUESTION}]}]}


def anthropic_chat(block: dict) -> dict:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        block, {"type": "text", "text": QUESTION}]}]}


def test_the_server_takes_images_in_both_dialects_and_refuses_bad_ones_in_4xx(vlm):
    import base64

    from engine.serve.server import make_server

    folder = str(vlm.loaded.path)
    want = vlm.generate(ask(QUESTION, decode_image(png_bytes(1))), mode="baseline", max_new_tokens=8,
                        prefix_cache=False).text
    srv = make_server(lambda: load(folder), port=0, mode="lookup").start().wait_ready(60)
    try:
        chat, messages = srv.url + "/v1/chat/completions", srv.url + "/v1/messages"
        status, body = post(chat, openai_chat({"type": "image_url", "image_url": {"url": data_url(png_bytes(1))}}))
        assert status == 200 and body["choices"][0]["message"]["content"] == want
        assert body["usage"]["prompt_tokens"] > 4
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(png_bytes(1)).decode()}}
        status, body = post(messages, anthropic_chat(block))
        assert status == 200 and body["content"][0]["text"] == want
        assert body["usage"]["cache_read_input_tokens"] > 0, "the same image and question were restored"
        refusals = [
            (openai_chat({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}), 400,
             "--allow-image-urls"),
            (openai_chat({"type": "image_url", "image_url": {"url": data_url(b"garbage")}}), 400,
             "not an image"),
            (openai_chat({"type": "image_url", "image_url": {"url": data_url(png_header(10_000, 10_000))}}),
             413, "megapixels"),
            (openai_chat({"type": "image_url", "image_url": {"url": data_url(png_bytes(0, fmt="TIFF"),
                                                                                   "image/tiff")}}), 415, "TIFF"),
        ]
        for body_in, code, words in refusals:
            status, body = post(chat, body_in)
            assert status == code and words in body["error"]["message"], (code, body)
            assert "messages[0].content[0]" in body["error"]["message"]
        status, body = post(messages, anthropic_chat({**block, "source": {**block["source"], "media_type": "image/tiff"}}))
        assert status == 415 and "media_type" in body["error"]["message"]
        # Still serving, with and without images.
        status, body = post(chat, {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "w5"}]})
        assert status == 200
        status, body = post(chat, openai_chat({"type": "image_url", "image_url": {"url": data_url(png_bytes(1))}}))
        assert status == 200 and body["choices"][0]["message"]["content"] == want
    finally:
        srv.stop()


def test_a_text_only_server_refuses_images_and_keeps_serving():
    from engine.serve.server import make_server

    srv = make_server(lambda: make_tiny_engine("llama", seed=0), port=0).start().wait_ready(60)
    try:
        chat = srv.url + "/v1/chat/completions"
        status, body = post(chat, openai_chat({"type": "image_url", "image_url": {"url": data_url(png_bytes(1))}}))
        assert status == 400 and "takes no images" in body["error"]["message"]
        status, _ = post(chat, {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "w5"}]})
        assert status == 200
    finally:
        srv.stop()


def test_mlx_vlm_caches_become_mlx_lms_of_the_same_kind():
    """engine/caches.py proves rollback and prefix snapshots on mlx-lm's cache classes."""
    from mlx_lm.models import cache as lm
    from mlx_vlm.models import cache as vlm_cache

    from engine.vision import to_mlx_lm_cache

    made = [to_mlx_lm_cache(c) for c in (vlm_cache.KVCache(), vlm_cache.RotatingKVCache(max_size=8, keep=0),
                                         vlm_cache.ArraysCache(size=2), vlm_cache.ChunkedKVCache(16),
                                         vlm_cache.CacheList(vlm_cache.KVCache(), vlm_cache.ArraysCache(size=1)))]
    assert [type(c) for c in made] == [lm.KVCache, lm.RotatingKVCache, lm.ArraysCache, lm.ChunkedKVCache, lm.CacheList]
    assert made[1].max_size == 8 and made[3].chunk_size == 16 and len(made[2].cache) == 2


def test_a_sliding_window_family_gemma3_is_lossless_with_images_and_restores_at_marks(tmp_path_factory, image):
    """Gemma 3 through mlx-vlm: sliding-window caches (converted to mlx-lm's RotatingKVCache) in the
    verify's transactions and the prefix cache."""
    from tests.tiny_vision import write_tiny_gemma3

    g3 = load(str(write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))))
    assert g3.takes_images and "RotatingKVCache" in g3.target.describe_caches()
    question = ask(QUESTION, image)
    want = g3.generate(question, mode="baseline", max_new_tokens=N, prefix_cache=False)
    assert want.prompt_tokens > 8, "the prompt outruns the sliding window"
    for mode in ("lookup", "draft", "dspark"):
        got = g3.generate(question, mode=set_up(g3, mode, tmp_path_factory.mktemp(mode)), max_new_tokens=N,
                          prefix_cache=False)
        assert got.token_ids == want.token_ids and got.drafted > 0, mode
    kw = dict(mode="baseline", max_new_tokens=N, temperature=0.9, seed=5)
    cold = g3.generate(question, prefix_cache=False, **kw)
    first = g3.generate(question, **kw)
    history = question + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "w9 w10"}]
    warm = g3.generate(history, **kw)
    assert first.token_ids == cold.token_ids
    assert warm.cached_tokens > 0 and warm.token_ids == g3.generate(history, prefix_cache=False, **kw).token_ids


@pytest.mark.parametrize("mode,cache", [("lookup", False), ("dspark", False), ("lookup", True)])
def test_image_requests_batch_with_text_ones(vlm, image, mode, cache, tmp_path, monkeypatch):
    """Two image requests (different images) and a text one share each forward: each gets its
    answer alone, the image rows prefilled with their own image's embeddings. With the prefix
    cache, each prompt is kept (keyed by its image) as soon as it is in, without touching the
    row's own ids, and the same image request later restores it."""
    from engine.batching import Batcher

    from engine.drafters.lookup import LookupDrafter

    mode = set_up(vlm, mode, tmp_path)
    if mode == "lookup":  # one without earlier tests' answers to draft from: those end rows early
        vlm.set_drafter("lookup", LookupDrafter())
        monkeypatch.setattr(vlm, "suffix_index", None)  # the request's plan would hand it the engine's
    other = decode_image(png_bytes(2))
    prompts = [ask(QUESTION, image), ask(QUESTION, other), "w9 w10 w11 w9 w10"]
    want = [vlm.generate(p, mode=mode, max_new_tokens=N, prefix_cache=False).token_ids for p in prompts]
    if cache:
        vlm.clear_prefix_cache()
    batcher = Batcher(vlm, 3)
    tickets = [batcher.submit(p, mode=mode, max_new_tokens=N, prefix_cache=cache) for p in prompts]
    batcher.run()
    assert [t.result.token_ids for t in tickets] == want and want[0] != want[1]
    assert max(t.result.batch_width for t in tickets) == 3
    if cache:  # the other image restored nothing of the first's rows
        assert tickets[1].result.cached_tokens < len(vlm.plan(prompts[1], max_new_tokens=N).prompt_ids) - 1
        again = Batcher(vlm, 3)
        repeat = again.submit(prompts[0], mode=mode, max_new_tokens=N)
        again.run()
        assert repeat.result.token_ids == want[0] and repeat.result.cached_tokens > 0
