"""Asynchronous ``fairseq-generate``: decode in the main process, turn hypotheses into text
in worker processes, write in batch order.  The output is byte-identical to fairseq's own
loop (``fairseq_cli/generate.py``) run with the same generator.

How one batch flows:

1. the main process decodes batch ``k`` (``task.inference_step``, timed as stock times it);
2. it packs what the text needs from the hypotheses (tokens, ``score / ln 2`` and
   ``positional_scores / ln 2``, computed on the device with the same tensor operation and
   dtype as stock) into ONE tensor and copies it to the host once (``.cpu()``);
3. a picklable record (ids, padded source/target rows from the host copy of the sample,
   the packed numbers, alignments if printed) goes to a pool of worker processes through a
   bounded queue;
4. a worker runs stock's per-sentence code on it (``Dictionary.string`` as
   ``utils.post_process_prediction`` calls it, the task's BPE and tokenizer ``decode``,
   the same format strings) and returns the S/T/H/D/P/A/I/E text of the batch and the
   strings the scorer needs; fairseq's own ``Dictionary`` gets lists of ints instead of
   tensors (same strings, ~30x faster);
5. the main process, while the next batches decode, writes results strictly in batch
   order and feeds the scorer in that order, with the same ``tgt_dict.encode_line(...,
   add_if_not_exist=True)`` calls stock makes (so the dictionary evolves as in stock and
   the BLEU line is identical).

At most ``2 * workers + 2`` batches are in flight (memory stays flat on any input size).
A worker that raises or dies stops the run with an error naming it (non-zero exit, no
hang); Ctrl-C terminates the workers.  Option combinations this loop does not serve
(``--replace-unk``, no ``fork`` start method) and ``--fastgen-no-pipeline`` /
``--fastgen-off`` run fairseq's own loop after one log line that says why.
"""
import ast
import logging
import math
import os
import pickle
import queue
import signal
import sys
import traceback
from argparse import Namespace
from itertools import chain
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from . import decode_workers

logger = logging.getLogger("fairseq_fastgen.generate")

# Planted-fault switch for the tests: "raise" makes a worker raise on its first batch,
# "exit" makes it die without a word (os._exit(3)).
FAULT_ENV = "FAIRSEQ_FASTGEN_PIPELINE_FAULT"

_LN2 = math.log(2)
WORKER_NICE = 10  # niceness increment of workers when decoding uses every core


# ---- worker count ------------------------------------------------------------------

def default_workers(use_cuda: bool = False) -> int:
    """Postprocessing workers when ``--fastgen-pipeline-workers`` is 0 (auto).

    The cores that decoding does not use (on CPU: ``torch.get_num_threads()`` of them;
    on a GPU: one for the driving thread), at least 1 and at most 4: one worker keeps up
    with decoding in all but the lightest setups, and on a 2-core machine a single worker
    is what does not take cores away from the decoder.
    """
    busy = 1 if use_cuda else torch.get_num_threads()
    return max(1, min(4, _cores() - busy))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


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
    if isinstance(cfg, Namespace):
        cfg = convert_namespace_to_omegaconf(cfg)

    assert cfg.common_eval.path is not None, "--path required for generation!"
    assert (
        not cfg.generation.sampling or cfg.generation.nbest == cfg.generation.beam
    ), "--sampling requires --nbest to be equal to --beam"
    assert (
        cfg.generation.replace_unk is None or cfg.dataset.dataset_impl == "raw"
    ), "--replace-unk requires a raw text dataset (--dataset-impl=raw)"

    if cfg.common_eval.results_path is not None:
        os.makedirs(cfg.common_eval.results_path, exist_ok=True)
        output_path = os.path.join(
            cfg.common_eval.results_path,
            "generate-{}.txt".format(cfg.dataset.gen_subset),
        )
        with open(output_path, "w", buffering=1, encoding="utf-8") as h:
            return _dispatch(cfg, h, stock_generate)
    return _dispatch(cfg, sys.stdout, stock_generate)


def cli_main():
    """``fastgen-generate``: ``fairseq-generate`` with the plugin loaded."""
    import fairseq_fastgen  # noqa: F401  (install())
    from fairseq_cli import generate

    generate.cli_main()


