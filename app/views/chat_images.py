"""Images in the chat: thumbnails (click to open), the strip of images attached to the message being
written, and reading images from the clipboard, dropped files or a file dialog.

Images travel as the encoded file's bytes (what the history stores); ``engine.images.decode_image``
checks each one when it is attached, so a corrupt or oversized file is refused then, in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QMimeData, Qt, Signal
from PySide6.QtGui import QImage, QMouseEvent, QPixmap
from PySide6.QtWidgets import QDialog, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from engine.images import MAX_IMAGES, ImageError, decode_image, read_image_bytes

THUMB_PX = 96
VIEWER_PX = 900
FILE_FILTER = "Images (*.png *.jpg *.jpeg *.webp *.gif *.bmp)"


def pixmap(data: bytes) -> QPixmap:
    pm = QPixmap()
    pm.loadFromData(QByteArray(data))
    return pm


def png_of(image: QImage) -> bytes:
    """A pasted image (the clipboard's QImage) as PNG bytes."""
    buf = QBuffer()
    buf.open(QIODevice.WriteOnly)
    image.save(buf, "PNG")
    return bytes(buf.data())


def images_in(mime: QMimeData) -> list[tuple[str, bytes | Path]]:
    """What a paste or drop carries that could be images: (label, PNG bytes) for a bitmap,
    (label, path) for local files."""
    found: list[tuple[str, bytes | Path]] = []
    if mime.hasImage():
        image = mime.imageData()
        if isinstance(image, QImage) and not image.isNull():
            found.append(("pasted image", png_of(image)))
    if mime.hasUrls():
        for url in mime.urls():
            if url.isLocalFile():
                found.append((url.toLocalFile(), Path(url.toLocalFile())))
    return found


def load_image(source: bytes | Path, label: str) -> bytes:
    """The bytes of an image to attach, checked (``ImageError`` in one line otherwise)."""
    data = read_image_bytes(source) if isinstance(source, Path) else source
    decode_image(data, label=label)
    return data


class Thumbnail(QLabel):
    """A small image; a click opens it larger."""

    clicked = Signal()

    def __init__(self, data: bytes, size: int = THUMB_PX):
        super().__init__()
        self.data = data
        self.setObjectName("thumbnail")
        pm = pixmap(data)
        self.setPixmap(pm.scaled(size, size, Qt.KeepAspectRatio, Qt.SmoothTransformation) if not pm.isNull() else pm)
        self.setToolTip(f"{pm.width()}×{pm.height()}, {len(data) / 1024:.0f} KB: click to open")
        self.setCursor(Qt.PointingHandCursor)
        self.clicked.connect(self.open)

    def mousePressEvent(self, event: QMouseEvent) -> None:
        if event.button() == Qt.LeftButton:
            self.clicked.emit()
        super().mousePressEvent(event)

    def open(self) -> QDialog:
        viewer = QDialog(self.window())
        viewer.setWindowTitle("Image")
        viewer.setAttribute(Qt.WA_DeleteOnClose)
        label = QLabel()
        pm = pixmap(self.data)
        if pm.width() > VIEWER_PX or pm.height() > VIEWER_PX:
            pm = pm.scaled(VIEWER_PX, VIEWER_PX, Qt.KeepAspectRatio, Qt.SmoothTransformation)
        label.setPixmap(pm)
        QVBoxLayout(viewer).addWidget(label)
        viewer.show()
        return viewer


class ThumbnailRow(QWidget):
    """The images of a message in the transcript."""

    def __init__(self, images: list[bytes]):
        super().__init__()
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(6)
        self.thumbnails = [Thumbnail(data) for data in images]
        for t in self.thumbnails:
            lay.addWidget(t)
        lay.addStretch(1)


class AttachmentStrip(QWidget):
    """The images attached to the message being written, each with a remove button."""

    changed = Signal()

    def __init__(self):
        super().__init__()
        self.images: list[bytes] = []
        self._lay = QHBoxLayout(self)
        self._lay.setContentsMargins(0, 0, 0, 0)
        self._lay.setSpacing(6)
        self._lay.addStretch(1)
        self.hide()

    def add(self, data: bytes) -> None:
        if len(self.images) >= MAX_IMAGES:
            raise ImageError(f"at most {MAX_IMAGES} images per message")
        self.images.append(data)
        self._rebuild()

    def set_images(self, images: list[bytes]) -> None:
        self.images = list(images)
        self._rebuild()

    def take(self) -> list[bytes]:
        images, self.images = self.images, []
        self._rebuild()
        return images

    def remove(self, index: int) -> None:
        if 0 <= index < len(self.images):
            del self.images[index]
            self._rebuild()

    def _rebuild(self) -> None:
        while self._lay.count() > 1:
            item = self._lay.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()
        for i, data in enumerate(self.images):
            cell = QWidget()
            box = QVBoxLayout(cell)
            box.setContentsMargins(0, 0, 0, 0)
            box.setSpacing(2)
            box.addWidget(Thumbnail(data, 64))
            remove = QPushButton("Remove")
            remove.setObjectName("link")
            remove.clicked.connect(lambda _=False, i=i: self.remove(i))
            box.addWidget(remove)
            self._lay.insertWidget(self._lay.count() - 1, cell)
        self.setVisible(bool(self.images))
        self.changed.emit()


def attach_from(mime: QMimeData, attach: Callable[[bytes | Path, str], None]) -> bool:
    """Attach every image a paste or drop carries; True when it carried any."""
    found = images_in(mime)
    for label, source in found:
        attach(source, label)
    return bool(found)
