"""Typed contracts between the layers, with no implementation in them: what one layer hands
another. Everything else in `rose` may import from here; this package imports nothing of it."""

from rose.contracts.load import TokenLoad

__all__ = ["TokenLoad"]