def _configure_logging(output_file):
    # exactly stock _main's call (a no-op when logging is already configured)
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
        stream=output_file,
    )


def fallback_reason(cfg, fastgen) -> Optional[str]:
    """Why this run takes fairseq's own loop, or None when the pipeline serves it."""
    import multiprocessing as mp

    if not fastgen.enabled:
        return "fairseq-fastgen is switched off (--fastgen-off)"
    if not fastgen.pipeline:
        return "switched off (--fastgen-no-pipeline)"
    if cfg.generation.replace_unk is not None:
        return "--replace-unk reads the raw dataset text per sentence"
    if "fork" not in mp.get_all_start_methods():
        return "no 'fork' start method for worker processes on this platform"
    return None


def _dispatch(cfg, output_file, stock_generate):
    from .. import config as fg_config

    _configure_logging(output_file)
    fastgen = fg_config.from_hydra(cfg) or fg_config.active()
    reason = fallback_reason(cfg, fastgen)
    if reason is not None:
        if fastgen.log_fallbacks:
            logger.info("generate pipeline off: %s; running fairseq's generate loop", reason)
        return stock_generate._main(cfg, output_file)
    return _main(cfg, output_file, fastgen)


def get_symbols_to_strip_from_output(generator):
    if hasattr(generator, "symbols_to_strip_from_output"):
        return generator.symbols_to_strip_from_output
    return {generator.eos}


# ---- the pipelined loop (setup mirrors fairseq_cli/generate.py::_main) ---------------

