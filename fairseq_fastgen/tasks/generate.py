"""Asynchronous ``fairseq-generate``: decode in the main process (or in decoding workers),
turn hypotheses into text in worker processes, write in batch order.  The output is
byte-identical to fairseq's own loop (``fairseq_cli/generate.py``) run with the same
generator.

This module is the entry (:func:`make_main`, installed over ``fairseq_cli.generate.main``
by install.py) and the dispatch: fairseq's own loop or the pipeline, and whether batches
are decoded here or in decoding workers.  How one batch flows:

1. it is decoded (``task.inference_step``, timed as stock times it), here or in a
   decoding worker (decode_workers.py);
2. what the text needs of the hypotheses is packed into ONE tensor and copied to the
   host once (text.py, ``pack_batch``), into a picklable record (records.py);
3. the record goes to a worker through a bounded queue (pool.py), where stock's
   per-sentence code makes the S/T/H/D/P/A/I/E text and the scorer's strings (text.py);
4. the main process, while the next batches decode, writes the results strictly in batch
   order and feeds the scorer in that order as stock does (writer.py).

SIGTERM and SIGINT stop a pipelined run cleanly: workers ended, whole lines written, exit
status 143 / 130; a worker ends with the main process however it ends (lifecycle.py).

Setup and closing lines are stock's (stock_main.py); the progress meters are meters.py,
the loops that feed the pool feed.py.  Option combinations the pipeline does not serve
(``--replace-unk``, no ``fork`` start method) and ``--fastgen-disable pipeline`` /
``--fastgen-off`` run fairseq's own loop after one log line that says why.
"""
import functools
import logging
import os
import sys
from argparse import Namespace
from typing import Optional

import torch

from .. import run_config
from . import decode_workers, feed, lifecycle, ranks as ranks_mod, sampling_seed, stock_main
from .meters import Meters
from .pool import Fault, Pool, cores, default_workers
from .text import WorkerState, pack_batch
from .writer import Writer

logger = logging.getLogger("fairseq_fastgen.generate")

# Planted-fault switch for the tests: "raise" makes a worker raise on its first batch,
# "exit" makes it die without a word (os._exit(3)).
FAULT_ENV = "FAIRSEQ_FASTGEN_PIPELINE_FAULT"


# ---- entry points ------------------------------------------------------------------

def make_main(stock_generate):
    """The replacement for ``fairseq_cli.generate.main`` (installed by install.py)."""

    def main(cfg):
        return pipelined_main(cfg, stock_generate)

    main.__wrapped__ = stock_generate.main
    main.__doc__ = "fairseq_cli.generate.main with fairseq-fastgen's asynchronous pipeline."
    return main


