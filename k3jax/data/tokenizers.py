"""The tokenizers moved to :mod:`k3jax.tokenizer`; this name stays only for ``infer.py``'s import
until that line points there (then this file goes)."""

from k3jax.tokenizer import load_tokenizer

__all__ = ["load_tokenizer"]
