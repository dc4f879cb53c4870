"""Training data: tokenizers, document sources (the bundled corpus and local files) and the grain
pipeline that packs them into fixed-length rows. Entry point: :func:`make_train_dataset`."""

from k3jax.data.pipeline import batch_summary, make_train_dataset, split_indices
from k3jax.data.sources import bundled_corpus_path, open_documents
from k3jax.data.tokenizers import ByteTokenizer, HFTokenizer, TextTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "TextTokenizer", "batch_summary", "bundled_corpus_path",
           "load_tokenizer", "make_train_dataset", "open_documents", "split_indices"]
