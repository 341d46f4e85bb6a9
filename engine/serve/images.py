"""Images in API requests: OpenAI ``image_url`` parts and Anthropic ``image`` blocks.

The dialect parsers keep an image where it stands in a message as a reference part
(``{"type": "image", "ref": ...}``); ``resolve`` decodes the references once the server's policy
is known: data URLs and base64 always, ``http(s)`` URLs only with ``--allow-image-urls`` (a web
page must not make the server fetch what it names). Every problem is a ``RequestError`` with a
4xx status that names the image (``messages[0].content[1]: ...``), raised before the engine sees
the request, so the server keeps serving.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any, Sequence

from engine.images import MAX_IMAGE_BYTES, MAX_IMAGES, ImageError, decode_base64, decode_image, parse_data_url
from engine.serve.chat_format import RequestError

FETCH_TIMEOUT_S = 10
MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp")


def openai_ref(part: dict, where: str) -> dict:
    """An ``image_url`` / ``input_image`` part as a reference (decoded later by ``resolve``)."""
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}: an image part needs 'image_url': {{'url': ...}}", param=where)
    return {"type": "image", "ref": {"url": url}, "where": where}


def anthropic_ref(block: dict, where: str) -> dict:
    """An Anthropic ``image`` block as a reference."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise RequestError(f"{where}: an image block needs a 'source'", param=where)
    kind = source.get("type")
    if kind == "base64":
        media = source.get("media_type")
        if media not in MEDIA_TYPES:
            raise RequestError(f"{where}: media_type {str(media)[:40]!r} is not supported "
                               f"({', '.join(MEDIA_TYPES)})", param=where, status=415)
        return {"type": "image", "ref": {"base64": source.get("data")}, "where": where}
    if kind == "url":
        return {"type": "image", "ref": {"url": source.get("url")}, "where": where}
    raise RequestError(f"{where}: image source type {str(kind)[:40]!r} is not supported (base64 or url)", param=where)


def join_parts(parts: Sequence[Any], sep: str = "") -> str | list[dict]:
    """Text pieces and image references of one message: a string when there are no images,
    else content parts in order (text runs joined with ``sep``)."""
    if all(isinstance(p, str) for p in parts):
        return sep.join(parts)
    out: list[dict] = []
    for p in parts:
        if isinstance(p, str):
            if out and out[-1]["type"] == "text":
                out[-1]["text"] += sep + p
            else:
                out.append({"type": "text", "text": p})
        else:
            out.append(p)
    return out


def has_refs(messages: Sequence[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"])
               for m in messages)


def resolve(messages: Sequence[dict], *, allow_urls: bool) -> list[dict]:
    """Messages with every image reference decoded into an ``engine.images.Image``."""
    out, count = [], 0
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for p in content:
            if p.get("type") == "image":
                count += 1
                if count > MAX_IMAGES:
                    raise RequestError(f"more than {MAX_IMAGES} images in one request", param="messages", status=413)
                parts.append({"type": "image", "image": _decode(p["ref"], p["where"], allow_urls)})
            else:
                parts.append(p)
        out.append({**m, "content": parts})
    return out


def _decode(ref: dict, where: str, allow_urls: bool):
    try:
        if "base64" in ref:
            return decode_image(decode_base64(ref["base64"], label=where), label=where)
        url = ref.get("url")
        if not isinstance(url, str):
            raise ImageError(f"{where}: the image URL must be a string")
        if url.startswith("data:"):
            return decode_image(parse_data_url(url, label=where), label=where)
        if url.startswith(("http://", "https://")):
            if not allow_urls:
                raise ImageError(f"{where}: remote image URLs are off; send the image as a data URL (base64), "
                                 f"or start the server with --allow-image-urls")
            return decode_image(_fetch(url, where), label=where)
        raise ImageError(f"{where}: unsupported image URL scheme (data: URLs, or http(s) with --allow-image-urls)")
    except ImageError as e:
        raise RequestError(str(e), param=where, status=e.status) from None


def _fetch(url: str, where: str) -> bytes:
    """GET an image, at most ``MAX_IMAGE_BYTES`` (only with --allow-image-urls)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "tandem"}),
                                    timeout=FETCH_TIMEOUT_S) as r:
            data = r.read(MAX_IMAGE_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ImageError(f"{where}: could not fetch the image ({type(e).__name__}: {str(e)[:80]})") from None
    return data
