"""Which fp32 GEMM kernel runs the decoder's projections on CPU: MKL's or oneDNN's.

torch runs ``addmm`` on MKL.  On AMD EPYC (Zen 4, AVX-512) MKL takes its generic AVX2
path (``mkl_blas_def_sgemm_kernel_0_zen``, plus a copy of the weight panel on every call:
17% of a batch-8 run), while oneDNN's JIT kernels, reached through the op inductor uses
for frozen linears (``mkldnn::_linear_pointwise``), use AVX-512: at the bundled es->en
shapes 1.2-1.8x faster at 8 rows, 1.7-2.1x at 40 and 2.1-2.4x at 160-320 rows, with one
thread or two (benchmarks/results/NOTES.md, "oneDNN GEMM").  On a CPU where MKL is as
fast, MKL stays.

The decoder's transposed weight copies call :func:`linear`; fairseq's own modules that
run once per batch (the encoder's layers, the encoder-decoder keys/values) are reached
through :func:`linears`, a ``TorchFunctionMode`` that sends their ``F.linear`` calls here.

``auto`` decides by measuring both kernels once per process on the model's output
projection shape (:func:`use_onednn`; a few milliseconds) and takes oneDNN only when it
is clearly faster (``MARGIN``), so two processes of one machine decide alike.  oneDNN sums
in another order than MKL (the last places of a logit differ, the output is not
byte-identical): a lossless-mode optimization, never used in bitwise mode, CPU fp32 only.
Where two candidates of a beam are that close, the order can flip: ``auto`` therefore
serves only continuous batching, under the margin guard
(:mod:`~fairseq_fastgen.search.continuous.margins`), which decodes such a sentence again
on MKL; the batch-at-a-time path stays on MKL.
"""
import contextlib
import functools
import logging
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

MARGIN = 1.2  # oneDNN must be this much faster than MKL for auto to take it
CALIBRATION_ROWS = 40  # a beam-5 step of 8 sentences, the rows where most steps fall


def available() -> bool:
    """Whether this torch build has oneDNN's fp32 linear op."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise"))


def usable(x: Tensor) -> bool:
    """Inputs oneDNN's kernel serves: fp32 on CPU, not empty."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() > 0


def linear(x: Tensor, wt: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``addmm(bias, x, wt)`` on oneDNN: x (rows, in), wt (in, out) contiguous (read as
    its transpose, the (out, in) weight oneDNN takes, without a copy); (rows, out)."""
    return _pointwise(x, wt.t(), bias)


def _pointwise(x: Tensor, w: Tensor, bias: Optional[Tensor]) -> Tensor:
    """oneDNN's ``F.linear(x, w, bias)``, w: (out, in) in any layout."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


class _OnednnLinears(TorchFunctionMode):
    """``F.linear`` of fp32 CPU inputs without autograd on oneDNN; every other call as is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and not torch.is_grad_enabled():
            named = dict(zip(("input", "weight", "bias"), args), **kwargs)
            x, w, b = named["input"], named["weight"], named.get("bias")
            if usable(x) and w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2:
                return _pointwise(x, w, b)
        return func(*args, **kwargs)


def linears(on: bool):
    """A context in which fairseq modules' linears run on oneDNN (``on``), else nothing."""
    return _OnednnLinears() if on else contextlib.nullcontext()


def use_onednn(mode: str, features: int, outputs: int, device: torch.device,
               dtype: torch.dtype) -> bool:
    """Whether a decoder of ``features`` -> ``outputs`` output projection runs its
    projections on oneDNN: ``mode`` onednn (where available), mkl, or auto (measured)."""
    if mode == "mkl" or device.type != "cpu" or dtype != torch.float32 or not available():
        return False
    if mode == "onednn":
        return True
    return _measured_faster(features, outputs, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _measured_faster(features: int, outputs: int, threads: int) -> bool:
    """Both kernels on a (CALIBRATION_ROWS, features) x (features, outputs) GEMM, warm,
    interleaved, best of 5 each; one log line with the figures."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(CALIBRATION_ROWS, features, generator=g)
    wt = torch.randn(features, outputs, generator=g)
    b = torch.randn(outputs, generator=g)
    kernels = {"mkl": lambda: torch.addmm(b, x, wt), "onednn": lambda: linear(x, wt, b)}
    best = {name: float("inf") for name in kernels}
    with torch.no_grad():
        for f in kernels.values():
            f()
        for _ in range(5):
            for name, f in kernels.items():
                t0 = time.perf_counter()
                f()
                best[name] = min(best[name], time.perf_counter() - t0)
    faster = best["mkl"] >= MARGIN * best["onednn"]
    logger.info(
        "fairseq-fastgen: decoder GEMMs on %s (%d x %d x %d, %d thread(s): oneDNN %.3f ms, "
        "MKL %.3f ms; --fastgen-tune gemm=... chooses)", "oneDNN" if faster else "MKL",
        CALIBRATION_ROWS, features, outputs, threads, best["onednn"] * 1e3, best["mkl"] * 1e3)
    return faster
