"""Offline lm-eval task configs (`--include_path` this folder); a package so that installs carry it."""
