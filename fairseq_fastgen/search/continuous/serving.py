"""What continuous batching serves, and on which kernel and row bound.

:func:`unsupported` says why a run's batches go to the generator one at a time instead
(each then decoded on its own: by the same engine where the generator's fast path serves
it, else by stock's loop); :func:`engine_onednn` and :func:`auto_rows` resolve the engine's GEMM
kernel and its bound on rows in flight from the generator's config, once per engine.
"""
from typing import Optional

import torch

# --fastgen-tune continuous_rows=0 on CPU: rows in flight at most.  Measured (Xeon, es->en,
# beam 5, docs/continuous-batching.md): 16-32 sentences beat 64, 1 and 2 threads alike;
# a step's (rows, vocab) logits then stay in the core's cache.  With oneDNN's GEMMs
# (models/gemm_kernel.py), which gain more from rows than MKL's, 256 rows took a
# batch-64 run 9.9-10.0 s -> 8.2-8.8 s (AMD EPYC; benchmarks/results/NOTES.md).
AUTO_CPU_ROWS = 128
AUTO_CPU_ROWS_ONEDNN = 256


def auto_rows(generator, onednn: bool) -> int:
    """Rows in flight at most by default (0: no bound)."""
    if next(generator.model.parameters()).is_cuda:
        return 0
    return AUTO_CPU_ROWS_ONEDNN if onednn else AUTO_CPU_ROWS


def engine_onednn(generator) -> bool:
    """Whether the engine's decoders run their GEMMs on oneDNN: ``--fastgen-tune gemm=onednn``
    where the kernel serves the model (fp32 CPU), or ``auto`` where oneDNN also measures
    faster and the margin guard can catch its rounding.  Only the engine runs oneDNN: the
    generator's own batches and aggressive decoding stay on MKL, where nothing guards them."""
    cfg = generator.fastgen
    stacks = [d.stack for d in generator.decoders()]
    if cfg.gemm == "mkl" or not all(st.onednn_serves("onednn") for st in stacks):
        return False
    return cfg.gemm == "onednn" or (
        cfg.margin_guard > 0 and all(st.onednn_serves("auto") for st in stacks))


def unsupported(generator, task=None, constraints: bool = False) -> Optional[str]:
    """Why these batches go to the generator one at a time (None: the stream serves them)."""
    from fairseq.tasks import FairseqTask

    cfg = getattr(generator, "fastgen", None)
    if cfg is None or not hasattr(generator, "decoders"):
        return "not the fastgen generator"
    if cfg.continuous == "off":
        return "switched off (--fastgen-continuous off)"
    if cfg.bitwise:
        return "bitwise mode keeps stock's batches and GEMM shapes"
    if generator.fallback_reason is not None:
        return generator.fallback_reason
    if generator.bf16() or next(generator.model.parameters()).dtype != torch.float32:
        # the engine's candidates order exact ties otherwise than stock's top-k, and half
        # precision ties often (docs/lossless.md, "Half precision")
        return "half precision (--fp16 / --bf16): each batch on its own, stock's top-k"
    if getattr(generator, "sampling", False):
        return "sampling draws stock's random numbers over stock's batches"
    if generator.need_attn:
        return "attention weights are kept (--print-alignment or --fastgen-tune attention=true)"
    if constraints:
        return "lexical constraints"
    if generator.beam_size == 1 and cfg.aggressive != "off":
        return "aggressive decoding serves greedy search"
    blocker = generator.repeat_ngram_blocker
    if blocker is not None and not hasattr(blocker, "ban_ragged"):
        return "fairseq's own n-gram blocker (--fastgen-tune ngram_blocker=stock)"
    if generator.model.models[0].training:
        return "models in training mode (--retain-dropout)"
    if task is not None and type(task).inference_step is not FairseqTask.inference_step:
        return f"task {type(task).__name__} has its own inference_step"
    if cfg.continuous == "auto" and not next(generator.model.parameters()).is_cuda and \
            any(d.native() is None for d in generator.decoders()):
        # measured: docs/continuous-batching.md (the Python slot step is slower on CPU)
        return ("auto on CPU without the C++ step (it needs the native step and fp32; "
                "--fastgen-continuous on forces it)")
    return None
