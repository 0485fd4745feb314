"""naive_fp8: a naive FP8 W8A8 backend for fp8ref (the example of fp8ref's docs/writing-a-backend.md)."""

from .backend import NaiveFp8Backend

__all__ = ["NaiveFp8Backend"]