def _main(cfg, output_file, fastgen):
    from fairseq import checkpoint_utils, scoring, tasks, utils
    from fairseq.logging import progress_bar
    from fairseq.logging.meters import StopwatchMeter

    log = logging.getLogger("fairseq_cli.generate")  # stock's logger name: same log lines

    utils.import_user_module(cfg.common)

    if cfg.dataset.max_tokens is None and cfg.dataset.batch_size is None:
        cfg.dataset.max_tokens = 12000
    log.info(cfg)

    if cfg.common.seed is not None and not cfg.generation.no_seed_provided:
        np.random.seed(cfg.common.seed)
        utils.set_torch_seed(cfg.common.seed)

    use_cuda = torch.cuda.is_available() and not cfg.common.cpu
    threads = torch.get_num_threads()
    n_decoders, why_not = decode_workers.planned_workers(cfg, fastgen, use_cuda)
    if n_decoders:
        torch.set_num_threads(1)  # until the workers are forked (see decode_workers)

    task = tasks.setup_task(cfg.task)
    try:
        src_dict = getattr(task, "source_dictionary", None)
    except NotImplementedError:
        src_dict = None
    tgt_dict = task.target_dictionary

    overrides = ast.literal_eval(cfg.common_eval.model_overrides)

    log.info("loading model(s) from {}".format(cfg.common_eval.path))
    models, saved_cfg = checkpoint_utils.load_model_ensemble(
        utils.split_paths(cfg.common_eval.path),
        arg_overrides=overrides,
        task=task,
        suffix=cfg.checkpoint.checkpoint_suffix,
        strict=(cfg.checkpoint.checkpoint_shard_count == 1),
        num_shards=cfg.checkpoint.checkpoint_shard_count,
    )
    task.load_dataset(cfg.dataset.gen_subset, task_cfg=saved_cfg.task)

    if cfg.generation.lm_path is not None:
        overrides["data"] = cfg.task.data
        try:
            lms, _ = checkpoint_utils.load_model_ensemble(
                [cfg.generation.lm_path], arg_overrides=overrides, task=None
            )
        except:  # noqa: E722  (as stock)
            log.warning(
                f"Failed to load language model! Please make sure that the language model dict is the same "
                f"as target dict and is located in the data dir ({cfg.task.data})"
            )
            raise
        assert len(lms) == 1
    else:
        lms = [None]

    for model in chain(models, lms):
        if model is None:
            continue
        if cfg.common.fp16:
            model.half()
        if use_cuda and not cfg.distributed_training.pipeline_model_parallel:
            model.cuda()
        model.prepare_for_inference_(cfg)

    gen_timer = StopwatchMeter()
    extra_gen_cls_kwargs = {"lm_model": lms[0], "lm_weight": cfg.generation.lm_weight}
    generator = task.build_generator(
        models, cfg.generation, extra_gen_cls_kwargs=extra_gen_cls_kwargs
    )
    tokenizer = task.build_tokenizer(cfg.tokenizer)
    bpe = task.build_bpe(cfg.bpe)
    scorer = scoring.build_scorer(cfg.scoring, tgt_dict)

    state = _WorkerState(
        src_dict=src_dict, tgt_dict=tgt_dict, tokenizer=tokenizer, bpe=bpe,
        post_process=cfg.common_eval.post_process, quiet=cfg.common_eval.quiet,
        print_alignment=cfg.generation.print_alignment,
        print_step=cfg.generation.print_step,
        retain_iter_history=cfg.generation.retain_iter_history,
        strip=get_symbols_to_strip_from_output(generator),
    )
    writer = _Writer(output_file, scorer, tgt_dict, cfg.common_eval.post_process)
    epoch_itr = task.get_batch_iterator(
        dataset=task.dataset(cfg.dataset.gen_subset),
        max_tokens=cfg.dataset.max_tokens,
        max_sentences=cfg.dataset.batch_size,
        max_positions=utils.resolve_max_positions(
            task.max_positions(), *[m.max_positions() for m in models]
        ),
        ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
        required_batch_size_multiple=cfg.dataset.required_batch_size_multiple,
        seed=cfg.common.seed,
        num_shards=cfg.distributed_training.distributed_world_size,
        shard_id=cfg.distributed_training.distributed_rank,
        num_workers=cfg.dataset.num_workers,
        data_buffer_size=cfg.dataset.data_buffer_size,
    )
    nbest = cfg.generation.nbest
    quiet = cfg.common_eval.quiet
    if n_decoders:
        n_decoders, why_not = decode_workers.fit_to_batches(n_decoders, len(epoch_itr))
    meters = _Meters(gen_timer)
    job = decode_workers.DecodeJob(
        task, generator, models, cfg.generation.prefix_size,
        pack=lambda sample, hypos: _pack_batch(sample, hypos, nbest, quiet, state))
    # Workers are forked before the data iterator starts its threads/processes.
    if n_decoders:
        per_worker = decode_workers.threads_per_worker(n_decoders, threads)
        if hasattr(generator, "prepare"):  # weight copies made once, shared by the workers
            generator.prepare()

        def on_result(result, side, stats):
            writer.write(result, side)
            meters.add(*stats)

        pool = _Pool(state, n_decoders, on_result, job=job, threads=per_worker)
        logger.info("generate pipeline: %d decoding worker(s) x %d torch thread(s), each "
                    "also postprocessing its batches", n_decoders, per_worker)
    else:
        if why_not is not None and fastgen.decode_workers != 1 and fastgen.log_fallbacks:
            logger.info("generate pipeline: batches decoded in the main process (%s)", why_not)
        n_workers = fastgen.pipeline_workers or default_workers(use_cuda)
        pool = _Pool(state, n_workers, writer.write, use_cuda=use_cuda)
        logger.info("generate pipeline: %d postprocessing worker(s)", n_workers)
    torch.set_num_threads(threads)
    try:
        itr = epoch_itr.next_epoch_itr(shuffle=False)
        progress = progress_bar.progress_bar(
            itr,
            log_format=cfg.common.log_format,
            log_interval=cfg.common.log_interval,
            default_log_format=("tqdm" if not cfg.common.no_progress_bar else "simple"),
        )
        if n_decoders:
            num_sentences, has_target = _feed_decoders(progress, pool, meters, len(epoch_itr),
                                                       n_decoders)
        else:
            num_sentences, has_target = _decode_here(progress, pool, job, meters, use_cuda)
        pool.finish()
        if n_decoders:
            gen_timer.stop(0)  # wall time from the first batch sent to the last one written
            logger.info("decoding workers: %.1fs of decoding in %.1fs (%.0f%% of %d workers)",
                        meters.busy, gen_timer.sum,
                        100 * meters.busy / max(gen_timer.sum, 1e-9) / n_decoders, n_decoders)
    except BaseException:  # error, worker failure or Ctrl-C: end the workers now
        pool.close(abort=True)
        raise
    pool.close()

    log.info("NOTE: hypothesis and token scores are output in base 2")
    log.info(
        "Translated {:,} sentences ({:,} tokens) in {:.1f}s ({:.2f} sentences/s, {:.2f} tokens/s)".format(
            num_sentences,
            gen_timer.n,
            gen_timer.sum,
            num_sentences / gen_timer.sum,
            1.0 / gen_timer.avg,
        )
    )
    if has_target:
        if cfg.bpe and not cfg.generation.sacrebleu:
            if cfg.common_eval.post_process:
                log.warning(
                    "BLEU score is being computed by splitting detokenized string on spaces, this is probably not what you want. Use --sacrebleu for standard 13a BLEU tokenization"
                )
            else:
                log.warning(
                    "If you are using BPE on the target side, the BLEU score is computed on BPE tokens, not on proper words.  Use --sacrebleu for standard 13a BLEU tokenization"
                )
        print(
            "Generate {} with beam={}: {}".format(
                cfg.dataset.gen_subset, cfg.generation.beam, scorer.result_string()
            ),
            file=output_file,
        )
    return scorer


