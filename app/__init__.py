"""Tandem's desktop app (PySide6). Only ``app.worker`` touches MLX; everything else is Qt views,
the signal bridge and Qt-free helpers (``app.hub``, ``app.race_verdict``, ``app.telemetry_model``)."""
