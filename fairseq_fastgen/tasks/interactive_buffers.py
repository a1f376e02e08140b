"""``fairseq-interactive``'s per-buffer code, shared by every loop the plugin runs it in
(one process, torchrun's ranks, decoding workers): stock main's setup, and the lines stock
prints for one buffer of input lines.

A buffer's batches are stock's (``make_batches``); each is decoded by stock's
``task.inference_step``, or, where the continuous-batching engine serves the generator
(``--fastgen-continuous on``, or ``auto`` on a GPU: search/continuous/), all of a buffer's
batches go through the engine, so a finished sentence's rows take the buffer's next
sentence.  Each sentence is decoded as in its stock batch (the engine's contract), and the
buffer's text is printed in input order as stock prints it; only the ``W-`` seconds differ
in meaning (the engine's time until that batch came out, spread over its sentences).

:func:`one_process` is the loop for ``--input FILE`` in one process where the engine serves
(a GPU, or one CPU process with ``--fastgen-continuous on``); elsewhere one process keeps
fairseq's own loop.
"""
import ast
import logging
import math
import sys
import time
from argparse import Namespace
from typing import List, Tuple

import torch

logger = logging.getLogger("fairseq_cli.interactive")


def wants_engine(cfg, fastgen) -> bool:
    """Whether ``fastgen``'s setting asks for the engine in this run (whether it serves the
    generator is known once it is built)."""
    if fastgen.continuous == "on":
        return True
    use_cuda = torch.cuda.is_available() and not cfg.common.cpu
    return fastgen.continuous == "auto" and use_cuda and not fastgen.bitwise


def one_process(cfg, stock) -> None:
    """stock's ``fairseq_cli.interactive.main`` (``stock``: that module) for ``--input FILE``
    in one process, each buffer through :func:`buffer_text`."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    if isinstance(cfg, Namespace):
        cfg = convert_namespace_to_omegaconf(cfg)
    start_time = time.time()
    check(cfg)
    use_cuda = torch.cuda.is_available() and not cfg.common.cpu
    s = setup(cfg, stock, use_cuda)
    logger.info("NOTE: hypothesis and token scores are output in base 2")
    start_id = 0
    total = 0.0
    for inputs in stock.buffered_read(cfg.interactive.input, cfg.interactive.buffer_size):
        text, seconds = buffer_text(s, cfg, inputs, start_id)
        sys.stdout.write(text)
        sys.stdout.flush()
        total += seconds
        start_id += len(inputs)
    logger.info("Total time: {:.3f} seconds; translation time: {:.3f}".format(
        time.time() - start_time, total))


def check(cfg) -> None:
    """stock's defaults and asserts."""
    if cfg.interactive.buffer_size < 1:
        cfg.interactive.buffer_size = 1
    if cfg.dataset.max_tokens is None and cfg.dataset.batch_size is None:
        cfg.dataset.batch_size = 1
    assert not cfg.generation.sampling or cfg.generation.nbest == cfg.generation.beam, \
        "--sampling requires --nbest to be equal to --beam"
    assert not cfg.dataset.batch_size or cfg.dataset.batch_size <= cfg.interactive.buffer_size, \
        "--batch-size cannot be larger than --buffer-size"


def setup(cfg, stock, use_cuda: bool) -> Namespace:
    """stock main's setup: seeds, task, models, generator, tokenizer/BPE, limits."""
    import numpy as np
    from fairseq import checkpoint_utils, tasks, utils

    utils.import_user_module(cfg.common)
    logger.info(cfg)
    if cfg.common.seed is not None and not cfg.generation.no_seed_provided:
        np.random.seed(cfg.common.seed)
        utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    logger.info("loading model(s) from {}".format(cfg.common_eval.path))
    models, _ = checkpoint_utils.load_model_ensemble(
        utils.split_paths(cfg.common_eval.path),
        arg_overrides=ast.literal_eval(cfg.common_eval.model_overrides), task=task,
        suffix=cfg.checkpoint.checkpoint_suffix,
        strict=(cfg.checkpoint.checkpoint_shard_count == 1),
        num_shards=cfg.checkpoint.checkpoint_shard_count)
    for model in models:
        if cfg.common.fp16:
            model.half()
        if use_cuda and not cfg.distributed_training.pipeline_model_parallel:
            model.cuda()
        model.prepare_for_inference_(cfg)
    generator = task.build_generator(models, cfg.generation)
    tokenizer, bpe = task.build_tokenizer(cfg.tokenizer), task.build_bpe(cfg.bpe)

    def encode_fn(x):
        x = tokenizer.encode(x) if tokenizer is not None else x
        return bpe.encode(x) if bpe is not None else x

    def decode_fn(x):
        x = bpe.decode(x) if bpe is not None else x
        return tokenizer.decode(x) if tokenizer is not None else x

    if cfg.generation.constraints:
        logger.warning("NOTE: Constrained decoding currently assumes a shared subword vocabulary.")
    if cfg.interactive.buffer_size > 1:
        logger.info("Sentence buffer size: %s", cfg.interactive.buffer_size)
    return Namespace(
        stock=stock, task=task, models=models, generator=generator, use_cuda=use_cuda,
        engine=continuous_engine(task, generator, cfg),
        src_dict=task.source_dictionary, tgt_dict=task.target_dictionary,
        encode_fn=encode_fn, decode_fn=decode_fn,
        align_dict=utils.load_align_dict(cfg.generation.replace_unk),
        max_positions=utils.resolve_max_positions(
            task.max_positions(), *[m.max_positions() for m in models]),
        strip=stock.get_symbols_to_strip_from_output(generator))