class _Meters:
    """Generation time and tokens (stock's ``gen_timer``) and the progress rates."""

    def __init__(self, gen_timer):
        from fairseq.logging.meters import TimeMeter

        self.gen_timer = gen_timer
        self.wps, self.sps = TimeMeter(), TimeMeter()
        self.busy = 0.0  # seconds spent decoding, summed over batches

    def add(self, tokens: int, seconds: float, sentences: int) -> None:
        self.gen_timer.n += tokens
        self.busy += seconds
        self.wps.update(tokens)
        self.sps.update(sentences)

    def log(self, progress) -> None:
        progress.log({"wps": round(self.wps.avg), "sentences/s": round(self.sps.avg, 2)})


def _decode_here(progress, pool, job, meters, use_cuda: bool):
    """Decode every batch in this process, text in the pool. Returns (sentences, has_target)."""
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


def _feed_decoders(progress, pool, meters, n_batches: int, n_workers: int):
    """Send every batch to the decoding workers, the last ``n_workers`` cut into one part
    per worker (see decode_workers). Returns (sentences, has_target)."""
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


# ---- main process: packing a decoded batch ----------------------------------------

def _is_packable_1d(t, kinds) -> bool:
    return torch.is_tensor(t) and t.dim() == 1 and (
        t.is_floating_point() if kinds == "float" else not t.is_floating_point())


