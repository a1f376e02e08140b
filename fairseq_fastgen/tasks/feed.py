"""The generate pipeline's feed loops: every batch of the epoch into the worker pool.

Either the main process decodes each batch and the pool writes its text
(:func:`decode_here`), or each batch goes to a decoding worker whole, the last ones cut
into one part per worker (:func:`feed_decoders`, see decode_workers).  Both return
``(sentences, has_target)`` as stock's loop counts them.
"""
import logging
import time
from typing import Tuple

from . import decode_workers
from .records import DecodeStats

logger = logging.getLogger("fairseq_fastgen.generate")


def decode_here(progress, pool, job, meters, use_cuda: bool,
                log_fallbacks: bool = True) -> Tuple[int, bool]:
    """Decode every batch in this process, text in the pool: as one stream with
    continuous batching where the engine serves the generator, else batch by batch.
    (Either way one record per batch, in batch order, as the rank exchange needs.)"""
    engine = job.continuous(log_fallbacks)
    if engine is not None:
        return decode_stream(progress, pool, job, meters, use_cuda, engine)
    from fairseq import utils

    num_sentences = 0
    has_target = True
    for host_sample in progress:
        sample = utils.move_to_cuda(host_sample) if use_cuda else host_sample
        if "net_input" not in sample:
            continue
        rec, (tokens, seconds, n) = job(sample, host_sample)
        meters.gen_timer.sum += seconds  # stock's gen_timer: inference_step alone
        meters.add(tokens, seconds, n)
        if host_sample["id"].numel():
            has_target = host_sample["target"] is not None
        pool.submit(rec)
        meters.log(progress)
        num_sentences += n
    return num_sentences, has_target


def feed_decoders(progress, pool, meters, n_batches: int, n_workers: int,
                  split_tail: bool = True) -> Tuple[int, bool]:
    """Send every batch to the decoding workers, the last ``n_workers`` cut into one part
    per worker (with ``split_tail``)."""
    num_sentences = 0
    has_target = True
    gen_timer = meters.gen_timer
    for i, host_sample in enumerate(progress):
        if "net_input" not in host_sample:
            continue
        if host_sample["id"].numel():
            has_target = host_sample["target"] is not None
        if gen_timer.start_time is None:
            gen_timer.start()
        parts = n_workers if split_tail and i >= n_batches - n_workers else 1
        for sub in decode_workers.split_sample(host_sample, parts):
            pool.submit_sample(sub)
        meters.log(progress)
        num_sentences += (host_sample["nsentences"] if "nsentences" in host_sample
                          else host_sample["id"].numel())
    if gen_timer.start_time is None:  # no batch at all
        gen_timer.start()
    return num_sentences, has_target


def decode_stream(progress, pool, job, meters, use_cuda: bool, engine) -> Tuple[int, bool]:
    """Every batch through the continuous-batching engine; results in batch order.

    Generation time is the engine's (the data loading it waits for excluded), as stock's
    gen_timer is the sum of its ``inference_step`` calls."""
    from fairseq import utils

    logger.info("generate pipeline: continuous batching (a finished sentence's rows go to "
                "the next sentence; at most the largest batch's count in flight)")
    loading = [0.0]
    host_of = {}
    has_target = [True]

    def inputs():
        it = iter(progress)
        while True:
            t0 = time.perf_counter()
            try:
                host_sample = next(it)
            except StopIteration:
                return
            finally:
                loading[0] += time.perf_counter() - t0
            sample = utils.move_to_cuda(host_sample) if use_cuda else host_sample
            if "net_input" not in sample:
                continue
            if host_sample["id"].numel():
                has_target[0] = host_sample["target"] is not None
            host_of[id(sample)] = host_sample
            yield sample, job.prefix(sample)

    num_sentences = 0
    out = engine.run(inputs())
    while True:
        t0, l0 = time.perf_counter(), loading[0]
        try:
            sample, hypos = next(out)
        except StopIteration:
            break
        seconds = time.perf_counter() - t0 - (loading[0] - l0)
        n = sample["nsentences"] if "nsentences" in sample else sample["id"].numel()
        tokens = sum(len(h[0]["tokens"]) for h in hypos)
        meters.gen_timer.sum += seconds
        meters.add(*DecodeStats(tokens, seconds, n))
        pool.submit(job.pack(host_of.pop(id(sample)), hypos))
        meters.log(progress)
        num_sentences += n
    return num_sentences, has_target[0]
