"""Batches decoded side by side in forked worker processes (CPU ``fairseq-generate``).

On CPU, stock fairseq decodes one batch at a time with ``torch.get_num_threads()``
intra-op threads.  A decoder step is a chain of small operations (GEMMs of a few hundred
rows, softmaxes, gathers, Python bookkeeping) that do not split well over threads, least
of all at small batches (see benchmarks/results/NOTES.md, "Second intra-op thread of a
CPU decoder").  Decoding ``N`` batches at once in ``N`` forked processes of
``threads / N`` threads each uses the same cores without that loss (what CTranslate2
calls ``inter_threads``).  Every batch is decoded whole by one worker with the same
generator, so each hypothesis is computed exactly as in a single process (in lossless
mode up to GEMM rounding, as everywhere); the writer puts the batches back in order.

The last batches of a run are cut into one part per worker (:func:`split_sample`): the
longest batches come last (fairseq orders them by length), and a worker finishing one
alone would leave the other cores idle for most of its time.

Where the continuous-batching engine serves the generator, each worker decodes the
batches it takes as one stream (stream_worker.py): a batch is still taken, encoded and
decoded by one worker, its finished sentences' rows going to the next sentences it holds.

Each worker also turns its batch into text (the pipeline's postprocessing), so decoding
and postprocessing overlap without taking a core from a decoder.

Fork and OpenMP: libgomp's thread pool does not survive ``fork``; a child that opens a
parallel region the parent had used hangs.  The main process therefore runs with one
torch thread from before the models are loaded until the workers are forked (one thread
never opens a parallel region), and workers start their own pools.

Not used (the main process decodes, one log line says why) on a GPU, in bitwise mode
(a worker's thread count changes how BLAS splits a GEMM, hence last bits), for sampling
on stock's one random stream and ``--retain-dropout`` (their random draws follow the batch
order of one process; sampling with a seed per batch, sampling_seed.py, is served), with
fewer than two threads, or with fewer than two batches per worker.
"""
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .records import BatchRecord, DecodeStats
from .sampling_seed import seed_batch

logger = logging.getLogger("fairseq_fastgen.generate")

MAX_AUTO_WORKERS = 8  # memory: each worker holds its own activations and caches
MIN_BATCHES_PER_WORKER = 2  # fewer batches: one worker would decode at a fraction of the cores


def planned_workers(cfg, fastgen, use_cuda: bool, batch_seeded: bool = False
                    ) -> Tuple[int, Optional[str]]:
    """(decoding workers, None), or (0, why the main process decodes), before loading.

    ``fastgen.decode_workers``: 0 auto (one per torch thread, at most
    ``MAX_AUTO_WORKERS``), 1 off, N >= 2 that many.  ``batch_seeded``: sampling reseeds
    each batch (sampling_seed.py), so a worker draws what one process draws.
    """
    n = fastgen.decode_workers
    if n == 1:
        return 0, "--fastgen-decode-workers 1"
    if use_cuda:
        return 0, "decoding on a GPU"
    if fastgen.bitwise:
        # BLAS splits a GEMM's work by thread count: another count, other last bits
        return 0, "bitwise mode keeps the decoding thread count of stock"
    if cfg.generation.sampling and not batch_seeded:
        return 0, "sampling draws random numbers in the batch order of one process"
    if cfg.generation.retain_dropout:
        return 0, "--retain-dropout draws random numbers in the batch order of one process"
    threads = torch.get_num_threads()
    if n == 0:
        n = min(MAX_AUTO_WORKERS, threads)
    if n < 2:
        return 0, "one torch thread"
    return n, None


def fit_to_batches(workers: int, n_batches: int) -> Tuple[int, Optional[str]]:
    """Workers for ``n_batches`` batches (0 and why, when too few batches)."""
    fit = min(workers, n_batches // MIN_BATCHES_PER_WORKER)
    if fit < 2:
        return 0, f"{n_batches} batch(es): too few to share between decoding workers"
    return fit, None


def threads_per_worker(workers: int, threads: int) -> int:
    return max(1, threads // workers)


def split_sample(sample: Dict[str, Any], parts: int) -> List[Dict[str, Any]]:
    """``sample`` cut into ``parts`` consecutive groups of sentences (fewer if it is small).

    Every per-sentence tensor is sliced along dim 0; the padded width is kept, so each
    sentence gets the same length limit (``--max-len-a`` scales the batch's source width)
    and the same inputs as in the whole batch.  Used for the last batches of a run, which
    would otherwise leave workers idle while one finishes its batch alone.
    """
    bsz = sample["id"].numel()
    parts = max(1, min(parts, bsz))
    bounds = [round(i * bsz / parts) for i in range(parts + 1)]

    def cut(x, sl):
        if torch.is_tensor(x) and x.dim() > 0 and x.size(0) == bsz:
            return x[sl]
        if isinstance(x, dict):
            return {k: cut(v, sl) for k, v in x.items()}
        return x

    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        sub = cut(sample, slice(lo, hi))
        sub["nsentences"] = hi - lo
        out.append(sub)
    return out


class DecodeJob:
    """Decodes one batch: ``job(sample) -> (BatchRecord, DecodeStats)``, in a worker or in
    the main process.

    Mirrors stock's per-batch code (prefix tokens, constraints, ``task.inference_step``
    timed as stock times it); ``pack(host_sample, hypos)`` makes the pipeline's record of
    the batch (``host_sample``: the sample before it was moved to a GPU, default sample).
    """

    def __init__(self, task, generator, models, prefix_size: int,
                 pack: Callable[[Dict[str, Any], Any], BatchRecord],
                 seed_base: Optional[int] = None):
        self.task = task
        self.seed_base = seed_base  # sampling: reseed each batch (sampling_seed.py)
        self.generator = generator
        self.models = models
        self.prefix_size = prefix_size
        self.pack = pack

    def prefix(self, sample: Dict[str, Any]):
        """stock's prefix tokens of a batch (None without --prefix-size)."""
        return sample["target"][:, : self.prefix_size] if self.prefix_size > 0 else None

    def continuous(self, log_fallbacks: bool = True):
        """The continuous-batching engine over this job's generator, or None (one log
        line says why) when batches are decoded one at a time."""
        from ..search.continuous import ContinuousBeamSearch

        engine, reason = ContinuousBeamSearch.for_task(self.task, self.generator)
        if reason is not None and log_fallbacks and \
                getattr(self.generator, "fastgen", None) is not None:
            logger.info("continuous batching off: %s; batches decoded one at a time", reason)
        return engine

    def __call__(self, sample: Dict[str, Any], host_sample: Optional[Dict[str, Any]] = None
                 ) -> Tuple[BatchRecord, DecodeStats]:
        prefix_tokens = None
        if self.prefix_size > 0:
            prefix_tokens = sample["target"][:, : self.prefix_size]
        constraints = sample["constraints"] if "constraints" in sample else None
        seed_batch(self.seed_base, host_sample or sample)
        t0 = time.perf_counter()
        hypos = self.task.inference_step(self.generator, self.models, sample,
                                         prefix_tokens=prefix_tokens, constraints=constraints)
        seconds = time.perf_counter() - t0
        tokens = sum(len(h[0]["tokens"]) for h in hypos)
        sentences = sample["nsentences"] if "nsentences" in sample else sample["id"].numel()
        return self.pack(host_sample or sample, hypos), DecodeStats(tokens, seconds, sentences)
