"""bfloat16 generation (fairseq's ``--bf16``, which stock ``fairseq-generate`` ignores).

A precision is a setting of the decoder step, not another step: the same code runs inside
``torch.autocast(device, bfloat16)``, which sends the GEMMs (``linear``, ``addmm``, ``mm``,
``bmm``) to bfloat16 kernels (oneDNN's AVX512-BF16 / AMX on CPU, tensor cores on CUDA)
and leaves the rest in float32: residual sums (a bfloat16 GEMM output added to a float32
residual is float32), layer norms of those sums, fairseq's softmax and log-softmax (which
take float32), the beam scores and their bookkeeping.  The model's weights stay float32;
a whole-model ``model.bfloat16()`` rounds the residual stream to 8 bits of mantissa at
every layer and agrees markedly less often with float32 (docs/lossless.md, "Half
precision").

The output projection is the exception: it runs in float32 (:func:`float32_region`),
since the logits' rounding decides the beam's choices.  Measured on the bundled es->en
model (first 100 test verses, beam 5, this module's figures in docs/lossless.md): with
every GEMM in bfloat16, 79 of 100 best hypotheses are fp32 stock's; with the output
projection in float32, 90 of 100 (a whole-model ``model.bfloat16()``: about 71 of 100).

What runs in bfloat16 here has no float32 twin with the same rounding, so the C++ step,
oneDNN's float32 kernel choice, MKL packed weights and continuous batching (all float32
machinery) step aside under it; stock's modules under the same autocast region, their
output projection in float32 as well (bitwise mode, :func:`float32_output_projections`),
are the reference a ``--bf16`` run is compared with.
"""
import contextlib
import logging

import torch

logger = logging.getLogger(__name__)
_said = set()


def supported(device: torch.device) -> bool:
    """Whether ``device`` has bfloat16 arithmetic worth running: CUDA that reports it
    (Ampere or newer), a CPU with AVX512-BF16 or AMX as oneDNN sees it."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    cpu = torch.cpu
    return torch.backends.mkldnn.is_available() and (
        getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
        or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def region(bf16: bool, device: torch.device):
    """The context generation runs in: bfloat16 autocast where asked for and supported
    (else float32, with one log line per device type)."""
    if not bf16:
        return contextlib.nullcontext()
    if not supported(device):
        if device.type not in _said:
            _said.add(device.type)
            logger.warning("fairseq-fastgen: --bf16: this %s has no bfloat16 support "
                           "(AVX512-BF16 / AMX on CPU, Ampere or newer on CUDA); "
                           "generating in fp32", device.type.upper())
        return contextlib.nullcontext()
    if device.type == "cpu" and not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)() \
            and "cpu-no-amx" not in _said:
        _said.add("cpu-no-amx")
        # measured: an Intel Xeon with AVX512-BF16 but no AMX, oneDNN bf16 at 0.5-0.6x the
        # fp32 GEMM rate (benchmarks/results/half_precision_xeon.md)
        logger.info("fairseq-fastgen: --bf16 on a CPU without AMX: its bfloat16 GEMMs "
                    "(AVX512-BF16) may run slower than fp32's")
    return torch.autocast(device.type, dtype=torch.bfloat16)


def float32_region(device_type: str):
    """Inside generation's bfloat16 region, a region whose GEMMs run in float32 again (the
    output projection: the logits' last bits decide the beam); nothing outside one."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


@contextlib.contextmanager
def float32_output_projections(models, device_type: str):
    """Stock's modules under the bfloat16 region with the same exception as the fast step:
    each model's ``decoder.output_projection`` runs in float32 (bitwise ``--bf16``, the
    reference).  Forward hooks on those modules, removed on exit; nothing while autocast
    is off."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    open_regions = []

    def enter(module, args):
        region = torch.autocast(device_type, enabled=False)
        region.__enter__()
        open_regions.append(region)

    def leave(module, args, out):
        open_regions.pop().__exit__(None, None, None)

    handles = []
    for m in models:
        proj = getattr(getattr(m, "decoder", None), "output_projection", None)
        if isinstance(proj, torch.nn.Module):
            handles += [proj.register_forward_pre_hook(enter), proj.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
