"""The Models tab's Hugging Face panel: search the Hub (MLX, GGUF or any format), see each
result's size, parameter count and whether it fits this machine, pick a GGUF file, download
with progress and cancel. Every network call runs on a background thread (app.background);
an error is one line under the panel and the panel keeps working."""

from __future__ import annotations

import re
from typing import Callable, Optional

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QComboBox, QLineEdit, QProgressBar, QPushButton,
                               QTreeWidgetItem, QWidget)

from app import hub, hub_search
from app.background import Job
from app.views.common import Card, hbox, model_table, plain_label, set_tone

COLUMNS = ("Repository", "Format", "Parameters", "Download", "Memory needed", "Fits", "Downloads", "Likes",
           "Updated", "Local")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def human_count(n: Optional[int]) -> str:
    if not n:
        return "–"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


class HubPanel(Card):
    """``downloaded(repo_id, key)``: a download landed in the cache (key: the row to select)."""

    downloaded = Signal(str, str)

    def __init__(self, cache_dir: Optional[str], endpoint: Optional[str], machine: Callable[[], tuple[int, bool]],
                 cached: Callable[[], set], parent: Optional[QWidget] = None):
        super().__init__("Find on Hugging Face", parent)
        self.cache_dir, self.endpoint = cache_dir, endpoint
        self.machine = machine  # () -> (memory bytes, dense float32?)
        self.cached = cached  # () -> repo ids in the local cache
        self.results: list[hub_search.SearchResult] = []
        self.search_job: Optional[Job] = None
        self.files_job: Optional[Job] = None
        self.files_for: Optional[hub_search.SearchResult] = None
        self.download_job: Optional[Job] = None
        self.download_repo: Optional[str] = None

        self.search_input = QLineEdit()
        self.search_input.setPlaceholderText("search models, e.g. qwen3 0.6b, or paste org/name")
        self.search_input.returnPressed.connect(self.search)
        self.search_input.textChanged.connect(self._on_text)
        self.format = QComboBox()
        self.format.addItems(list(hub_search.FORMATS))
        self.format.setToolTip("MLX: ready to run on Apple silicon; GGUF: llama.cpp files (llama and qwen2 "
                               "architectures load here)")
        self.search_button = QPushButton("Search")
        self.search_button.setObjectName("secondary")
        self.search_button.clicked.connect(self.search)
        self.body.addLayout(hbox((self.search_input, 1), self.format, self.search_button))

        self.table = model_table(COLUMNS)  # styled like the local table
        self.table.itemSelectionChanged.connect(self._on_select)
        self.body.addWidget(self.table, 1)

        self.file = QComboBox()
        self.file.setMinimumContentsLength(28)
        self.file.setToolTip("a GGUF repo holds one file per quantization: download one")
        self.file.currentIndexChanged.connect(self._on_file)
        self.file.hide()
        self.download_button = QPushButton("Download")
        self.download_button.setObjectName("primary")
        self.download_button.clicked.connect(lambda: self.start_download())
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setObjectName("secondary")
        self.cancel_button.clicked.connect(self.cancel_download)
        self.cancel_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setValue(0)
        self.progress.setFormat("")
        self.body.addLayout(hbox((self.progress, 1), self.file, self.download_button, self.cancel_button))
        self.status = plain_label("Search the Hub, or paste a repo id and press Download.", "hint")
        self.body.addWidget(self.status)
        self._update_buttons()

    # -- state -------------------------------------------------------------------------------------
    @property
    def downloading(self) -> bool:
        return self.download_job is not None and self.download_job.running

    @property
    def busy(self) -> bool:
        """A search or a file listing is running (a download is ``downloading``)."""
        return any(j is not None and j.running for j in (self.search_job, self.files_job))

    def _say(self, text: str, tone: str = "") -> None:
        self.status.setText(text)
        set_tone(self.status, tone)

    def selected(self) -> Optional[hub_search.SearchResult]:
        items = self.table.selectedItems()
        if not items:
            return None
        repo = items[0].data(0, Qt.UserRole)
        return next((r for r in self.results if r.repo_id == repo), None)

    def select(self, repo_id: str) -> bool:
        for i in range(self.table.topLevelItemCount()):
            item = self.table.topLevelItem(i)
            if item.data(0, Qt.UserRole) == repo_id:
                self.table.setCurrentItem(item)
                return True
        return False

    def _on_file(self, _index: int) -> None:
        self._update_buttons()
        self.redraw()  # the download size is the chosen file's

    def _on_text(self, _text: str) -> None:
        self._update_buttons()

    def _update_buttons(self) -> None:
        r = self.selected()
        text = self.search_input.text().strip()
        want_file = r is not None and r.format == "GGUF"
        ready = (r is not None and (not want_file or self.file.currentData() is not None)) or (
            r is None and bool(_REPO_ID.match(text)))
        self.download_button.setEnabled(ready and not self.downloading)
        self.cancel_button.setEnabled(self.downloading)
        self.search_button.setEnabled(not (self.search_job and self.search_job.running))

    # -- search ------------------------------------------------------------------------------------
    def search(self) -> Optional[Job]:
        text = self.search_input.text().strip()
        fmt = self.format.currentText()
        job = Job(hub_search.search, text, fmt, endpoint=self.endpoint, name="tandem-search")
        job.succeeded.connect(self._on_results)
        job.failed.connect(self._on_search_failed)
        job.finished.connect(self._update_buttons)
        self.search_job = job
        self._say(f"searching the Hub for {text or 'popular models'} ({fmt})…")
        self._update_buttons()
        return job.start()

    def _on_results(self, results: list) -> None:
        if self.sender() is not self.search_job:
            return  # an older search answered late
        self.results = list(results)
        self.redraw()
        fmt = self.format.currentText()
        kind = "" if fmt == "Any format" else f"{fmt} "
        self._say(f"{len(self.results)} {kind}models, most downloaded first"
                  if self.results else "no models found; try other words or another format", "")

    def _on_search_failed(self, message: str) -> None:
        if self.sender() is self.search_job:
            self._say(message, "bad")

    def redraw(self) -> None:
        """Rebuild the table (also when this machine's memory or backend becomes known)."""
        memory, dense = self.machine()
        cached = self.cached()
        selected = self.selected()
        chosen = self.file.currentData() if selected is not None and selected.format == "GGUF" else None
        self.table.blockSignals(True)  # the selection (and its file choice) survives the rebuild
        self.table.clear()
        for r in self.results:
            size = (int(chosen[1]) if chosen and r is selected else None) if r.format == "GGUF" else r.size_bytes
            needed = hub.memory_needed(size or 0, r.params, r.format, dense)
            fits = hub.fits_in_memory(needed, memory)
            item = QTreeWidgetItem([
                r.repo_id, r.format or "other", human_count(r.params),
                hub.human_bytes(size) if size else ("pick a file" if r.format == "GGUF" else "?"),
                hub.human_bytes(needed) if needed else "?", {True: "yes", False: "no", None: "?"}[fits],
                f"{r.downloads:,}", f"{r.likes:,}", r.updated, "in cache" if r.repo_id in cached else ""])
            item.setData(0, Qt.UserRole, r.repo_id)
            item.setToolTip(0, f"{r.repo_id}\n{r.pipeline or ''} {r.architecture or ''}".strip())
            if fits is False:
                item.setForeground(5, Qt.red)
            self.table.addTopLevelItem(item)
            if selected is not None and selected.repo_id == r.repo_id:
                item.setSelected(True)
        self.table.blockSignals(False)
        if selected is not None and self.selected() is None:  # new results without it
            self._on_select()

    # -- GGUF files (on demand) ----------------------------------------------------------------------
    def _on_select(self) -> None:
        r = self.selected()
        self.file.clear()
        self.file.setVisible(r is not None and r.format == "GGUF")
        if r is not None and r.format == "GGUF":
            if r.files is None:
                self.file.addItem("listing files…", None)
                job = Job(hub_search.gguf_files, r.repo_id, endpoint=self.endpoint, name="tandem-files")
                job.succeeded.connect(self._on_files)
                job.failed.connect(self._on_files_failed)
                self.files_job, self.files_for = job, r
                job.start()
            else:
                self._fill_files(r)
        self._update_buttons()

    def _on_files(self, files: list) -> None:
        r = self.files_for
        if self.sender() is not self.files_job or r is None:
            return
        r.files = list(files)
        if self.selected() is r:
            self._fill_files(r)
            self.redraw()

    def _on_files_failed(self, message: str) -> None:
        if self.sender() is not self.files_job:
            return
        if self.selected() is self.files_for:
            self.file.clear()
        self._say(message, "bad")
        self._update_buttons()

    def _fill_files(self, r: hub_search.SearchResult) -> None:
        self.file.blockSignals(True)
        self.file.clear()
        for name, size in r.files or []:
            self.file.addItem(f"{name} · {hub.human_bytes(size)}", (name, size))
        if not r.files:
            self.file.addItem("no GGUF model files", None)
        else:  # Q4_K_M is the usual size/quality balance; else the first file
            best = next((i for i, (name, _) in enumerate(r.files) if "q4_k_m" in name.lower()), 0)
            self.file.setCurrentIndex(best)
        self.file.blockSignals(False)
        self._update_buttons()

    # -- downloads -----------------------------------------------------------------------------------
    def start_download(self, repo_id: Optional[str] = None, file: Optional[str] = None) -> Optional[Job]:
        """Download ``repo_id`` (``file`` only, for a GGUF repo), else the selected result (and
        its chosen file), else a repo id typed in the search field. One download at a time."""
        if self.downloading:
            return None
        if repo_id is None:
            r = self.selected()
            if r is not None:
                repo_id = r.repo_id
                if r.format == "GGUF":
                    if self.file.currentData() is None:
                        self._say("pick one of the repo's GGUF files first", "warn")
                        return None
                    file = self.file.currentData()[0]
            else:
                repo_id = self.search_input.text().strip()
        if not repo_id:
            return None
        job = Job(self._download, repo_id, file, name="tandem-download", control=True)
        job.progress.connect(self._on_progress)
        job.succeeded.connect(self._on_download_done)
        job.failed.connect(self._on_download_failed)
        job.finished.connect(self._on_download_finished)
        self.download_job, self.download_repo = job, repo_id
        self.progress.setRange(0, 0)  # busy until the first byte count arrives
        self.progress.setFormat("")
        self._say(f"connecting for {repo_id}{' · ' + file if file else ''}…")
        job.start()
        self._update_buttons()
        return job

    def _download(self, repo_id: str, file: Optional[str], *, cancel, progress) -> tuple[str, str]:
        """Runs on the download thread; a cancel leaves a resumable partial download."""
        try:
            hub.download(repo_id, lambda *update: progress(update), cancel, cache_dir=self.cache_dir,
                         endpoint=self.endpoint, files=[file] if file else None)
        except hub.DownloadCancelled:
            raise hub.TandemError("download cancelled; what arrived stays in the cache (download again to resume)")
        return repo_id, f"{repo_id}/{file}" if file else repo_id

    def cancel_download(self) -> None:
        if self.download_job is not None and self.download_job.running:
            self.download_job.cancel()
            self._say("cancelling…")

    def _on_progress(self, update: tuple) -> None:
        unit, done, total = update
        if unit == "bytes" and total > 0:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(1000 * min(done / total, 1.0)))
            self.progress.setFormat(f"{hub.human_bytes(done)} of {hub.human_bytes(total)}")
        elif unit == "files" and total > 0:
            self._say(f"{self.download_repo}: {int(done)} of {int(total)} files")

    def _on_download_done(self, result: tuple) -> None:
        repo_id, key = result
        self.progress.setRange(0, 1000)
        self.progress.setValue(1000)
        self.progress.setFormat("done")
        self._say(f"{repo_id} is in the cache", "good")
        self.downloaded.emit(repo_id, key)

    def _on_download_failed(self, message: str) -> None:
        self.progress.setRange(0, 1000)
        self.progress.setValue(0)
        self.progress.setFormat("")
        self._say(message, "bad")
        self.downloaded.emit("", "")  # the cache may hold a partial download now: list it

    def _on_download_finished(self) -> None:
        self.download_repo = None
        self._update_buttons()
        self.redraw()

    def shutdown(self) -> None:
        """Cancel what runs; the threads are daemons, so nothing waits for them."""
        for job in (self.search_job, self.files_job, self.download_job):
            if job is not None:
                job.cancel()
