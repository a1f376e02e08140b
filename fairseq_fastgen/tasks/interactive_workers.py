"""``fairseq-interactive --input FILE`` in one CPU process: buffers decoded side by side
by forked decoding workers, written in input order.

As in ``fairseq-generate`` (decode_workers.py), N workers of ``threads / N`` torch threads
each use the cores better than one decoder of all of them.  Each worker reads the file in
stock's buffers (so it knows every buffer's first sentence id) and translates buffers
``i mod N == w`` with stock's per-buffer code (interactive_buffers.buffer_text); the main
process writes buffer 0, 1, 2, ... taking each from its worker's queue.  A queue holds at
most :data:`QUEUED` buffers, so a worker that runs ahead waits: memory stays flat however
long the file.  Lossless against one process (a worker decodes a buffer as one process
does, with its share of the cores).

Not used (fairseq's loop, one log line) for standard input (lines are answered as they
are typed), and where generate's decoding workers are not (GPU, bitwise mode, sampling on
one random stream, one torch thread, ``--fastgen-decode-workers 1``).  Workers die with
the main process (lifecycle.py); a worker that raises or dies stops the run with an error
naming it; a line that is not UTF-8 stops it with stock's message, after the lines before
it were written.  The inputs a worker skips as too long (drops.py) go into the main
process's closing summary with its end message.
"""
import functools
import logging
import multiprocessing as mp
import os
import sys
import time
from argparse import Namespace
from typing import List, Optional, Tuple

import torch

from .. import drops
from . import decode_workers, interactive_buffers, interactive_ranks, lifecycle, ranks as ranks_mod
from . import workers as workers_mod
from .interactive_buffers import buffer_text, check, setup
from .workers import PipelineWorkerError

logger = logging.getLogger("fairseq_cli.interactive")

QUEUED = 4  # buffers of text a worker may hold ahead of the writer


def choose_main(main, stock, cfg, fastgen):
    """fairseq-interactive's loop (``main``, of module ``stock``): over torchrun's ranks,
    in decoding workers, or stock's own."""
    if not fastgen.enabled:
        return main
    ranks = ranks_mod.from_env()
    if ranks is not None:  # torchrun: the buffers shared out between the ranks
        return functools.partial(interactive_ranks.main, stock=stock, ranks=ranks)
    workers, why_not = plan(cfg, fastgen)
    if workers:
        return functools.partial(run, stock=stock, workers=workers)
    if cfg.interactive.input not in ("-", "", None) and interactive_buffers.wants_engine(
            cfg, fastgen):
        return functools.partial(interactive_buffers.one_process, stock=stock)
    if fastgen.log_fallbacks and fastgen.decode_workers != 1:
        logging.getLogger("fairseq_fastgen").info(
            "fairseq-interactive: fairseq's loop, decoding in the main process (%s)", why_not)
    return main


def plan(cfg, fastgen) -> Tuple[int, Optional[str]]:
    """(decoding workers, None), or (0, why fairseq's loop runs)."""
    if cfg.interactive.input in ("-", "", None):
        return 0, "standard input: each line is answered as it comes"
    use_cuda = torch.cuda.is_available() and not cfg.common.cpu
    return decode_workers.planned_workers(cfg, fastgen, use_cuda)


def run(cfg, stock, workers: int) -> None:
    """stock's ``fairseq_cli.interactive.main`` (``stock``: that module), decoded by
    ``workers`` forked processes."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    if isinstance(cfg, Namespace):
        cfg = convert_namespace_to_omegaconf(cfg)
    start_time = time.time()
    check(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP team before the fork (decode_workers.py)
    s = setup(cfg, stock, use_cuda=False)
    logger.info("NOTE: hypothesis and token scores are output in base 2")
    per = max(1, threads // workers)
    ctx = mp.get_context("fork")
    queues = [ctx.Queue(maxsize=QUEUED) for _ in range(workers)]
    logger.info("fairseq-interactive: %d decoding worker(s) x %d torch thread(s); buffer i "
                "translated by worker i mod %d", workers, per, workers)
    procs = []
    with lifecycle.StopOnSignals():
        try:
            for w in range(workers):
                procs.append(workers_mod.start(_work, f"fastgen-dec-{w}",
                                               (s, cfg, w, workers, queues[w], os.getpid(), per)))
            seconds = _write_in_order(queues, procs)
        finally:
            workers_mod.stop(procs)
    torch.set_num_threads(threads)
    logger.info("Total time: {:.3f} seconds; translation time: {:.3f}".format(
        time.time() - start_time, seconds))


def _work(s, cfg, w: int, n: int, out, parent_pid: int, threads: int) -> None:
    workers_mod.enter(parent_pid, threads)
    i = start_id = 0  # i: the buffer being read (at the end: how many there were)
    try:
        for inputs in s.stock.buffered_read(cfg.interactive.input, cfg.interactive.buffer_size):
            if i % n == w:
                out.put(("text", i) + buffer_text(s, cfg, inputs, start_id))
            start_id += len(inputs)
            i += 1
        out.put(("end", i, drops.share(), 0.0))
    except SystemExit as e:  # stock's usage-style errors (an undecodable line)
        out.put(("exit", i, str(e.code), 0.0))
    except BaseException:  # noqa: BLE001 - reported by the main process
        out.put(("error", i, workers_mod.failure(), 0.0))
    out.close()
    out.join_thread()


def _write_in_order(queues, procs: List) -> float:
    """Buffer 0, 1, 2, ... from worker i mod N's queue, to stdout; the workers' summed
    translation time."""
    total = 0.0
    i = 0
    while True:
        w = i % len(queues)
        kind, at, payload, seconds = _checked(_next(queues[w], procs[w]))
        if kind == "end":  # every worker's next message is its end: their skipped lines
            shares = [payload] + [_checked(_next(q, p))[2]
                                  for q, p in zip(queues, procs) if q is not queues[w]]
            drops.merge(shares)
            return total
        assert at == i, (at, i)
        sys.stdout.write(payload)
        sys.stdout.flush()
        total += seconds
        i += 1


def _checked(msg):
    """``msg`` unless it reports a worker's error (raised here)."""
    kind, at, payload, _ = msg
    if kind == "exit":
        raise SystemExit(payload)
    if kind == "error":
        raise PipelineWorkerError(f"fairseq-fastgen interactive: decoding worker raised at "
                                  f"buffer {at}: {payload}")
    return msg


def _next(q, proc):
    """The next message of ``proc``; an error as soon as it is dead without one."""
    return workers_mod.receive(q, [proc], "interactive")