def continuous_engine(task, generator, cfg):
    """The continuous-batching engine for the buffers' batches, or None (one log line)."""
    from ..search.continuous import ContinuousBeamSearch

    engine, reason = ContinuousBeamSearch.for_task(
        task, generator, constraints=bool(cfg.generation.constraints))
    if engine is not None:
        logger.info("fairseq-interactive: continuous batching over each buffer's batches (a "
                    "finished sentence's rows go to the buffer's next sentence)")
    elif getattr(generator, "fastgen", None) is not None and generator.fastgen.log_fallbacks:
        logger.info("fairseq-interactive: continuous batching off: %s", reason)
    return engine


def buffer_text(s: Namespace, cfg, inputs: List[str], start_id: int) -> Tuple[str, float]:
    """What stock's loop prints for one buffer, and its translation time."""
    from fairseq import utils
    from fairseq.token_generation_constraints import unpack_constraints

    results = []
    total = 0.0
    for batch, sample, translations, seconds in _translated(s, cfg, inputs):
        src_tokens, constraints = sample["net_input"]["src_tokens"], batch.constraints
        total += seconds
        listed = ([unpack_constraints(c) for c in constraints] if cfg.generation.constraints
                  else [[] for _ in range(src_tokens.size(0))])
        for i, (id_, hypos) in enumerate(zip(batch.ids.tolist(), translations)):
            results.append((start_id + id_, utils.strip_pad(src_tokens[i], s.tgt_dict.pad()), hypos,
                            {"constraints": listed[i], "time": seconds / len(translations)}))
    out: List[str] = []
    for id_, src_tokens, hypos, info in sorted(results, key=lambda x: x[0]):
        _sentence_lines(s, cfg, out, id_, src_tokens, hypos, info)
    return "".join(line + "\n" for line in out), total


def _translated(s: Namespace, cfg, inputs: List[str]):
    """(batch, sample, hypos, seconds) of each of stock's batches of ``inputs``, in order:
    stock's ``inference_step`` per batch, or all through the continuous engine (seconds:
    the engine's time until that batch came out)."""
    def samples():
        for batch in s.stock.make_batches(inputs, cfg, s.task, s.max_positions, s.encode_fn):
            src_tokens, src_lengths = batch.src_tokens, batch.src_lengths
            constraints = batch.constraints
            if s.use_cuda:
                src_tokens, src_lengths = src_tokens.cuda(), src_lengths.cuda()
                constraints = constraints.cuda() if constraints is not None else None
            yield batch, {"net_input": {"src_tokens": src_tokens, "src_lengths": src_lengths}}, \
                constraints

    if s.engine is None:
        for batch, sample, constraints in samples():
            t0 = time.time()
            hypos = s.task.inference_step(s.generator, s.models, sample, constraints=constraints)
            yield batch, sample, hypos, time.time() - t0
        return
    batches = {}

    def stream():
        for batch, sample, _ in samples():
            batches[id(sample)] = batch
            yield sample, None

    out = s.engine.run(stream())
    while True:
        t0 = time.time()
        try:
            sample, hypos = next(out)
        except StopIteration:
            return
        yield batches.pop(id(sample)), sample, hypos, time.time() - t0


def _sentence_lines(s: Namespace, cfg, out: List[str], id_: int, src_tokens, hypos, info) -> None:
    """stock's print statements for one sentence, appended to ``out``."""
    from fairseq import utils

    post = cfg.common_eval.post_process
    src_str = ""
    if s.src_dict is not None:
        src_str = s.src_dict.string(src_tokens, post)
        out.append("S-{}\t{}".format(id_, src_str))
        out.append("W-{}\t{:.3f}\tseconds".format(id_, info["time"]))
        for constraint in info["constraints"]:
            out.append("C-{}\t{}".format(id_, s.tgt_dict.string(constraint, post)))
    for hypo in hypos[: min(len(hypos), cfg.generation.nbest)]:
        hypo_tokens, hypo_str, alignment = utils.post_process_prediction(
            hypo_tokens=hypo["tokens"].int().cpu(), src_str=src_str,
            alignment=hypo["alignment"], align_dict=s.align_dict, tgt_dict=s.tgt_dict,
            remove_bpe=post, extra_symbols_to_ignore=s.strip)
        score = hypo["score"] / math.log(2)
        out.append("H-{}\t{}\t{}".format(id_, score, hypo_str))
        out.append("D-{}\t{}\t{}".format(id_, score, s.decode_fn(hypo_str)))
        out.append("P-{}\t{}".format(id_, " ".join(
            "{:.4f}".format(x) for x in hypo["positional_scores"].div_(math.log(2)).tolist())))
        if cfg.generation.print_alignment:
            out.append("A-{}\t{}".format(id_, " ".join(
                "{}-{}".format(src, tgt) for src, tgt in alignment)))


