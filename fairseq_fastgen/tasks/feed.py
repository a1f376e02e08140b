"""The generate pipeline's feed loops: every batch of the epoch into the worker pool.

Either the main process decodes each batch and the pool writes its text
(:func:`decode_here`), or each batch goes to a decoding worker whole, the last ones cut
into one part per worker (:func:`feed_decoders`, see decode_workers).  Both return
``(sentences, has_target)`` as stock's loop counts them.
"""
from typing import Tuple

from . import decode_workers


def decode_here(progress, pool, job, meters, use_cuda: bool) -> Tuple[int, bool]:
    """Decode every batch in this process, text in the pool."""
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


def feed_decoders(progress, pool, meters, n_batches: int, n_workers: int) -> Tuple[int, bool]:
    """Send every batch to the decoding workers, the last ``n_workers`` cut into one part
    per worker."""
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
        parts = n_workers if i >= n_batches - n_workers else 1
        for sub in decode_workers.split_sample(host_sample, parts):
            pool.submit_sample(sub)
        meters.log(progress)
        num_sentences += (host_sample["nsentences"] if "nsentences" in host_sample
                          else host_sample["id"].numel())
    if gen_timer.start_time is None:  # no batch at all
        gen_timer.start()
    return num_sentences, has_target