def pipelined_main(cfg, stock_generate=None):
    """``fairseq_cli.generate.main``'s contract: same asserts, same output file handling."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    if stock_generate is None:
        from fairseq_cli import generate as stock_generate
    # The one resolution of this entry point: the flags a Namespace carries are read
    # before it becomes an OmegaConf config, which has no place for them.
    with run_config.run(run_config.resolve(cfg), generation=True) as fastgen:
        if isinstance(cfg, Namespace):
            cfg = convert_namespace_to_omegaconf(cfg)
        return _checked_main(cfg, stock_generate, fastgen, ranks_mod.from_env())


def _checked_main(cfg, stock_generate, fastgen, ranks=None):
    assert cfg.common_eval.path is not None, "--path required for generation!"
    assert (
        not cfg.generation.sampling or cfg.generation.nbest == cfg.generation.beam
    ), "--sampling requires --nbest to be equal to --beam"
    assert (
        cfg.generation.replace_unk is None or cfg.dataset.dataset_impl == "raw"
    ), "--replace-unk requires a raw text dataset (--dataset-impl=raw)"

    if ranks is not None and fallback_reason(cfg, fastgen) is None and not ranks.leader:
        ranks_mod.quiet_logging()  # rank 0 writes the output, the log and the scores
        with open(os.devnull, "w", encoding="utf-8") as h:
            return _dispatch(cfg, h, stock_generate, fastgen, ranks)
    if cfg.common_eval.results_path is not None:
        os.makedirs(cfg.common_eval.results_path, exist_ok=True)
        output_path = os.path.join(
            cfg.common_eval.results_path,
            "generate-{}.txt".format(cfg.dataset.gen_subset),
        )
        with open(output_path, "w", buffering=1, encoding="utf-8") as h:
            return _dispatch(cfg, h, stock_generate, fastgen, ranks)
    return _dispatch(cfg, sys.stdout, stock_generate, fastgen, ranks)


def cli_main():
    """``fastgen-generate``: ``fairseq-generate`` with the plugin loaded (importing this
    module imported the package, whose ``__init__`` ran ``install()``)."""
    from fairseq_cli import generate

    generate.cli_main()


# ---- dispatch ----------------------------------------------------------------------

def planted_fault(kind: Optional[str]) -> Fault:
    """The test hook's fault for ``kind`` ("raise", "exit"; None: no fault)."""
    if kind == "raise":
        def fault():
            raise RuntimeError(f"planted fault ({FAULT_ENV}=raise)")
    elif kind == "exit":
        def fault():
            os._exit(3)
    else:
        return None
    return fault


def planted_fault_from_env() -> Fault:
    """Test hook: the fault that ``FAULT_ENV`` plants in every worker (None unset).

    The one place that reads it, so that a test can plant a fault in a CLI run in a
    subprocess; the workers are handed the result."""
    return planted_fault(os.environ.get(FAULT_ENV))


def fallback_reason(cfg, fastgen) -> Optional[str]:
    """Why this run takes fairseq's own loop, or None when the pipeline serves it."""
    import multiprocessing as mp

    if not fastgen.enabled:
        return "fairseq-fastgen is switched off (--fastgen-off)"
    if not fastgen.pipeline:
        return "switched off (--fastgen-disable pipeline)"
    if cfg.generation.replace_unk is not None:
        return "--replace-unk reads the raw dataset text per sentence"
    if "fork" not in mp.get_all_start_methods():
        return "no 'fork' start method for worker processes on this platform"
    return None


def _configure_logging(output_file):
    # exactly stock _main's call (a no-op when logging is already configured)
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
        stream=output_file,
    )


def _dispatch(cfg, output_file, stock_generate, fastgen, ranks=None):
    _configure_logging(output_file)
    reason = fallback_reason(cfg, fastgen)
    if reason is not None:
        if ranks is not None:  # always said: the output is then N copies, as stock's
            logger.warning("generate pipeline off (%s) under torchrun: every rank runs "
                           "fairseq's generate loop on its own", reason)
        if fastgen.resume_dir:
            logger.warning("generate pipeline off (%s): --fastgen-resume-dir is not used",
                           reason)
        elif fastgen.log_fallbacks:
            logger.info("generate pipeline off: %s; running fairseq's generate loop", reason)
        return stock_generate._main(cfg, output_file)
    return run_pipeline(cfg, output_file, fastgen, fault=planted_fault_from_env(), ranks=ranks)


# ---- the pipelined run -------------------------------------------------------------

