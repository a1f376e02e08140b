"""The final partial batch that fairseq (main / fairseq-fixed) drops (fairseq #5036).

``fairseq.data.data_utils.batch_by_size`` ends with ``if bsz_mult > 1 and len(b[-1]) %
bsz_mult != 0: b = b[:-1]``: with the default ``--required-batch-size-multiple 8`` the last
sentences of a test set are silently not generated (100 verses, ``--batch-size 32``: 96
translated).  fairseq 0.12.2 keeps them.  The plugin never lets this pass silently: it logs
the number of dropped sentences, and with ``--fastgen-keep-last-batch`` appends them as a
final batch (every other batch unchanged, so every other output line stays the same).

Only generation runs are guarded (fairseq-generate, fairseq-interactive, the hub's
``generate``: the runs that open ``run_config.run(..., generation=True)``).  Everything
else keeps fairseq's batches without a word: fairseq-train's training batches, and its
validation batches too, because the validation loss and ``--eval-bleu`` share them and
keeping a tail would change the loss fairseq reports; also eval-lm, validate, and Python
code that batches outside any entry point.
"""
import functools
import logging
from typing import Callable, Optional

import numpy as np

from . import run_config

logger = logging.getLogger("fairseq_fastgen")


def keep_last_batch_of_run() -> Optional[bool]:
    """``keep_last_batch`` of the generation run in progress; None outside one."""
    if not run_config.generating():
        return None
    return run_config.current().keep_last_batch


def guard_batch_by_size(original, keep_last_batch: Callable[[], Optional[bool]]
                        = keep_last_batch_of_run):
    """Wrap ``data_utils.batch_by_size``: ``keep_last_batch()`` is read per call; True
    keeps the tail, False warns about it, None returns fairseq's batches untouched."""

    @functools.wraps(original)
    def batch_by_size(indices, *args, **kwargs):
        keep = keep_last_batch()
        batches = original(indices, *args, **kwargs)
        if keep is None:
            return batches
        covered = sum(len(b) for b in batches)
        if kwargs.get("fixed_shapes") is not None or covered >= len(indices):
            return batches
        tail = np.asarray(indices)[covered:]  # batches are consecutive slices of indices
        if keep:
            logger.info(f"fairseq-fastgen: kept the last batch of {len(tail)} sentences that "
                        "fairseq's batch_by_size drops (fairseq #5036)")
            return list(batches) + [tail]
        logger.warning(
            f"fairseq drops the last {len(tail)} of {len(indices)} sentences (a final batch "
            "smaller than --required-batch-size-multiple, fairseq #5036); pass "
            "--fastgen-keep-last-batch or --required-batch-size-multiple 1 to keep them")
        return batches

    return batch_by_size
