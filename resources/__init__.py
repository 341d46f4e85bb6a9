"""Run-time data shipped with Tandem (registry, bundled drafters). Located by
``engine.paths.resources_dir()``; this file only makes the folder installable."""