def run_pipeline(cfg, output_file, fastgen, fault: Fault = None, ranks=None):
    """Stock's ``_main`` with its loop replaced by the pipeline; returns the scorer.

    ``fault`` (tests only) runs in every worker before each batch; ``ranks``: torchrun's
    (ranks.py), each decoding its share, rank 0 writing."""
    from fairseq.logging.meters import StopwatchMeter

    stock_main.prepare(cfg)
    use_cuda = torch.cuda.is_available() and not cfg.common.cpu
    group = None
    if ranks is not None:
        group = ranks_mod.join(ranks, use_cuda)
        ranks_mod.shard(cfg, ranks)
        torch.set_num_threads(ranks_mod.threads_per_rank(ranks, cores(), fastgen.bitwise))
        logger.info("torchrun: rank %d of %d; %d rank(s) on this machine of %d core(s): %d "
                    "torch thread(s) each", ranks.rank, ranks.world, ranks.local_world,
                    cores(), torch.get_num_threads())
    threads = torch.get_num_threads()
    seed_base = sampling_seed.batch_seed_base(cfg, fastgen)
    n_decoders, why_not = decode_workers.planned_workers(cfg, fastgen, use_cuda,
                                                         batch_seeded=seed_base is not None)
    if n_decoders:
        torch.set_num_threads(1)  # until the workers are forked (see decode_workers)
    run = stock_main.load(cfg, use_cuda)
    if n_decoders:
        n_decoders, why_not = decode_workers.fit_to_batches(n_decoders, len(run.epoch_itr))
    state = _worker_state(cfg, run)
    meters = Meters(StopwatchMeter())
    job = decode_workers.DecodeJob(
        run.task, run.generator, run.models, cfg.generation.prefix_size,
        pack=functools.partial(pack_batch, nbest=cfg.generation.nbest,
                               quiet=cfg.common_eval.quiet, state=state),
        seed_base=seed_base)
    # From the first worker on, SIGTERM and SIGINT stop the run cleanly (lifecycle.py).
    with lifecycle.StopOnSignals() as stop:
        writer = Writer(output_file, run.scorer, run.tgt_dict, cfg.common_eval.post_process,
                        critical=stop.deferred)
        exchange = _exchange(cfg, fastgen, ranks, group, writer)
        pool = None
        try:
            pool = _make_pool(state, job, exchange or writer, meters, fastgen, n_decoders,
                              why_not, threads, use_cuda, fault)
            torch.set_num_threads(threads)
            num_sentences, has_target = _run_batches(cfg, run.epoch_itr, pool, job, meters,
                                                     n_decoders, use_cuda, exchange, group)
        except BaseException as e:  # error, worker failure, a signal: end the workers now
            if pool is not None:
                pool.close(abort=True)
            if isinstance(e, lifecycle.StopSignal):
                _log_stop(e, pool, output_file)
            raise
        pool.close()
        if ranks is not None and not ranks.leader:
            return run.scorer  # rank 0 has this rank's lines and scores
        stock_main.log_summary(cfg, num_sentences, meters.gen_timer, has_target, run.scorer,
                               output_file)
    return run.scorer


def _exchange(cfg, fastgen, ranks, group, writer):
    """The rank exchange (ranks.py), also in one process for --fastgen-resume-dir; None
    when neither is asked for."""
    if ranks is None and not fastgen.resume_dir:
        return None
    ranks = ranks or ranks_mod.Ranks(0, 1, 0, 1)
    resume = None
    if fastgen.resume_dir and ranks.leader:
        from . import resume as resume_mod

        resume = resume_mod.ResumeDir(fastgen.resume_dir, resume_mod.fingerprint(
            cfg, fastgen, ranks.world, ranks_mod.WINDOW))
    return ranks_mod.Exchange(ranks, group, writer, resume)


def _make_pool(state, job, writer, meters, fastgen, n_decoders: int, why_not, threads: int,
               use_cuda: bool, fault: Fault) -> Pool:
    # Workers are forked before the data iterator starts its threads/processes.
    if n_decoders:
        return _decoding_pool(state, job, writer, meters, n_decoders, threads, fault)
    if why_not is not None and fastgen.decode_workers != 1 and fastgen.log_fallbacks:
        logger.info("generate pipeline: batches decoded in the main process (%s)", why_not)
    n_workers = fastgen.pipeline_workers or default_workers(use_cuda)
    pool = Pool(state, n_workers, writer.write, use_cuda=use_cuda, fault=fault)
    logger.info("generate pipeline: %d postprocessing worker(s)", n_workers)
    return pool


