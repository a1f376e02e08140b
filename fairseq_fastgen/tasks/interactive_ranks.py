"""``fairseq-interactive --input FILE`` over torchrun's ranks: each rank translates its
share of the input's buffers, rank 0 writes them in input order.

    torchrun --nproc-per-node N $(command -v fairseq-interactive) DATA --path M \\
        --input FILE --buffer-size 256 --batch-size 32 ... --user-dir fairseq_fastgen

Stock fairseq-interactive under torchrun translates the whole input on every rank (N
copies of the output).  Here every rank reads the same file in the same buffers of
``--buffer-size`` lines (stock's reader, patched to name undecodable lines), so every rank
knows each buffer's first sentence id; buffer i is translated by rank ``i mod N`` with
stock's per-buffer code (interactive_buffers.py, the lines stock prints, ``W-`` times
included).  Every :data:`WINDOW` rounds of N buffers the ranks hand their texts to rank 0
(one ``gather_object``), which writes them in buffer order: memory holds at most a window
of text, however long the file.  Lossless against one process (a rank decodes a buffer as
one process does, with its share of the cores); standard input is refused (each rank would
read its own lines).

In one process (no torchrun), interactive_workers.choose_main picks the loop.
"""
import logging
import sys
import time
from argparse import Namespace
from typing import List, Optional

import torch

from . import ranks as ranks_mod
from .interactive_buffers import buffer_text, check, setup
from .pool import cores

logger = logging.getLogger("fairseq_cli.interactive")

WINDOW = 8  # rounds of N buffers per exchange


class InteractiveInputError(SystemExit):
    def __init__(self, message: str):
        super().__init__(f"fairseq-interactive: error: {message}")


def main(cfg, stock, ranks: ranks_mod.Ranks) -> None:
    """stock's ``fairseq_cli.interactive.main`` (``stock``: that module) on ``ranks``."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    if isinstance(cfg, Namespace):
        cfg = convert_namespace_to_omegaconf(cfg)
    start_time = time.time()
    check(cfg)
    _refuse_under_torchrun(cfg)
    use_cuda = torch.cuda.is_available() and not cfg.common.cpu
    group = ranks_mod.join(ranks, use_cuda)
    torch.set_num_threads(ranks_mod.threads_per_rank(ranks, cores()))
    if not ranks.leader:
        ranks_mod.quiet_logging()
    s = setup(cfg, stock, use_cuda)
    logger.info("torchrun: rank %d of %d, %d torch thread(s); buffer i translated by rank "
                "i mod %d", ranks.rank, ranks.world, torch.get_num_threads(), ranks.world)
    logger.info("NOTE: hypothesis and token scores are output in base 2")
    mine: List[Optional[str]] = []  # one entry per round: this rank's buffer text or None
    translate_time = 0.0
    start_id = n = 0
    for n, inputs in enumerate(stock.buffered_read(cfg.interactive.input,
                                                   cfg.interactive.buffer_size), 1):
        if (n - 1) % ranks.world == ranks.rank:
            text, seconds = buffer_text(s, cfg, inputs, start_id)
            mine.append(text)
            translate_time += seconds
        start_id += len(inputs)
        if n % (ranks.world * WINDOW) == 0:
            mine = _exchange(mine, ranks, group)
    if n % ranks.world and n % ranks.world <= ranks.rank:
        mine.append(None)  # the last round had no buffer for this rank
    _exchange(mine, ranks, group)
    _closing_lines(ranks, group, start_time, translate_time, n)
    ranks_mod.leave(group)


def _refuse_under_torchrun(cfg) -> None:
    if cfg.interactive.input in ("-", "", None):
        raise InteractiveInputError(
            "under torchrun every rank reads the input: give it as --input FILE (standard "
            "input cannot be shared between ranks)")
    if cfg.generation.sampling:
        raise InteractiveInputError(
            "--sampling under torchrun: each rank would draw from its own random stream; "
            "run fairseq-interactive --sampling in one process")


def _exchange(mine: List[Optional[str]], ranks: ranks_mod.Ranks, group) -> List[Optional[str]]:
    """Every rank's texts of the window written by rank 0 in buffer order.  Collective.
    Returns the emptied list."""
    ordered = ranks_mod.gather_ordered(mine, ranks, group)
    if ranks.leader:
        sys.stdout.write("".join(ordered))
        sys.stdout.flush()
    return []


def _closing_lines(ranks, group, start_time: float, translate_time: float, buffers: int) -> None:
    import torch.distributed as dist

    from .. import drops

    every = [None] * ranks.world if ranks.leader else None
    dist.gather_object((translate_time, drops.share()), every, dst=0, group=group)
    if ranks.leader:
        times = [t for t, _ in every]
        drops.merge(d for _, d in every)  # the skipped lines of every rank in one summary
        for r, t in enumerate(times):
            logger.info("rank %d: %d buffer(s), %.3fs translating", r,
                        len(range(r, buffers, ranks.world)), t)
        logger.info("Total time: {:.3f} seconds; translation time: {:.3f}".format(
            time.time() - start_time, sum(times)))
