"""Images in the Chat tab (offscreen): attach (button, paste, drop), send, thumbnails in the
transcript, the images stored with the conversation and there again after a restart; a model
without vision says so before anything is sent; a bad file is refused in the status bar."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import QMimeData, QUrl
from PySide6.QtGui import QImage

from app.conversations import ConversationStore
from app.settings import history_path
from engine.api import load
from engine.images import decode_image
from tests.test_app_chat import answer, greedy, make_win  # noqa: F401  (make_win: the fixture)
from tests.tiny_vision import png_bytes, write_tiny_llava


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory) -> Path:
    return write_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


def pasted(data: bytes) -> QMimeData:
    mime = QMimeData()
    mime.setImageData(QImage.fromData(data))
    return mime


def test_attach_send_and_reopen_with_the_thumbnail(make_win, qtbot, tmp_path, llava_folder):
    win = make_win(lambda: load(str(llava_folder)))
    chat = win.chat
    greedy(chat, 8)
    assert chat.takes_images
    photo = tmp_path / "photo.png"
    photo.write_bytes(png_bytes(1))
    chat.ask_image_paths = lambda: [str(photo)]
    chat.attach_button.click()  # the Image… button
    assert chat.input.canInsertFromMimeData(pasted(png_bytes(2)))
    chat.input.insertFromMimeData(pasted(png_bytes(2)))  # paste
    assert len(chat.attachments.images) == 2 and chat.attachments.isVisibleTo(chat)
    chat.attachments.remove(1)
    assert chat.attachments.images == [png_bytes(1)]
    result = answer(qtbot, win, lambda: chat.send("w5 w6 w7"))
    assert chat.attachments.images == [] and chat.attachments.isHidden()
    user_bubble = chat.bubbles[0]
    assert user_bubble.images == [png_bytes(1)] and len(user_bubble.thumbnails.thumbnails) == 1
    viewer = user_bubble.thumbnails.thumbnails[0].open()  # a click opens it larger
    assert viewer.isVisible()
    viewer.close()
    reference = load(str(llava_folder)).generate(
        [{"role": "user", "content": [{"type": "image", "image": decode_image(png_bytes(1))},
                                      {"type": "text", "text": "w5 w6 w7"}]}],
        mode="baseline", max_new_tokens=8, prefix_cache=False)
    assert result["text"] == reference.text
    cid = chat.conv.id
    store = ConversationStore(history_path())
    try:
        saved = store.load(cid)
        assert saved.messages[0].images == [png_bytes(1)] and store.image_count() == 1
    finally:
        store.close()
    win.shutdown()

    again = make_win(lambda: load(str(llava_folder)))  # restart: the chat reopens with its image
    chat2 = again.chat
    assert chat2.conv.id == cid and chat2.bubbles[0].images == [png_bytes(1)]
    assert chat2.bubbles[0].thumbnails is not None
    follow = answer(qtbot, again, lambda: chat2.send("w9"))  # the image is in the history it sends
    assert follow["prompt_tokens"] > result["prompt_tokens"]


def test_a_model_without_vision_says_so_before_sending(make_win, qtbot, tmp_path):
    win = make_win()  # the tiny text-only chat engine
    chat = win.chat
    assert not chat.takes_images
    assert chat.attach_image(png_bytes(1))
    assert "takes no images" in chat.status.text()
    chat.input.setPlainText("w5 w6")
    assert chat.send() is None and chat.bubbles == []
    assert "takes no images" in chat.status.text() and "vision model" in chat.status.text()
    assert chat.input.toPlainText() == "w5 w6" and chat.attachments.images == [png_bytes(1)]  # nothing lost


def test_a_dropped_file_that_is_not_an_image_is_refused(make_win, tmp_path):
    win = make_win()  # attaching needs no vision model (sending does)
    chat = win.chat
    bad = tmp_path / "notes.png"
    bad.write_bytes(b"not really a png")
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(bad))])
    assert chat._attach_mime(mime)
    assert chat.attachments.images == [] and "not an image" in chat.status.text()
    good = tmp_path / "good.png"
    good.write_bytes(png_bytes(3))
    mime.setUrls([QUrl.fromLocalFile(str(good))])
    chat._attach_mime(mime)
    assert chat.attachments.images == [png_bytes(3)]