def _log_stop(stop: lifecycle.StopSignal, pool: Optional[Pool], output_file) -> None:
    """The one line a stopped run ends with; what it wrote is flushed, in whole lines."""
    output_file.flush()
    written, sent = (pool.written, pool.submitted) if pool is not None else (0, 0)
    logger.warning("generate pipeline: stopped by %s; workers ended; %d of the %d batch(es) "
                   "sent were written, every line complete; exit status %d",
                   stop.signal_name, written, sent, stop.code)


def _worker_state(cfg, run: stock_main.Loaded) -> WorkerState:
    return WorkerState(
        src_dict=run.src_dict, tgt_dict=run.tgt_dict, tokenizer=run.tokenizer, bpe=run.bpe,
        post_process=cfg.common_eval.post_process, quiet=cfg.common_eval.quiet,
        print_alignment=cfg.generation.print_alignment,
        print_step=cfg.generation.print_step,
        retain_iter_history=cfg.generation.retain_iter_history,
        strip=stock_main.get_symbols_to_strip_from_output(run.generator),
    )


def _decoding_pool(state, job, writer, meters, n_decoders: int, threads: int,
                   fault: Fault) -> Pool:
    """Decoding workers, each with its share of the torch threads, each writing the text
    of its batches; the writer and the meters get their results in batch order."""
    per_worker = decode_workers.threads_per_worker(n_decoders, threads)
    if hasattr(job.generator, "prepare"):  # weight copies made once, shared by the workers
        job.generator.prepare()

    def on_result(text, scoring, stats):
        writer.write(text, scoring)
        meters.add(*stats)

    engine = job.continuous()
    pool = Pool(state, n_decoders, on_result, job=job, threads=per_worker, fault=fault,
                engine=engine)
    logger.info("generate pipeline: %d decoding worker(s) x %d torch thread(s), each "
                "also postprocessing its batches%s", n_decoders, per_worker,
                ", each decoding its batches as one stream (continuous batching)"
                if engine is not None else "")
    return pool


def _run_batches(cfg, epoch_itr, pool, job, meters, n_decoders: int, use_cuda: bool,
                 exchange=None, group=None):
    """Every batch of the epoch (of this rank's share, with ``exchange``) through the pool,
    every result written.  Returns (sentences, has_target), over all ranks on rank 0."""
    progress = stock_main.progress(cfg, epoch_itr)
    share = None
    replayed = (0, 0, 0, False)
    if exchange is not None:  # one record per batch, in batch order: no tail split
        replayed = exchange.replay()
        share = progress = ranks_mod.Share(progress, pool, exchange, skip_windows=replayed[0])
    if n_decoders:
        counts = feed.feed_decoders(progress, pool, meters, len(epoch_itr), n_decoders,
                                    split_tail=share is None and job.seed_base is None)
    else:
        counts = feed.decode_here(progress, pool, job, meters, use_cuda)
    pool.finish()
    if n_decoders:
        gen_timer = meters.gen_timer
        gen_timer.stop(0)  # wall time from the first batch sent to the last one written
        logger.info("decoding workers: %.1fs of decoding in %.1fs (%.0f%% of %d workers)",
                    meters.busy, gen_timer.sum,
                    100 * meters.busy / max(gen_timer.sum, 1e-9) / n_decoders, n_decoders)
    if share is not None:
        share.finish()
        sentences, tokens, seconds, has_target = ranks_mod.totals(
            exchange.ranks, group, counts[0], meters.gen_timer.n, meters.gen_timer.sum,
            counts[1], exchange, share.batches)
        if exchange.ranks.world > 1:
            ranks_mod.leave(group)
        # (a run whose every batch was replayed decoded for no time: not a division by 0)
        meters.gen_timer.n, meters.gen_timer.sum = tokens + replayed[2], max(seconds, 1e-6)
        counts = (sentences + replayed[1], has_target or replayed[3])
    return counts
