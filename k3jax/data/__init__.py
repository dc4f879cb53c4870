"""Training data: document sources (the bundled corpus and local files) and the grain pipeline that
packs them into fixed-length rows (the tokenizers: :mod:`k3jax.tokenizer`). Entry point:
:func:`make_train_dataset`."""

from k3jax.data.pipeline import batch_summary, make_train_dataset, split_indices
from k3jax.data.sources import bundled_corpus_path, open_documents

__all__ = ["batch_summary", "bundled_corpus_path", "make_train_dataset", "open_documents", "split_indices"]
