"""The machine a suite run measures on, and its physical limit: the achieved GEMM peak at the
model's shapes and the matrix-multiply FLOPs a beam search must spend on given outputs."""
import os
import platform
import re
import subprocess
import time
from typing import Dict, Sequence

from .grid import BUNDLE


def machine_info(threads: int, device: str) -> dict:
    import torch

    info = dict(date=time.strftime("%Y-%m-%d %H:%M %Z"), python=platform.python_version(),
                torch=torch.__version__, threads=threads, cores=os.cpu_count(), device=device)
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"Model name:\s*(.+)", out)
        info["cpu"] = m.group(1).strip() if m else platform.processor()
    except OSError:
        info["cpu"] = platform.processor() or platform.machine()
    from importlib import metadata
    for pkg in ("fairseq-fixed", "fairseq", "ctranslate2"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def model_dims(model: str) -> Dict[str, int]:
    """d, ffn, layers, vocabulary and max positions of a bundled checkpoint."""
    import torch

    ck = torch.load(BUNDLE / model / "checkpoint.pt", map_location="cpu", weights_only=False)
    a = ck["args"] or ck["cfg"]["model"]
    g = lambda k: getattr(a, k) if hasattr(a, k) else a[k]  # noqa: E731
    vocab = ck["model"]["decoder.embed_tokens.weight"].shape[0]
    return dict(d=g("encoder_embed_dim"), ffn=g("encoder_ffn_embed_dim"), enc_layers=g("encoder_layers"),
                dec_layers=g("decoder_layers"), vocab=vocab,
                max_positions=min(g("max_source_positions"), g("max_target_positions")))


def same_shapes(dims: Dict[str, Dict[str, int]]) -> bool:
    """Whether every model has the same GEMM shapes (max positions aside)."""
    shapes = [{k: v for k, v in d.items() if k != "max_positions"} for d in dims.values()]
    return all(s == shapes[0] for s in shapes)


def gemm_throughput(dims: Dict[str, int], device: str, dtype_name: str, threads: int,
                    m: int = 2048, seconds: float = 0.4) -> dict:
    """Best achieved GFLOP/s at the model's GEMM shapes (M x K) @ (K x N): torch.matmul,
    and on CPU in fp32 also oneDNN's linear (fastgen's --fastgen-tune gemm=onednn), whichever
    is faster (on AMD EPYC MKL runs its AVX2 path, oneDNN AVX-512)."""
    import torch

    torch.set_num_threads(threads)
    dtype = dict(fp32=torch.float32, fp16=torch.float16, bf16=torch.bfloat16)[dtype_name]
    d, f, v = dims["d"], dims["ffn"], dims["vocab"]
    out = {}
    for k, n, name in ((d, d, "d x d (attention projections)"), (d, f, "d x ffn (FFN in)"),
                       (f, d, "ffn x d (FFN out)"), (d, v, "d x vocab (output projection)")):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        kernels = [lambda: torch.matmul(a, b)]
        if device == "cpu" and dtype == torch.float32 and hasattr(torch.ops.mkldnn,
                                                                  "_linear_pointwise"):
            kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b.t(), None, "none",
                                                                      [], ""))
        best = 0.0
        for kernel in kernels:
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end or best == 0.0:
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(5):
                    kernel()
                if device == "cuda":
                    torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / 5
                best = max(best, 2 * m * k * n / dt / 1e9)
        out[name] = round(best, 1)
    return dict(shapes=out, m=m, peak_gflops=max(out.values()))


def matmul_flops(dims: Dict[str, int], src_lens: Sequence[int], out_lens: Sequence[int], beam: int) -> float:
    """Matrix-multiply FLOPs needed to produce the given outputs: the formula is spelled out in
    the report (templates/report.md.tmpl, "Physical limit")."""
    d, f, V, Le, Ld = dims["d"], dims["ffn"], dims["vocab"], dims["enc_layers"], dims["dec_layers"]
    total = 0.0
    for S, T in zip(src_lens, out_lens):
        enc = Le * (S * (8 * d * d + 4 * d * f) + 4 * S * S * d)
        cross_kv = Ld * 4 * S * d * d
        dec = beam * (T * (Ld * (12 * d * d + 4 * d * f + 4 * S * d) + 2 * d * V) + Ld * 2 * T * (T + 1) * d)
        total += enc + cross_kv + dec
    return total