def _pack_batch(host_sample, hypos, nbest: int, quiet: bool, state) -> Dict[str, Any]:
    """One picklable record per batch; ONE device-to-host copy of the packed numbers.

    Scores are divided by ln 2 exactly as stock does (``tensor / math.log(2)`` in the
    tensor's own dtype, on its device: the same elementwise kernel for a 0-d tensor and a
    vector); the quotient is widened to float64 (exact) only to share the copy with the
    tokens.  Hypotheses whose fields are not the usual tensors are formatted here, with
    stock's own expressions.
    """
    kept = [list(h[:nbest]) for h in hypos]
    flat = [h for hs in kept for h in hs]
    rec: Dict[str, Any] = {
        "ids": host_sample["id"].tolist(),
        "counts": [len(hs) for hs in kept],
    }
    net_input = host_sample["net_input"]
    rec["src"] = (net_input["src_tokens"].numpy()
                  if "src_tokens" in net_input and state.src_dict is not None else None)
    target = host_sample["target"]
    rec["tgt"] = target.numpy() if target is not None else None

    pieces: List[torch.Tensor] = []
    # tokens
    toks = [h["tokens"] for h in flat]
    if toks and all(_is_packable_1d(t, "int") for t in toks):
        rec["tok_lens"] = [t.numel() for t in toks]
        pieces.append(torch.cat(toks).double())
        rec["tok_odd"] = None
    else:
        rec["tok_lens"] = [0] * len(toks)
        rec["tok_odd"] = [t.int().cpu().numpy() for t in toks]
    rec["score_strs"] = rec["pos_strs"] = None
    rec["n_scores"] = 0
    rec["pos_lens"] = []
    if not quiet and flat:
        scores = [h["score"] for h in flat]
        if all(torch.is_tensor(s) and s.dim() == 0 and s.is_floating_point() for s in scores) \
                and len({s.dtype for s in scores}) == 1 and len({s.device for s in scores}) == 1:
            pieces.append((torch.stack(scores) / _LN2).double())
            rec["n_scores"] = len(scores)
        else:
            rec["score_strs"] = ["{}".format(s / _LN2) for s in scores]
        pos = [h["positional_scores"] for h in flat]
        if all(_is_packable_1d(p, "float") for p in pos) and len({p.dtype for p in pos}) == 1 \
                and len({p.device for p in pos}) == 1:
            rec["pos_lens"] = [p.numel() for p in pos]
            pieces.append((torch.cat(pos) / _LN2).double())
        else:
            rec["pos_strs"] = [" ".join(map(lambda x: "{:.4f}".format(x), p.div_(_LN2).tolist()))
                               for p in pos]
        if state.print_alignment:
            rec["alignment"] = [h["alignment"] for h in flat]
        if state.print_step:
            rec["steps"] = ["{}".format(h["steps"]) for h in flat]
        if state.retain_iter_history:
            rec["history"] = [[x["tokens"].int().cpu().numpy() for x in h["history"]] for h in flat]
    if pieces:
        devices = {p.device for p in pieces}
        if len(devices) > 1:
            pieces = [p.cpu() for p in pieces]
        rec["packed"] = torch.cat(pieces).cpu().numpy()  # the one device-to-host copy
    else:
        rec["packed"] = np.zeros(0)
    return rec


# ---- worker side: stock's per-sentence text code -----------------------------------

class _WorkerState:
    """What workers need; inherited through fork (never pickled)."""

    def __init__(self, src_dict, tgt_dict, tokenizer, bpe, post_process, quiet,
                 print_alignment, print_step, retain_iter_history, strip):
        from fairseq.data import Dictionary

        self.src_dict = src_dict
        self.tgt_dict = tgt_dict
        self.tokenizer = tokenizer
        self.bpe = bpe
        self.post_process = post_process
        self.quiet = quiet
        self.print_alignment = print_alignment
        self.print_step = print_step
        self.retain_iter_history = retain_iter_history
        self.strip = strip
        # fairseq's own Dictionary gives the same strings for a list of ints as for a
        # tensor, an order of magnitude faster; other dictionaries get tensors as in stock
        self.src_lists = type(src_dict) is Dictionary
        self.tgt_lists = type(tgt_dict) is Dictionary

    def decode_fn(self, x):
        if self.bpe is not None:
            x = self.bpe.decode(x)
        if self.tokenizer is not None:
            x = self.tokenizer.decode(x)
        return x


def _as_tokens(arr: np.ndarray, as_list: bool, to_int: bool):
    if as_list:
        return arr.tolist()
    t = torch.from_numpy(np.ascontiguousarray(arr))
    return t.int() if to_int else t


