"""Models tab: what is on this machine (built-in models, the Hugging Face cache, LM Studio's and
Ollama's stores) with load and evict, and the Hugging Face panel (app.views.model_search):
search, download.

The data side is ``app.hub`` (Qt-free). Everything slow (cache scans, evictions, the network)
runs on background threads (app.background), never on the GUI thread; loading goes to the
engine worker through the bridge.
"""

from __future__ import annotations

from typing import Callable, Optional

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QMessageBox, QPushButton, QSplitter, QTreeWidgetItem, QVBoxLayout, QWidget

from app import hub
from app.background import Job
from app.bridge import Bridge
from app.settings import AppSettings
from app.views.common import Card, hbox, model_table, plain_label, set_tone, title_label
from app.views.model_search import HubPanel
from app.views.serve_panel import ServePanel

COLUMNS = ("Model", "Source", "Kind", "Format", "Size on disk", "Memory needed", "Fits", "Registry pair", "Status")


def _short(pair: Optional[str]) -> str:
    """A registry partner as the table shows it: a drafter shipped with Tandem by its folder name."""
    if not pair:
        return "–"
    return pair.split("/")[-1] if pair.startswith("resources:") else pair


class ModelsView(QWidget):
    listed = Signal()  # the model list was (re)scanned: the chat's model picker follows

    def __init__(self, bridge: Bridge, cache_dir: Optional[str] = None, endpoint: Optional[str] = None,
                 parent: Optional[QWidget] = None, settings: Optional[AppSettings] = None):
        super().__init__(parent)
        self.bridge = bridge
        self.cache_dir = cache_dir
        self.entries: list[hub.ModelEntry] = []
        self.loaded: dict = {}
        self.memory = hub.machine_memory()  # reads /proc and cgroups: instant
        self.dense = hub.default_dense()  # until the engine reports its backend
        self.backend = ""
        self.scan_job: Optional[Job] = None
        self.rescan = False  # a refresh was asked for while a scan ran
        self.evict_job: Optional[Job] = None
        self.warnings: list[str] = []
        self.select_after_scan: Optional[str] = None  # a download's row, selected once listed
        self.said = False  # a message shows under the table; it stays until the selection changes
        # Asked before evicting; tests replace it (a modal dialog would block them).
        self.confirm: Callable[[str, str], bool] = self._ask

        root = QVBoxLayout(self)
        root.setContentsMargins(20, 16, 20, 16)
        root.setSpacing(12)
        self.memory_label = plain_label("", "pageSubtitle", wrap=False)
        self.refresh_button = QPushButton("Refresh")
        self.refresh_button.setObjectName("secondary")
        self.refresh_button.clicked.connect(self.refresh)
        root.addLayout(hbox((title_label("Models", "On this machine: built-in models, your Hugging Face cache, "
                                                  "LM Studio and Ollama. Targets generate; drafters speed a "
                                                  "target up."), 1),
                            self.memory_label, self.refresh_button))
        self.serve_panel = ServePanel(bridge, settings or AppSettings())
        root.addWidget(self.serve_panel)

        table_card = Card()
        self.table = model_table(COLUMNS)
        self.table.itemSelectionChanged.connect(self._on_selection)
        self.table.itemDoubleClicked.connect(lambda *_: self.load_selected())
        table_card.body.addWidget(self.table)
        self.detail = plain_label("", "hint")
        self.load_button = QPushButton("Load")
        self.load_button.setObjectName("primary")
        self.load_button.clicked.connect(self.load_selected)
        self.evict_button = QPushButton("Evict from cache…")
        self.evict_button.setObjectName("danger")
        self.evict_button.clicked.connect(lambda: self.evict_selected())
        table_card.body.addLayout(hbox((self.detail, 1), self.evict_button, self.load_button))

        self.hub_panel = HubPanel(cache_dir, endpoint, machine=lambda: (self.memory, self.dense),
                                  cached=lambda: {e.name for e in self.entries if e.source == "hf-cache"})
        self.hub_panel.downloaded.connect(self._on_downloaded)
        split = QSplitter(Qt.Vertical)
        split.setChildrenCollapsible(False)
        split.addWidget(table_card)
        split.addWidget(self.hub_panel)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        root.addWidget(split, 1)

        bridge.registry_rows.connect(lambda rows: self.refresh())
        bridge.device_info.connect(self._on_device)
        bridge.model_loaded.connect(self._on_loaded)
        bridge.model_failed.connect(self._on_load_failed)
        bridge.model_loading.connect(lambda what: self.redraw())
        self._show_machine()
        self.refresh()

    # -- endpoint (the Hub panel's; tests point it at a fake Hub) -----------------------------------------
    @property
    def endpoint(self) -> Optional[str]:
        return self.hub_panel.endpoint

    @endpoint.setter
    def endpoint(self, value: Optional[str]) -> None:
        self.hub_panel.endpoint = value

    # -- listing -------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A scan, an eviction, a search or a file listing is running (tests wait on this);
        downloads are ``downloading``."""
        return any(j is not None and j.running for j in (self.scan_job, self.evict_job)) or self.hub_panel.busy

    def refresh(self) -> Optional[Job]:
        """Rescan every store on a background thread; the table updates when it answers."""
        if self.scan_job is not None and self.scan_job.running:
            self.rescan = True
            return None
        self.rescan = False
        job = Job(hub.list_models, self.cache_dir, memory=self.memory, rows=self.bridge.pairs, dense=self.dense,
                  name="tandem-scan")
        job.succeeded.connect(self._on_scanned)
        job.failed.connect(self._on_scan_failed)
        job.finished.connect(self._on_scan_finished)
        self.scan_job = job
        self.refresh_button.setEnabled(False)
        if not self.entries:
            self.detail.setText("looking for models…")
        return job.start()

    def _on_scanned(self, result: tuple) -> None:
        self.entries, self.warnings = list(result[0]), list(result[1])
        self.redraw()
        self.listed.emit()
        if self.select_after_scan and self.select(self.select_after_scan):
            self.select_after_scan = None
        self.hub_panel.redraw()  # its "in cache" column

    def _on_scan_failed(self, message: str) -> None:
        self._say(f"could not list the local models: {message}", "bad")

    def _on_scan_finished(self) -> None:
        self.refresh_button.setEnabled(True)
        if self.rescan:
            self.refresh()

    def redraw(self) -> None:
        selected = self.selected_entry()
        self.table.clear()
        for entry in self.entries:
            fits = {True: "yes", False: "no", None: "?"}[entry.fits]
            item = QTreeWidgetItem([entry.display_name or entry.name, entry.source, entry.kind,
                                    entry.format + (f" · {entry.architecture}" if entry.architecture else "")
                                    + (" · images" if entry.images else ""),
                                    entry.size_str, hub.human_bytes(entry.needed_bytes) if entry.needed_bytes else "?",
                                    fits, _short(entry.pair), self._status(entry)])
            item.setData(0, Qt.UserRole, entry.key)
            item.setToolTip(0, f"{entry.name}\n{entry.description}" + (f"\n{entry.problem}" if entry.problem else ""))
            item.setToolTip(7, entry.pair or "")
            if self._is_loaded(entry):
                font = item.font(0)
                font.setBold(True)
                for c in range(len(COLUMNS)):
                    item.setFont(c, font)
            if entry.fits is False:
                item.setForeground(6, Qt.red)
            if entry.problem:
                item.setForeground(len(COLUMNS) - 1, Qt.darkGray)
            self.table.addTopLevelItem(item)
            if selected is not None and entry.key == selected.key:
                item.setSelected(True)
        self._update_buttons()

    def _on_device(self, info: dict) -> None:
        self.memory = int(info.get("memory_bytes") or self.memory)
        self.backend = str(info.get("backend") or "")
        self.dense = self.backend == "cpu"
        for entry in self.entries:
            hub.assess(entry, self.memory, self.dense)
        self._show_machine()
        self.redraw()
        self.hub_panel.redraw()

    def _show_machine(self) -> None:
        if not self.memory:
            self.memory_label.setText("")
            return
        how = "weights load as float32" if self.dense else "weights load as stored"
        where = f"{self.backend} backend: " if self.backend else ""
        self.memory_label.setText(f"this machine: {hub.human_bytes(self.memory)} memory · {where}{how}")

    def _status(self, entry: hub.ModelEntry) -> str:
        if self._is_loaded(entry):
            return "loaded"
        if self._touches(entry, self.loading_names()):
            return "loading…"
        if entry.source == "hf-cache" and entry.name == self.hub_panel.download_repo:
            return "downloading…"
        if entry.source == "built-in" and not entry.installed:
            return "not installed"
        if entry.problem:
            return "can't load"
        if not entry.complete:
            return "incomplete"
        return "ready"

    @staticmethod
    def _touches(entry: hub.ModelEntry, names: list[str]) -> bool:
        return any(n and (n in (entry.name, entry.spec) or (entry.repo_path and n.startswith(entry.repo_path)))
                   for n in names)

    def _is_loaded(self, entry: hub.ModelEntry) -> bool:
        return hub.entry_is_loaded(entry, self.loaded)

    def loaded_names(self) -> list[str]:
        info = self.loaded
        return [x for x in (info.get("spec"), info.get("name"), info.get("path"), info.get("drafter")) if x]

    def loading_names(self) -> list[str]:
        """Specs and drafters of the loads the worker has not finished (Bridge.pending_loads)."""
        return [x for load in self.bridge.pending_loads for x in load if x]

    def selected_entry(self) -> Optional[hub.ModelEntry]:
        items = self.table.selectedItems() if hasattr(self, "table") else []
        if not items:
            return None
        key = items[0].data(0, Qt.UserRole)
        return next((e for e in self.entries if e.key == key), None)

    def select(self, key: str) -> bool:
        for i in range(self.table.topLevelItemCount()):
            item = self.table.topLevelItem(i)
            if item.data(0, Qt.UserRole) == key:
                self.table.setCurrentItem(item)
                item.setSelected(True)
                return True
        return False

    def _on_selection(self) -> None:
        self.said = False
        self._update_buttons()

    def _update_buttons(self) -> None:
        e = self.selected_entry()
        loading = bool(self.bridge.pending_loads)
        self.load_button.setEnabled(e is not None and e.kind != "other" and e.installed and e.complete
                                    and not e.problem and not loading)
        self.evict_button.setEnabled(e is not None and e.source == "hf-cache"
                                     and not (self.evict_job is not None and self.evict_job.running))
        if self.said:
            return
        if e is not None:
            self.detail.setText(f"{e.name}: {e.problem or e.description}")
            set_tone(self.detail, "warn" if e.problem else "")
        elif not (self.scan_job is not None and self.scan_job.running and not self.entries):
            hint = f"{len(self.entries)} models"
            if self.warnings:
                hint += f" · {len(self.warnings)} cache warning(s): {self.warnings[0][:120]}"
            self.detail.setText(hint)
            set_tone(self.detail, "")

    # -- load / evict --------------------------------------------------------------------------
    def load_selected(self) -> None:
        e = self.selected_entry()
        if e is not None:
            self.load_entry(e)

    def load_entry(self, e: hub.ModelEntry) -> None:
        """Load a listed model (with its registry drafter when that is at hand); the chat's model
        picker loads through here too."""
        if e.problem:
            self._say(f"{e.name}: {e.problem}", "warn")
            return
        if e.kind == "drafter":
            target = e.pair
            if not target:
                self._say(f"{e.name} is a drafter; load its target model and pick this drafter with it", "warn")
                return
            self.bridge.load(target, e.name)
            return
        spec = e.spec
        if e.source == "Ollama":  # a blob without a .gguf name: linked under the model's name first
            from app.local_stores import link_for_loading
            from engine.paths import cache_root  # no MLX

            try:
                spec = str(link_for_loading(e.name, e.path, cache_root()))
            except OSError as err:
                self._say(f"cannot link {e.name} for loading: {err}", "bad")
                return
        drafter = e.pair if e.pair and any(x.name == e.pair for x in self.entries) else None
        self.bridge.load(spec, drafter)
        self.redraw()

    def in_use_reason(self, e: hub.ModelEntry) -> str:
        downloading = [self.hub_panel.download_repo] if self.hub_panel.downloading else []
        return hub.in_use_reason(e.name, self.loaded_names(), self.loading_names(), downloading, e.repo_path)

    def evict_selected(self) -> Optional[Job]:
        """Evict the selected cached repo: its size is read off the GUI thread, the user confirms,
        the files go on another background job. Refused while it is loaded, being loaded or being
        downloaded. Returns the job that reads the size (None when refused at once)."""
        e = self.selected_entry()
        if e is None or e.source != "hf-cache" or (self.evict_job is not None and self.evict_job.running):
            return None
        if reason := self.in_use_reason(e):
            self._say(reason, "bad")
            return None
        job = Job(hub.eviction_size, e.name, self.cache_dir, name="tandem-evict")
        job.succeeded.connect(lambda size, e=e: self._confirm_evict(e, size))
        job.failed.connect(lambda message: self._say(message, "bad"))
        job.finished.connect(self._update_buttons)
        self.evict_job = job
        return job.start()

    def _confirm_evict(self, e: hub.ModelEntry, size: str) -> None:
        if not self.confirm("Evict model", f"Delete every revision of {e.name} from the Hugging Face cache?\n"
                                           f"This frees {size}."):
            return
        if reason := self.in_use_reason(e):  # a load or download may have started meanwhile
            self._say(reason, "bad")
            return
        downloading = [self.hub_panel.download_repo] if self.hub_panel.downloading else []
        job = Job(hub.evict, e.name, self.cache_dir, loaded=self.loaded_names(), loading=self.loading_names(),
                  downloading=downloading, name="tandem-evict")
        job.succeeded.connect(lambda freed, e=e: self._on_evicted(e, freed))
        job.failed.connect(lambda message: self._say(message, "bad"))
        job.finished.connect(self._update_buttons)
        self.evict_job = job
        self._say(f"evicting {e.name}…")
        job.start()

    def _on_evicted(self, e: hub.ModelEntry, freed: int) -> None:
        self.entries = [x for x in self.entries if x.name != e.name or x.source != "hf-cache"]
        self.redraw()
        self._say(f"evicted {e.name}, freed {hub.human_bytes(freed)}", "good")
        self.refresh()

    def _ask(self, title: str, text: str) -> bool:
        return QMessageBox.question(self, title, text, QMessageBox.Yes | QMessageBox.Cancel,
                                    QMessageBox.Cancel) == QMessageBox.Yes

    def _say(self, text: str, tone: str = "") -> None:
        self.said = True
        self.detail.setText(text)
        set_tone(self.detail, tone)

    def _on_loaded(self, info: dict) -> None:
        self.loaded = dict(info)
        self.redraw()
        self._say(f"loaded {info.get('name')}" + (f" with drafter {info['drafter']}" if info.get("drafter") else "")
                  + (" · takes images" if info.get("takes_images") else ""), "good")

    def _on_load_failed(self, message: str) -> None:
        self.redraw()
        self._say(message, "bad")

    # -- downloads (the Hub panel) ---------------------------------------------------------------------
    @property
    def downloading(self) -> bool:
        return self.hub_panel.downloading

    def start_download(self, repo_id: Optional[str] = None, file: Optional[str] = None) -> Optional[Job]:
        return self.hub_panel.start_download(repo_id, file)

    def _on_downloaded(self, repo_id: str, key: str) -> None:
        self.select_after_scan = key or None
        self.refresh()

    def shutdown(self) -> None:
        """Cancel background work; its threads are daemons, so closing never waits for the network."""
        self.hub_panel.shutdown()
        for job in (self.scan_job, self.evict_job):
            if job is not None:
                job.cancel()
