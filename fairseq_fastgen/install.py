"""The one place where fairseq-fastgen changes fairseq's behaviour.

``install()`` replaces, on the live ``fairseq`` modules:

=========================================================  ===============================
replaced                                                   by
=========================================================  ===============================
``fairseq.tasks.FairseqTask.build_generator``              wrapper that builds
                                                           :class:`FastSequenceGenerator`
                                                           (or its alignment variant)
                                                           when fairseq would build the
                                                           stock ``SequenceGenerator``
``fairseq.checkpoint_utils.load_checkpoint_to_cpu``        the same loader under torch's
                                                           ``weights_only`` with an
                                                           allow-list and clear errors;
                                                           trusts the file when the run's
                                                           config says so
``fairseq.options.add_checkpoint_args``                    also adds the ``--fastgen-*``
                                                           flags (train/generate/
                                                           interactive parsers)
``fairseq.options.parse_args_and_arch``                    also reads the ``--fastgen-*``
                                                           flags into the process default
``fairseq.data.data_utils.batch_by_size``                 the same batches; in generation
                                                           runs the final batch fairseq
                                                           drops (#5036) is logged, or
                                                           kept on request
                                                           (``last_batch.py``)
``fairseq.distributed.utils.call_main``                    the same, with ``main`` run in
                                                           the config resolved from
                                                           ``cfg`` before any spawn
                                                           (train, interactive -- as a
                                                           generation run --, eval-lm,
                                                           validate)
``fairseq.checkpoint_utils.load_checkpoint``               the same training restore, in
                                                           the config of ``cfg``'s tree
                                                           (fairseq-hydra-train imports
                                                           the plugin inside its main,
                                                           after ``call_main``)
``fairseq_cli.generate.main`` (what ``cli_main`` calls)    the asynchronous pipeline
                                                           (``tasks/generate.py``);
                                                           byte-identical output; run as a
                                                           generation run
``fairseq.hub_utils.GeneratorHubInterface.generate``       the same, run as a generation
                                                           run in the config of the hub's
                                                           ``cfg``; the inputs
                                                           ``skip_invalid_size_inputs``
                                                           dropped named in one log line
``fairseq.tasks.FairseqTask.filter_indices_by_size``       the same indices; in generation
                                                           runs (generate, interactive,
                                                           hub) every input skipped as too
                                                           long is named in the log and
                                                           counted for the run's summary
                                                           line (``drops.py``)
``fairseq_cli.interactive.buffered_read``                  the same buffers of lines; a
                                                           line that is not UTF-8 stops the
                                                           run with its number, byte and
                                                           column (``input_check.py``);
                                                           patched when fairseq-interactive's
                                                           main first enters ``call_main``
``fairseq_cli.interactive.main`` with ``--input FILE``     (not patched: ``call_main``
                                                           runs in its place) under
                                                           torchrun ``tasks/
                                                           interactive_ranks``: each rank
                                                           its share of the buffers, rank
                                                           0 writing in input order; on
                                                           CPU ``tasks/interactive_
                                                           workers``: forked decoding
                                                           workers, the same order
=========================================================  ===============================

A run's config is resolved once where it enters (``run_config.resolve``) and read through
``run_config.current()`` by everything below it: the checkpoint loader, the
``batch_by_size`` guard and the generator builder.

The ``build_generator`` wrapper also switches off fairseq 0.12.2's fused "BetterTransformer"
encoder-layer path (``TransformerEncoderLayerBase.load_to_BT``) on the models it is given:
with the torch releases pip now picks for 0.12.2 that path crashes ("Mask Type should be
defined"); the regular path computes the same layer.  fairseq-fixed has no such path.

``uninstall()`` puts every original back.  Both are idempotent.
"""
import functools
import logging
import sys

from . import config as fg_config
from . import config_sources
from . import drops, input_check, run_config
from .tasks import interactive_workers

logger = logging.getLogger("fairseq_fastgen")

_originals = {}


def _patch(owner, name, replacement):
    key = (owner, name)
    if key not in _originals:
        _originals[key] = getattr(owner, name)
        setattr(owner, name, replacement)


def install() -> None:
    """Patch fairseq (see module docstring); safe to call more than once."""
    if _originals:
        return
    from fairseq import checkpoint_utils, options
    from fairseq.tasks import FairseqTask

    from .checkpoint import guarded_loader

    _patch(FairseqTask, "build_generator", _wrap_build_generator(FairseqTask.build_generator))
    _patch(checkpoint_utils, "load_checkpoint_to_cpu",
           guarded_loader(checkpoint_utils.load_checkpoint_to_cpu))
    _patch(options, "add_checkpoint_args", _wrap_add_args(options.add_checkpoint_args))
    _patch(options, "parse_args_and_arch", _wrap_parse(options.parse_args_and_arch))
    from fairseq.data import data_utils

    from .last_batch import guard_batch_by_size

    _patch(data_utils, "batch_by_size", guard_batch_by_size(data_utils.batch_by_size))
    _patch(FairseqTask, "filter_indices_by_size",
           drops.guard_filter(FairseqTask.filter_indices_by_size))
    _install_entry_points()
    from fairseq_cli import generate as generate_cli

    from .tasks.generate import make_main

    _patch(generate_cli, "main", _counting_drops(make_main(generate_cli)))
    logger.info(fg_config.active().describe())


