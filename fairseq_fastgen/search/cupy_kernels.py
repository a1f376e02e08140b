"""CuPy RawKernel for repeated n-gram blocking (source: ``cuda/ngram_repeat_block.cu``)."""
import functools
import math
import os

import torch
from torch import Tensor

_KERNEL_FILE = os.path.join(os.path.dirname(__file__), "..", "cuda", "ngram_repeat_block.cu")


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


def cupy_ban_repeated_ngrams(tokens: Tensor, lprobs: Tensor, step: int, n: int) -> Tensor:
    raise RuntimeError(
        "the CuPy n-gram blocker is not available in this build; use "
        "--fastgen-ngram-blocker torch"
    )
