"""CuPy RawKernel for repeated n-gram blocking (source: ``cuda/ngram_repeat_block.cu``).

Compiled by NVRTC at first use and cached by CuPy; no build step at install.  Tensors are
shared with CuPy through ``__cuda_array_interface__`` (no copies) and the kernel runs on
PyTorch's current CUDA stream.
"""
import functools
from pathlib import Path

import torch
from torch import Tensor

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
    """True when CUDA is available and CuPy imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except Exception:  # CuPy missing or built for another CUDA
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernel(name: str, device: int):
    import cupy

    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=kernel_source_path().read_text(), options=("--std=c++11",))
        return module.get_function(name)


def cupy_ban_repeated_ngrams(tokens: Tensor, lprobs: Tensor, step: int, n: int) -> Tensor:
    """Same contract as :func:`ngram_blocker.ban_repeated_ngrams`, on CUDA tensors.

    tokens: (rows, >= step+1) int64 CUDA; lprobs: (rows, vocab) fp32/fp16/bf16 CUDA.
    """
    import cupy

    if not (tokens.is_cuda and lprobs.is_cuda):
        raise RuntimeError("the CuPy n-gram blocker needs CUDA tensors; use --fastgen-ngram-blocker torch")
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
