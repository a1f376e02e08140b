"""Continuous batching of beam search (see engine.py)."""
from .engine import ContinuousBeamSearch, unsupported

__all__ = ["ContinuousBeamSearch", "unsupported"]
