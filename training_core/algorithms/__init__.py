"""Algorithms as pure tensor functions; presets are data (see presets.py)."""
