"""The ladder's names for which model it runs on and the prompt it gives it: `resolve_model`,
`prompt_ids`, `model_tokenizer` and `cache_root` live in engine/resolve.py, beside the product command
line that needs them; the ladder imports them from there."""

from __future__ import annotations

from engine.resolve import cache_root, model_tokenizer, prompt_ids, resolve_model

__all__ = ["cache_root", "model_tokenizer", "prompt_ids", "resolve_model"]
