"""The optional progress bar of a checkpoint read or write (one tick per tensor)."""

from __future__ import annotations


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar, or None when ``enabled`` is false (tqdm is imported only when asked for)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tensor")


__all__ = ["progress_bar"]
