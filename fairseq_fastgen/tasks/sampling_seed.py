"""The random numbers of ``--sampling`` in the generate pipeline: stock's one stream, or a
seed per batch (``--fastgen-sampling-seed``).

Stock seeds torch once (``--seed``) and draws batch after batch, so a batch's draws depend
on every batch decoded before it in the same process.  Share the batches between ranks or
decoding workers, or skip a resumed run's finished ones, and the draws change.  Reseeding
before each batch from ``--seed`` and the batch's smallest sentence id makes each batch's
draws its own: every rank builds the same batches with the same ids, so the output is then
the same however the batches are shared out or resumed.  It is not stock's output (stock's
one stream is not replayed), which is why one process keeps the stream by default.
"""
import logging
import os
from typing import Any, Dict, Mapping, Optional

logger = logging.getLogger("fairseq_fastgen.generate")


def batch_seed_base(cfg, fastgen, environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """``--seed`` when each batch is reseeded, None for stock's one stream (also when the
    run does not sample or asks for no seed)."""
    gen = cfg.generation
    if not gen.sampling or gen.no_seed_provided or cfg.common.seed is None:
        return None
    mode = fastgen.sampling_seed
    if mode == "auto":  # torchrun sets WORLD_SIZE, also for one rank
        mode = "batch" if "WORLD_SIZE" in environ or fastgen.resume_dir else "stream"
    if mode != "batch":
        return None
    logger.info("sampling: torch reseeded before each batch from --seed %d and the batch's "
                "smallest sentence id (--fastgen-sampling-seed %s): the same output for any "
                "number of ranks or workers, not stock's one stream", cfg.common.seed,
                fastgen.sampling_seed)
    return int(cfg.common.seed)


def batch_seed(base: int, sample: Dict[str, Any]) -> int:
    """The seed of one batch (``sample["id"]``: (bsz,) int64, not empty)."""
    return (base % 2**31) * 2**32 + int(sample["id"].min()) % 2**32


def seed_batch(base: Optional[int], sample: Dict[str, Any]) -> None:
    """Reseed torch (CPU and CUDA) for ``sample`` when ``base`` is set."""
    if base is not None and sample["id"].numel():
        from fairseq import utils

        utils.set_torch_seed(batch_seed(base, sample))