def _install_entry_points() -> None:
    from fairseq import checkpoint_utils, hub_utils
    from fairseq.distributed import utils as distributed_utils

    _patch(distributed_utils, "call_main", _wrap_call_main(distributed_utils.call_main))
    _patch(checkpoint_utils, "load_checkpoint",
           _scoped_entry(checkpoint_utils.load_checkpoint, generation=False))
    hub = hub_utils.GeneratorHubInterface
    _patch(hub, "generate", _wrap_hub_generate(hub.generate))


def uninstall() -> None:
    """Restore every fairseq attribute that install() replaced."""
    for (owner, name), original in list(_originals.items()):
        setattr(owner, name, original)
    _originals.clear()


def _wrap_build_generator(original):
    @functools.wraps(original)
    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        # The task's own node too: fairseq-train's --eval-bleu hands a Namespace, and
        # fairseq-hydra-train imports the plugin only inside its main, after call_main.
        cfg = run_config.resolve(*(c for c in (getattr(self, "cfg", None), args)
                                   if config_sources.is_node(c)))
        _disable_fused_encoder_layers(models)
        if not cfg.enabled or seq_gen_cls is not None or getattr(args, "score_reference", False):
            return original(self, models, args, seq_gen_cls=seq_gen_cls,
                            extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
        from .search.alignment_generator import FastSequenceGeneratorWithAlignment
        from .search.fast_sequence_generator import FastSequenceGenerator

        extra = dict(extra_gen_cls_kwargs or {})
        extra["fastgen"] = cfg
        if getattr(args, "print_alignment", False):
            gen_cls = FastSequenceGeneratorWithAlignment
            extra["print_alignment"] = args.print_alignment
        else:
            gen_cls = FastSequenceGenerator
        return original(self, models, args, seq_gen_cls=gen_cls, extra_gen_cls_kwargs=extra,
                        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)

    return build_generator


def _scoped_entry(original, generation: bool):
    """``original(cfg, ...)`` run in the config resolved from ``cfg``."""
    @functools.wraps(original)
    def entry(cfg, *args, **kwargs):
        return run_config.run_main(original, run_config.resolve(cfg), generation,
                                   cfg, *args, **kwargs)

    return entry


# Known by name, not imported: importing fairseq_cli.interactive runs logging.basicConfig
# (to stdout), which would take fairseq-generate's log lines out of --results-path.
_GENERATION_MAINS = {("fairseq_cli.interactive", "main")}


def _wrap_call_main(original):
    @functools.wraps(original)
    def call_main(cfg, main, **kwargs):
        # Resolved here, in the process that parsed the command line: a process that
        # torch.multiprocessing.spawn starts has only the fresh default.
        generation = (getattr(main, "__module__", None),
                      getattr(main, "__qualname__", None)) in _GENERATION_MAINS
        resolved = run_config.resolve(cfg)
        if generation:  # fairseq-interactive: its module is imported by now
            module = sys.modules.get(main.__module__)
            if hasattr(module, "buffered_read"):
                _patch(module, "buffered_read", input_check.buffered_read)
            main = interactive_workers.choose_main(main, module, cfg, resolved)
            main = functools.partial(drops.run_counted, main, True)
        scoped = functools.partial(run_config.run_main, main, resolved, generation)
        return original(cfg, scoped, **kwargs)

    return call_main


def _wrap_hub_generate(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        cfg = getattr(self, "cfg", None)
        fastgen = run_config.resolve(cfg if config_sources.is_node(cfg) else None)
        # the caller gets fewer outputs than inputs: one line names the ones dropped
        with run_config.run(fastgen, generation=True), drops.counting(detail=False):
            return original(self, *args, **kwargs)

    return generate


def _counting_drops(main):
    """fairseq-generate's main, counting skipped inputs: the last log line names them.
    (The CLI's log goes to stderr, configured before main; never into --results-path.)"""
    def counting_main(cfg):
        with drops.counting():
            return main(cfg)

    counting_main.__wrapped__ = main.__wrapped__  # stock's, as make_main states it
    counting_main.__doc__ = main.__doc__
    return counting_main


def _disable_fused_encoder_layers(models) -> None:
    for model in models:
        for module in model.modules():
            if getattr(module, "load_to_BT", False):
                module.load_to_BT = False


def _wrap_add_args(original):
    @functools.wraps(original)
    def add_checkpoint_args(parser):
        group = original(parser)
        config_sources.add_args(parser)
        return group

    return add_checkpoint_args


def _wrap_parse(original):
    @functools.wraps(original)
    def parse_args_and_arch(*args, **kwargs):
        result = original(*args, **kwargs)
        parsed = result[0] if isinstance(result, tuple) else result
        try:
            cfg = config_sources.from_namespace(parsed)
        except fg_config.FastGenConfigError as e:  # --fastgen-tune / --fastgen-disable items
            parser = args[0] if args else kwargs["parser"]
            parser.error(str(e))
        if cfg is not None and cfg != fg_config.active():
            fg_config.set_active(cfg)
            logger.info(cfg.describe())
        return result

    return parse_args_and_arch