def process_batch(st: _WorkerState, rec: Dict[str, Any]):
    """The text of one batch (stock's per-sentence loop) and the scorer's strings."""
    from fairseq import utils

    out: List[str] = []
    score_items = []
    pad = st.tgt_dict.pad()
    packed = rec["packed"]
    tok_lens = rec["tok_lens"]
    n_tok = sum(tok_lens)
    tokens = packed[:n_tok].astype(np.int64)
    scores = packed[n_tok:n_tok + rec["n_scores"]].tolist()
    pos = packed[n_tok + rec["n_scores"]:]
    tok_off = pos_off = 0
    h = 0  # flat hypothesis index
    src, tgt = rec["src"], rec["tgt"]
    has_target = tgt is not None
    quiet = st.quiet
    for i, sample_id in enumerate(rec["ids"]):
        if src is not None:
            row = src[i, :]
            src_tokens = _as_tokens(row[row != pad], st.src_lists, to_int=False)
        else:
            src_tokens = None
        if has_target:
            row = tgt[i, :]
            target_tokens = _as_tokens(row[row != pad], st.tgt_lists, to_int=True)

        if st.src_dict is not None:
            src_str = st.src_dict.string(src_tokens, st.post_process)
        else:
            src_str = ""
        if has_target:
            target_str = st.tgt_dict.string(
                target_tokens, st.post_process, escape_unk=True,
                extra_symbols_to_ignore=st.strip)
        src_str = st.decode_fn(src_str)
        if has_target:
            target_str = st.decode_fn(target_str)

        if not quiet:
            if st.src_dict is not None:
                out.append("S-{}\t{}\n".format(sample_id, src_str))
            if has_target:
                out.append("T-{}\t{}\n".format(sample_id, target_str))

        hypo_strs = []
        detok0 = None
        for j in range(rec["counts"][i]):
            if rec["tok_odd"] is None:
                n = tok_lens[h]
                hypo_tokens = _as_tokens(tokens[tok_off:tok_off + n], st.tgt_lists, to_int=True)
                tok_off += n
            else:
                hypo_tokens = _as_tokens(rec["tok_odd"][h], st.tgt_lists, to_int=True)
            alignment = rec["alignment"][h] if "alignment" in rec else None
            # = utils.post_process_prediction(...)[1] with align_dict None (the pipeline's
            # case); its re-encoding of hypo_str (which may grow the dictionary) is replayed
            # by the writer in the main process, in stock's order.
            hypo_str = st.tgt_dict.string(
                hypo_tokens, st.post_process, extra_symbols_to_ignore=st.strip)
            detok_hypo_str = st.decode_fn(hypo_str)
            hypo_strs.append(hypo_str)
            if j == 0:
                detok0 = detok_hypo_str
            if not quiet:
                if rec["score_strs"] is None:
                    score = "{}".format(scores[h])
                else:
                    score = rec["score_strs"][h]
                out.append("H-{}\t{}\t{}\n".format(sample_id, score, hypo_str))
                out.append("D-{}\t{}\t{}\n".format(sample_id, score, detok_hypo_str))
                if rec["pos_strs"] is None:
                    n = rec["pos_lens"][h]
                    p = " ".join(map(lambda x: "{:.4f}".format(x), pos[pos_off:pos_off + n].tolist()))
                    pos_off += n
                else:
                    p = rec["pos_strs"][h]
                out.append("P-{}\t{}\n".format(sample_id, p))
                if st.print_alignment == "hard":
                    out.append("A-{}\t{}\n".format(sample_id, " ".join(
                        ["{}-{}".format(src_idx, tgt_idx) for src_idx, tgt_idx in alignment])))
                if st.print_alignment == "soft":
                    out.append("A-{}\t{}\n".format(sample_id, " ".join(
                        [",".join(src_probs) for src_probs in alignment])))
                if st.print_step:
                    out.append("I-{}\t{}\n".format(sample_id, rec["steps"][h]))
                if st.retain_iter_history:
                    for step, hist in enumerate(rec["history"][h]):
                        _, h_str, _ = utils.post_process_prediction(
                            hypo_tokens=torch.from_numpy(hist), src_str=src_str,
                            alignment=None, align_dict=None, tgt_dict=st.tgt_dict,
                            remove_bpe=None,
                        )
                        out.append("E-{}_{}\t{}\n".format(sample_id, step, h_str))
            h += 1
        score_items.append((target_str if has_target else None, detok0, hypo_strs))
    return "".join(out), score_items


