"""``fairseq-interactive --input FILE`` over torchrun's ranks: each rank translates its
share of the input's buffers, rank 0 writes them in input order.

    torchrun --nproc-per-node N $(command -v fairseq-interactive) DATA --path M \\
        --input FILE --buffer-size 256 --batch-size 32 ... --user-dir fairseq_fastgen

Stock fairseq-interactive under torchrun translates the whole input on every rank (N
copies of the output).  Here every rank reads the same file in the same buffers of
``--buffer-size`` lines (stock's reader, patched to name undecodable lines), so every rank
knows each buffer's first sentence id; buffer i is translated by rank ``i mod N`` with
stock's per-buffer code (:func:`buffer_text`, the lines stock prints, ``W-`` times
included).  Every :data:`WINDOW` rounds of N buffers the ranks hand their texts to rank 0
(one ``gather_object``), which writes them in buffer order: memory holds at most a window
of text, however long the file.  Lossless against one process (a rank decodes a buffer as
one process does, with its share of the cores); standard input is refused (each rank would
read its own lines).

One process (no torchrun) keeps fairseq's own loop, with the plugin's generator.
"""
import ast
import logging
import math
import sys
import time
from argparse import Namespace
from typing import List, Optional, Tuple

import torch

from . import ranks as ranks_mod
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


def _refuse_under_torchrun(cfg) -> None:
    if cfg.interactive.input in ("-", "", None):
        raise InteractiveInputError(
            "under torchrun every rank reads the input: give it as --input FILE (standard "
            "input cannot be shared between ranks)")
    if cfg.generation.sampling:
        raise InteractiveInputError(
            "--sampling under torchrun: each rank would draw from its own random stream; "
            "run fairseq-interactive --sampling in one process")


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
        src_dict=task.source_dictionary, tgt_dict=task.target_dictionary,
        encode_fn=encode_fn, decode_fn=decode_fn,
        align_dict=utils.load_align_dict(cfg.generation.replace_unk),
        max_positions=utils.resolve_max_positions(
            task.max_positions(), *[m.max_positions() for m in models]),
        strip=stock.get_symbols_to_strip_from_output(generator))


def buffer_text(s: Namespace, cfg, inputs: List[str], start_id: int) -> Tuple[str, float]:
    """What stock's loop prints for one buffer, and its translation time."""
    from fairseq import utils
    from fairseq.token_generation_constraints import unpack_constraints

    results = []
    total = 0.0
    for batch in s.stock.make_batches(inputs, cfg, s.task, s.max_positions, s.encode_fn):
        src_tokens, src_lengths, constraints = batch.src_tokens, batch.src_lengths, batch.constraints
        if s.use_cuda:
            src_tokens, src_lengths = src_tokens.cuda(), src_lengths.cuda()
            constraints = constraints.cuda() if constraints is not None else None
        sample = {"net_input": {"src_tokens": src_tokens, "src_lengths": src_lengths}}
        t0 = time.time()
        translations = s.task.inference_step(s.generator, s.models, sample, constraints=constraints)
        seconds = time.time() - t0
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


def _exchange(mine: List[Optional[str]], ranks: ranks_mod.Ranks, group) -> List[Optional[str]]:
    """Every rank's texts of the window to rank 0, written there in buffer order (round
    by round, rank by rank).  Collective.  Returns the emptied list."""
    import torch.distributed as dist

    gathered = [None] * ranks.world if ranks.leader else None
    dist.gather_object(mine, gathered, dst=0, group=group)
    if ranks.leader:
        for j in range(max(len(g) for g in gathered)):
            for part in gathered:
                if j < len(part) and part[j] is not None:
                    sys.stdout.write(part[j])
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
