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
                                                           allow-list and clear errors
``fairseq.options.add_checkpoint_args``                    also adds the ``--fastgen-*``
                                                           flags (train/generate/
                                                           interactive parsers)
``fairseq.options.parse_args_and_arch``                    also reads the ``--fastgen-*``
                                                           flags into the active config
``fairseq.data.data_utils.batch_by_size``                 the same batches; the final
                                                           batch fairseq drops (#5036) is
                                                           logged, or kept on request
                                                           (``last_batch.py``)
``fairseq_cli.generate.main`` (what ``cli_main`` calls)    the asynchronous pipeline
                                                           (``tasks/async_generate.py``);
                                                           byte-identical output
=========================================================  ===============================

The ``build_generator`` wrapper also switches off fairseq 0.12.2's fused "BetterTransformer"
encoder-layer path (``TransformerEncoderLayerBase.load_to_BT``) on the models it is given:
with the torch releases pip now picks for 0.12.2 that path crashes ("Mask Type should be
defined"); the regular path computes the same layer.  fairseq-fixed has no such path.

``uninstall()`` puts every original back.  Both are idempotent.
"""
import functools
import logging

from . import config as fg_config

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
    _patch(checkpoint_utils, "load_checkpoint_to_cpu", guarded_loader(
        checkpoint_utils.load_checkpoint_to_cpu, lambda: fg_config.active().trust_checkpoint))
    _patch(options, "add_checkpoint_args", _wrap_add_args(options.add_checkpoint_args))
    _patch(options, "parse_args_and_arch", _wrap_parse(options.parse_args_and_arch))
    from fairseq.data import data_utils

    from .last_batch import guard_batch_by_size

    _patch(data_utils, "batch_by_size", guard_batch_by_size(
        data_utils.batch_by_size, lambda: fg_config.active().keep_last_batch))
    from fairseq_cli import generate as generate_cli

    from .tasks.async_generate import make_main

    _patch(generate_cli, "main", make_main(generate_cli))
    logger.info(fg_config.active().describe())


def uninstall() -> None:
    """Restore every fairseq attribute that install() replaced."""
    for (owner, name), original in list(_originals.items()):
        setattr(owner, name, original)
    _originals.clear()


def _wrap_build_generator(original):
    @functools.wraps(original)
    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        cfg = fg_config.from_hydra(args) or fg_config.active()
        _disable_fused_encoder_layers(models)
        if not cfg.enabled or seq_gen_cls is not None or getattr(args, "score_reference", False):
            return original(self, models, args, seq_gen_cls=seq_gen_cls,
                            extra_gen_cls_kwargs=extra_gen_cls_kwargs,
                            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn)
        from .search.fast_sequence_generator import (
            FastSequenceGenerator, FastSequenceGeneratorWithAlignment)

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


def _disable_fused_encoder_layers(models) -> None:
    for model in models:
        for module in model.modules():
            if getattr(module, "load_to_BT", False):
                module.load_to_BT = False


def _wrap_add_args(original):
    @functools.wraps(original)
    def add_checkpoint_args(parser):
        group = original(parser)
        fg_config.add_args(parser)
        return group

    return add_checkpoint_args


def _wrap_parse(original):
    @functools.wraps(original)
    def parse_args_and_arch(*args, **kwargs):
        result = original(*args, **kwargs)
        parsed = result[0] if isinstance(result, tuple) else result
        cfg = fg_config.from_namespace(parsed)
        if cfg is not None and cfg != fg_config.active():
            fg_config.set_active(cfg)
            logger.info(cfg.describe())
        return result

    return parse_args_and_arch