def _worker_loop(st: _WorkerState, tasks, results, parent_pid: int, wid: int, nice: int,
                 job=None, threads: int = 1):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the main process ends us
    torch.set_num_threads(threads)
    if job is not None:
        decode_workers.keep_freed_memory()
    if nice:
        try:
            os.nice(nice)
        except OSError:  # pragma: no cover
            pass
    fault = os.environ.get(FAULT_ENV)
    while True:
        try:
            item = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:  # orphaned: the main process is gone
                return
            continue
        if item is None:
            return
        idx, payload = item
        try:
            if fault == "raise":
                raise RuntimeError(f"planted fault ({FAULT_ENV}=raise)")
            if fault == "exit":
                os._exit(3)
            if job is None:  # postprocessing only: the record was decoded in the main process
                result = process_batch(st, pickle.loads(payload)) + (None, None)
            else:  # decode the batch here, then postprocess it
                rec, stats = job(pickle.loads(payload))
                result = process_batch(st, rec) + (_side(rec), stats)
            results.put((idx, True, result))
        except BaseException:
            results.put((idx, False, f"worker {wid} (pid {os.getpid()}):\n{traceback.format_exc()}"))
            return


# ---- main process: worker pool and in-order writer ---------------------------------

class PipelineWorkerError(RuntimeError):
    """A postprocessing worker raised or died."""


def _side(rec: Dict[str, Any]):
    """What only the writer needs of a batch record."""
    return rec["tgt"], rec["packed"], rec["tok_lens"], rec["tok_odd"], rec["counts"]


class _Pool:
    """Worker processes and the in-order hand-over of their results.

    Without ``job`` the workers postprocess records decoded in the main process
    (:meth:`submit`); with one (:class:`~fairseq_fastgen.tasks.decode_workers.DecodeJob`)
    each worker decodes the samples it is given (:meth:`submit_sample`) with ``threads``
    torch threads and postprocesses them.  ``on_result(result, side, stats)`` sees
    results strictly in submission order.
    """

    def __init__(self, state: _WorkerState, n_workers: int, on_result, use_cuda=False,
                 max_in_flight=None, job=None, threads: int = 1):
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self.max_in_flight = max_in_flight or 2 * n_workers + 2
        self.tasks = ctx.Queue(maxsize=self.max_in_flight)
        self.results = ctx.Queue()
        self.on_result = on_result
        self.submitted = 0
        self.written = 0
        self.pending: Dict[int, Any] = {}
        self.side: Dict[int, Any] = {}
        self.procs = []
        # When decoding already occupies every core (CPU decoding with as many torch threads
        # as cores), workers run at a lower priority: they fill the gaps instead of
        # preempting one of the decoder's OpenMP threads (which stalls all of them).
        nice = WORKER_NICE if (job is None and torch.get_num_threads() >= _cores()
                               and not use_cuda) else 0
        kind = "postprocess" if job is None else "decode"
        for wid in range(n_workers):
            p = ctx.Process(target=_worker_loop, name=f"fastgen-{kind}-{wid}",
                            args=(state, self.tasks, self.results, os.getpid(), wid, nice,
                                  job, threads),
                            daemon=True)
            p.start()
            self.procs.append(p)

    def submit(self, rec: Dict[str, Any]) -> None:
        """A batch decoded here: its record goes to a worker for the text."""
        self._put(rec, side=_side(rec))  # what only the writer needs stays here

    def submit_sample(self, sample: Dict[str, Any]) -> None:
        """A batch for a decoding worker (host tensors)."""
        self._put(sample, side=None)

    def _put(self, payload, side) -> None:
        while self.submitted - self.written >= self.max_in_flight:
            self._collect(block=True)
        idx = self.submitted
        if side is not None:
            self.side[idx] = side
        self.tasks.put((idx, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)))
        self.submitted += 1
        self._collect(block=False)
        self._check_alive()

    def finish(self) -> None:
        while self.written < self.submitted:
            self._collect(block=True)

    def _collect(self, block: bool) -> None:
        while True:
            try:
                if block:
                    item = self.results.get(timeout=0.2)
                else:
                    item = self.results.get_nowait()
            except queue.Empty:
                if not block:
                    return
                self._check_alive()
                continue
            idx, ok, result = item
            if not ok:
                raise PipelineWorkerError(
                    "fairseq-fastgen generate pipeline: a postprocessing worker failed on "
                    f"batch {idx}; stopping.\n{result}")
            self.pending[idx] = result
            progressed = False
            while self.written in self.pending:
                idx = self.written
                text, score_items, side, stats = self.pending.pop(idx)
                self.on_result((text, score_items), self.side.pop(idx, side), stats)
                self.written += 1
                progressed = True
            if block and progressed:
                return

    def _check_alive(self) -> None:
        for p in self.procs:
            if p.exitcode is not None:
                while True:  # a worker that raised has sent its traceback before exiting
                    try:
                        idx, ok, result = self.results.get(timeout=0.5)
                    except queue.Empty:
                        break
                    if not ok:
                        raise PipelineWorkerError(
                            "fairseq-fastgen generate pipeline: a postprocessing worker failed "
                            f"on batch {idx}; stopping.\n{result}")
                    self.pending[idx] = result
                raise PipelineWorkerError(
                    f"fairseq-fastgen generate pipeline: postprocessing worker {p.name} "
                    f"(pid {p.pid}) died with exit code {p.exitcode}; stopping "
                    f"({self.submitted - self.written} batch(es) not written)")

    def close(self, abort: bool = False) -> None:
        """Stop the workers: after their queued batches, or at once (``abort``)."""
        if not abort:
            for p in self.procs:
                if p.is_alive():
                    try:
                        self.tasks.put_nowait(None)
                    except (queue.Full, ValueError, OSError):
                        pass
            for p in self.procs:
                p.join(timeout=5.0)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
        for q in (self.tasks, self.results):
            q.cancel_join_thread()
            q.close()


