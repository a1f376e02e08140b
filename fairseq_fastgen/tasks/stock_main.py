"""The parts of stock ``fairseq-generate`` that the pipeline runs unchanged.

Mirrors ``fairseq_cli/generate.py::_main`` (and ``get_symbols_to_strip_from_output``) of
fairseq-fixed 0.12.3.1, the PyPI release this project pins (its metadata records no
commit; source: https://github.com/JackismyShephard/fairseq): the setup before the loop
(:func:`prepare`, :func:`load`) and the lines after it (:func:`log_summary`), statement
for statement, so the log lines, the random state and the loaded objects are stock's.
Two deliberate differences: the generator, tokenizer, BPE and scorer are built before
the batch iterator (the pipeline forks its workers before the iterator starts its
threads), and the caller decides the torch thread count between :func:`prepare` and
:func:`load` (see decode_workers).  Keep this file in step when the pin moves.
"""
import ast
import logging
from itertools import chain
from typing import Any, List, NamedTuple

import numpy as np

# stock's logger name: the same log lines as fairseq-generate
log = logging.getLogger("fairseq_cli.generate")


class Loaded(NamedTuple):
    """What stock's ``_main`` has built when its loop starts."""

    task: Any
    src_dict: Any  # None when the task has no source dictionary
    tgt_dict: Any
    models: List[Any]
    generator: Any
    tokenizer: Any
    bpe: Any
    scorer: Any
    epoch_itr: Any  # task.get_batch_iterator(...), not yet iterated


def get_symbols_to_strip_from_output(generator):
    if hasattr(generator, "symbols_to_strip_from_output"):
        return generator.symbols_to_strip_from_output
    return {generator.eos}


def prepare(cfg) -> None:
    """User module, default ``--max-tokens``, the config log line, the seeds."""
    from fairseq import utils

    utils.import_user_module(cfg.common)

    if cfg.dataset.max_tokens is None and cfg.dataset.batch_size is None:
        cfg.dataset.max_tokens = 12000
    log.info(cfg)

    if cfg.common.seed is not None and not cfg.generation.no_seed_provided:
        np.random.seed(cfg.common.seed)
        utils.set_torch_seed(cfg.common.seed)


def load(cfg, use_cuda: bool) -> Loaded:
    """Task, dictionaries, models (and LM), generator, tokenizer, BPE, scorer, batches."""
    from fairseq import scoring, tasks, utils

    task = tasks.setup_task(cfg.task)
    try:
        src_dict = getattr(task, "source_dictionary", None)
    except NotImplementedError:
        src_dict = None
    tgt_dict = task.target_dictionary

    models, lms = _load_models(cfg, task, use_cuda)
    extra_gen_cls_kwargs = {"lm_model": lms[0], "lm_weight": cfg.generation.lm_weight}
    generator = task.build_generator(
        models, cfg.generation, extra_gen_cls_kwargs=extra_gen_cls_kwargs
    )
    tokenizer = task.build_tokenizer(cfg.tokenizer)
    bpe = task.build_bpe(cfg.bpe)
    scorer = scoring.build_scorer(cfg.scoring, tgt_dict)
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
    return Loaded(task, src_dict, tgt_dict, models, generator, tokenizer, bpe, scorer,
                  epoch_itr)


def _load_models(cfg, task, use_cuda: bool):
    """The ensemble (and the LM, ``[None]`` without one), prepared for inference; loads
    the dataset after the checkpoint, with the saved task config, as stock does."""
    from fairseq import checkpoint_utils, utils

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
    return models, lms


def log_summary(cfg, num_sentences: int, gen_timer, has_target: bool, scorer,
                output_file) -> None:
    """Stock's lines after the loop: the speed line, the BPE warnings, the score line."""
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


def progress(cfg, epoch_itr):
    """Stock's progress bar over one epoch of ``epoch_itr``, in order."""
    from fairseq.logging import progress_bar

    itr = epoch_itr.next_epoch_itr(shuffle=False)
    return progress_bar.progress_bar(
        itr,
        log_format=cfg.common.log_format,
        log_interval=cfg.common.log_interval,
        default_log_format=("tqdm" if not cfg.common.no_progress_bar else "simple"),
    )
