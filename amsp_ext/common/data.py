"""Real text, offline: the Python reference manual that ships with CPython (``pydoc_data``),
as byte-level tokens (vocabulary 256). Loss curves on it mean something, and no download is
needed.

Batches are a pure function of (step, micro-batch, rank), so every system in a comparison and
the single-process reference see exactly the same tokens.
"""

from __future__ import annotations

import functools

import torch

from amsp_ext.common.models import VOCAB_SIZE

__all__ = ["VOCAB_SIZE", "corpus_tokens", "global_batch", "micro_batch", "micro_batch_at"]

@functools.lru_cache(maxsize=1)
def corpus_tokens() -> torch.Tensor:
    """About 466k byte tokens of English technical prose, in a fixed order."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def global_batch(step: int, *, num_sequences: int, seq_len: int) -> torch.Tensor:
    """``[num_sequences, seq_len + 1]`` tokens for optimizer step ``step`` (inputs + shifted labels).

    Sequences are consecutive non-overlapping windows; the corpus wraps around.
    """
    if num_sequences < 1 or seq_len < 1:
        raise ValueError(f"num_sequences and seq_len must be >= 1, got {num_sequences}, {seq_len}")
    return _windows(step * num_sequences, num_sequences, seq_len)


def _windows(first: int, count: int, seq_len: int) -> torch.Tensor:
    """Windows ``first .. first + count - 1`` of the corpus (wrapping), ``[count, seq_len + 1]``."""
    tokens = corpus_tokens()
    window = seq_len + 1
    num_windows = tokens.numel() // window
    idx = (torch.arange(first, first + count) % num_windows) * window
    return torch.stack([tokens[i : i + window] for i in idx.tolist()])


def micro_batch(
    step: int, micro: int, rank: int, *, world_size: int, num_micro_batches: int,
    micro_batch_size: int, seq_len: int,
) -> torch.Tensor:
    """The slice of ``global_batch(step)`` that ``rank`` trains on in micro-batch ``micro``.

    The global batch is laid out [micro][rank][sequence], so rank r's micro-batch m is rows
    ``(m * world_size + r) * micro_batch_size ...``; a single process that walks all rows sees
    the same global batch.
    """
    num_sequences = num_micro_batches * world_size * micro_batch_size
    return micro_batch_at(step * num_sequences, micro, rank, world_size=world_size,
                          num_micro_batches=num_micro_batches, micro_batch_size=micro_batch_size,
                          seq_len=seq_len)


def micro_batch_at(
    first_sample: int, micro: int, rank: int, *, world_size: int, num_micro_batches: int,
    micro_batch_size: int, seq_len: int,
) -> torch.Tensor:
    """Like :func:`micro_batch`, for the global batch that starts at sample (window)
    ``first_sample``: a resumed job continues at the next sample whatever its world size."""
    num_sequences = num_micro_batches * world_size * micro_batch_size
    if num_sequences < 1 or seq_len < 1:
        raise ValueError(f"num_sequences and seq_len must be >= 1, got {num_sequences}, {seq_len}")
    start = (micro * world_size + rank) * micro_batch_size
    # only this slice's windows (the rows of the global batch it would cut out)
    return _windows(first_sample + start, micro_batch_size, seq_len)