class _Writer:
    """Writes batch texts in order and feeds the scorer exactly as stock's loop does."""

    def __init__(self, output_file, scorer, tgt_dict, post_process):
        self.output_file = output_file
        self.scorer = scorer
        self.tgt_dict = tgt_dict
        self.post_process = post_process
        self.add_string = hasattr(scorer, "add_string")
        from fairseq.data import Dictionary
        from fairseq.tokenizer import tokenize_line

        self._dictionary_cls = Dictionary
        self._tokenize_line = tokenize_line

    def _encode(self, line):
        """``tgt_dict.encode_line(line, add_if_not_exist=True)``: same ids, same dictionary
        growth; for fairseq's own Dictionary without a per-word tensor write."""
        d = self.tgt_dict
        if type(d) is not self._dictionary_cls:
            return d.encode_line(line, add_if_not_exist=True)
        ids = [d.add_symbol(w) for w in self._tokenize_line(line)]
        ids.append(d.eos_index)
        return torch.tensor(ids, dtype=torch.int32)

    def write(self, result, side, stats=None) -> None:
        text, score_items = result
        if text:
            self.output_file.write(text)
        tgt, packed, tok_lens, tok_odd, counts = side
        encode = self._encode
        post_process = self.post_process
        h = 0
        for i, (target_str, detok_hypo_str, hypo_strs) in enumerate(score_items):
            for j, hypo_str in enumerate(hypo_strs):
                if post_process is not None:
                    # utils.post_process_prediction's re-encoding (it may grow the dict)
                    hypo_tokens = encode(hypo_str)
                if tgt is not None and j == 0:
                    if post_process is not None:
                        target_tokens = encode(target_str)
                        hypo_tokens = encode(detok_hypo_str)
                    if self.add_string:
                        self.scorer.add_string(target_str, detok_hypo_str)
                    else:
                        if post_process is None:
                            target_tokens, hypo_tokens = self._raw_tokens(
                                tgt, i, packed, tok_lens, tok_odd, h)
                        self.scorer.add(target_tokens, hypo_tokens)
                h += 1
        assert h == sum(counts), (h, counts)

    def _raw_tokens(self, tgt, i, packed, tok_lens, tok_odd, h):
        """Stock's scorer inputs without --post-process: the int token tensors."""
        row = torch.from_numpy(tgt[i, :])
        target_tokens = row[row.ne(self.tgt_dict.pad())].int()
        if tok_odd is None:
            off = sum(tok_lens[:h])
            hypo_tokens = torch.from_numpy(packed[off:off + tok_lens[h]].astype(np.int64)).int()
        else:
            hypo_tokens = torch.from_numpy(tok_odd[h])
        return target_tokens, hypo_tokens
