"""The final partial batch that fairseq (main / fairseq-fixed) drops (fairseq #5036).

``fairseq.data.data_utils.batch_by_size`` ends with ``if bsz_mult > 1 and len(b[-1]) %
bsz_mult != 0: b = b[:-1]``: with the default ``--required-batch-size-multiple 8`` the last
sentences of a test set are silently not generated (100 verses, ``--batch-size 32``: 96
translated).  fairseq 0.12.2 keeps them.  The plugin never lets this pass silently: it logs
the number of dropped sentences, and with ``--fastgen-keep-last-batch`` appends them as a
final batch (every other batch unchanged, so every other output line stays the same).
"""
import functools
import logging

import numpy as np

logger = logging.getLogger("fairseq_fastgen")


def guard_batch_by_size(original, keep_last_batch):
    """Wrap ``data_utils.batch_by_size``; ``keep_last_batch()`` reads the active config."""

    @functools.wraps(original)
    def batch_by_size(indices, *args, **kwargs):
        batches = original(indices, *args, **kwargs)
        covered = sum(len(b) for b in batches)
        if kwargs.get("fixed_shapes") is not None or covered >= len(indices):
            return batches
        tail = np.asarray(indices)[covered:]  # batches are consecutive slices of indices
        if keep_last_batch():
            logger.info(f"fairseq-fastgen: kept the last batch of {len(tail)} sentences that "
                        "fairseq's batch_by_size drops (fairseq #5036)")
            return list(batches) + [tail]
        logger.warning(
            f"fairseq drops the last {len(tail)} of {len(indices)} sentences (a final batch "
            "smaller than --required-batch-size-multiple, fairseq #5036); pass "
            "--fastgen-keep-last-batch or --required-batch-size-multiple 1 to keep them")
        return batches

    return batch_by_size
