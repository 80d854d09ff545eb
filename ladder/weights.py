"""Moved to fixtures/dequantized.py; kept until every caller imports it from there."""

from fixtures.dequantized import dequantized_weights  # noqa: F401
