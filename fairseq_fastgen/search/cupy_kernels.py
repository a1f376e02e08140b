"""CuPy RawKernel for repeated n-gram blocking (source: ``cuda/ngram_repeat_block.cu``).

Compiled by NVRTC at first use and cached by CuPy; no build step at install.  Tensors are
shared with CuPy through ``__cuda_array_interface__`` (no copies) and the kernel runs on
PyTorch's current CUDA stream.

Any CuPy build works (``cupy-cuda12x``, ``cupy-cuda13x``, ...: all import as ``cupy``):
NVRTC compiles for the current device's architecture (sm_90 on an H100/H200), and the source
needs no headers and nothing past C++11, so every NVRTC that CuPy ships accepts it.  A CuPy
that imports but cannot serve this GPU (built for a newer CUDA than the driver, two CuPy
builds installed at once, no NVRTC) is found by compiling the kernel once in
:func:`cupy_usable`; the blocker then takes its torch path, after one log line that says why.
"""
import functools
import logging
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)
# c++17: the default dialect of the NVRTC in CUDA 12 and 13 (older dialects are deprecated
# there); the kernel itself is plain C.
NVRTC_OPTIONS = ("--std=c++17",)
_FUNCS = {torch.float32: "ban_ngrams_f32", torch.float16: "ban_ngrams_f16",
          torch.bfloat16: "ban_ngrams_bf16"}


def kernel_source_path() -> Path:
    """cuda/ngram_repeat_block.cu in a checkout, fairseq_fastgen/cuda/ when installed."""
    here = Path(__file__).resolve().parent.parent
    for p in (here / "cuda" / "ngram_repeat_block.cu", here.parent / "cuda" / "ngram_repeat_block.cu"):
        if p.exists():
            return p
    raise FileNotFoundError("ngram_repeat_block.cu not found next to fairseq_fastgen")


@functools.lru_cache(maxsize=1)
def cupy_usable() -> bool:
    """True when CUDA is available, CuPy imports and the kernel compiles and loads on the
    current device; otherwise False, logged once (the torch n-gram blocker is used)."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy
    except ImportError:
        logger.info("fairseq-fastgen: CuPy not installed: n-gram blocking on CUDA uses the torch path "
                    "(pip install 'fairseq-fastgen[cuda13]' or '[cuda12]', matching the CUDA driver)")
        return False
    except Exception as e:  # noqa: BLE001  (e.g. two CuPy builds installed at once)
        logger.info("fairseq-fastgen: CuPy does not import (%s): n-gram blocking on CUDA uses the torch path",
                    _reason(e))
        return False
    try:
        for name in _FUNCS.values():
            _kernel(name, torch.cuda.current_device())
    except Exception as e:  # noqa: BLE001  (CuPy for another CUDA than the driver, NVRTC missing, ...)
        logger.info("fairseq-fastgen: CuPy %s cannot compile the n-gram kernel on %s (%s): "
                    "n-gram blocking on CUDA uses the torch path",
                    getattr(cupy, "__version__", "?"), torch.cuda.get_device_name(), _reason(e))
        return False
    return True


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


@functools.lru_cache(maxsize=None)
def _kernel(name: str, device: int):
    import cupy

    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=kernel_source_path().read_text(), options=NVRTC_OPTIONS)
        return module.get_function(name)


def cupy_ban_repeated_ngrams(tokens: Tensor, lprobs: Tensor, step: int, n: int) -> Tensor:
    """Same contract as :func:`ngram_blocker.ban_repeated_ngrams`, on CUDA tensors.

    tokens: (rows, >= step+1) int64 CUDA; lprobs: (rows, vocab) fp32/fp16/bf16 CUDA.
    """
    import cupy

    if not (tokens.is_cuda and lprobs.is_cuda):
        raise RuntimeError("the CuPy n-gram blocker needs CUDA tensors; use --fastgen-tune ngram_blocker=torch")
    if lprobs.dtype not in _FUNCS:
        raise TypeError(f"unsupported lprobs dtype {lprobs.dtype}")
    starts = step - n + 2
    if starts <= 0 or tokens.size(0) == 0:
        return lprobs
    tokens = tokens.contiguous()
    if lprobs.stride(1) != 1:
        raise ValueError("lprobs must be contiguous in the vocabulary dimension")
    threads = min(1024, ((starts + 31) // 32) * 32)
    fn = _kernel(_FUNCS[lprobs.dtype], lprobs.device.index or 0)
    view = lprobs if lprobs.dtype == torch.float32 else lprobs.view(torch.int16)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(lprobs.device).cuda_stream)
    with stream:
        fn((tokens.size(0),), (threads,),
           (cupy.asarray(tokens), cupy.asarray(view), cupy.int32(step), cupy.int32(n),
            cupy.int64(tokens.stride(0)), cupy.int64(lprobs.stride(0)), cupy.int64(lprobs.size(1))))
    return lprobs
