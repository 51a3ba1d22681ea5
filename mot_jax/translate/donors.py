"""The shuffled-source control's donors, shared by training's closing table and the evaluation: which example lends
each row its source (`donor_indices`), and the donor's alignment carried onto the row's own target grid by position
(`regrid`, `carry`)."""

from __future__ import annotations

import numpy as np

from mot_jax.errors import MotJaxError
from mot_jax.translate import align as alignment_lib


def donor_indices(examples) -> list[int]:
    """Per example, the next example (cyclically) whose context differs from its own: `ShuffledSource`'s donor."""
    count = len(examples)
    donors = []
    for i, example in enumerate(examples):
        others = [j % count for j in range(i + 1, i + count) if examples[j % count]["context"] != example["context"]]
        if not others:
            raise MotJaxError(
                f"The shuffled-source control needs examples with at least two different contexts; these {count} "
                "have one. Pass more examples (--config.examples) or turn it off (--config.shuffled_source=false)."
            )
        donors.append(others[0])
    return donors


def regrid(alignment, donor_mask, mask, source_mask) -> alignment_lib.Alignment:
    """An alignment of source rows onto a donor's target grid (`donor_mask` [B, Td]) carried onto another target
    grid (`mask` [B, T]) by position, as `ShuffledSource` describes: weights [B, T, S]."""
    batch, length = np.shape(mask)
    width = alignment.weights.shape[2]
    weights = np.zeros((batch, length, width), np.float32)
    to_source, to_target = np.zeros((batch, length), np.int32), np.zeros((batch, width), np.int32)
    carried = carry(donor_mask, mask)
    for b in range(batch):
        mine, theirs = np.flatnonzero(mask[b]), np.flatnonzero(donor_mask[b])
        n, m = len(mine), len(theirs)
        pick = carried[b, mine]  # the donor token each of my tokens takes
        weights[b, mine] = alignment.weights[b, pick]
        to_source[b, mine] = alignment.target_to_source[b, pick]
        rank = np.searchsorted(theirs, alignment.source_to_target[b])  # each source token's donor token, 0..m-1
        first_taker = np.minimum(-(-rank * n // m), n - 1)
        to_target[b] = np.where(np.asarray(source_mask[b], bool), mine[first_taker], 0)
    return alignment_lib.Alignment(weights, to_source, to_target)


def carry(donor_mask, mask) -> np.ndarray:
    """[B, T] per slot of `mask`'s grid, the donor slot it takes by position: row b's i-th of n valid tokens takes
    the donor's floor(i * m / n)-th of m valid tokens (the identity when n = m); 0 at padding."""
    out = np.zeros(np.shape(mask), np.int32)
    for b in range(len(out)):
        mine, theirs = np.flatnonzero(mask[b]), np.flatnonzero(donor_mask[b])
        out[b, mine] = theirs[np.arange(len(mine)) * len(theirs) // len(mine)]
    return out
