"""The decoder layers of one incremental step in C++ (``csrc/decoder_layers.cpp``).

A step of the Python layers makes ~100 eager calls, each parsed and dispatched from Python;
making the same ATen calls on the same shapes from C++ took a step of the bundled 3-layer
es->en model from 1.82 to 1.59 ms at 5 rows and from 2.94 to 2.72 ms at 40 (Intel Xeon, 2
threads; see benchmarks/results/NOTES.md, "Native decoder step").  The projections, norms,
FFN and batched encoder-decoder attention are the Python step's
(:class:`~fairseq_fastgen.models.layers.DecoderStack`) bit for bit; the self-attention is
the extension's own kernel (``ancestor_attention`` in ``csrc/attention_kernels.cpp``: the
caches are read in place through an ancestor table, see
:mod:`~fairseq_fastgen.models.slot_decoder`), and with ``fused_cross_attention`` the
encoder-decoder attention is ``fused_cross_attention`` (one pass per sentence, no reshape
copies); both sum in another order (lossless mode; tests/test_native_step.py).  The
projections run on MKL or oneDNN as the Python step's do (``gemm_kernel``).

The extension is compiled once per torch version, source and kind of CPU (``-O3
-march=native``) by ``torch.utils.cpp_extension.load`` (about 30-60 s with g++; ``make
install`` does it, and ``python -m fairseq_fastgen build-native``), cached under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``).  Where it cannot be
built (no compiler) or a model has something the C++ step does not mirror, the Python step
runs, after one log line saying why.
"""
import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import TransposedLinear

logger = logging.getLogger(__name__)

_module = None
_load_error: Optional[str] = None


def sources() -> List[Path]:
    """The extension's C++ files: the layers (with the module definition) first."""
    d = Path(__file__).resolve().parents[1] / "csrc"
    return [d / "decoder_layers.cpp", d / "attention_kernels.cpp", d / "beam_candidates.cpp",
            d / "slot_beams.cpp"]


def load():
    """The compiled extension (compiling it first if no build of this source exists), or
    None; the reason of a failure is :func:`load_error`.

    Builds live in ``<TORCH_EXTENSIONS_DIR>/fastgen_decoder_layers_<source hash>/``, from
    a copy of the source there: checkouts with the same source share one build (ninja
    rebuilds whenever a source's path changes), and a build that exists is imported
    directly (ninja's check alone costs seconds)."""
    global _module, _load_error
    if _module is not None or _load_error is not None:
        return _module
    try:
        _module = _import_or_build()
    except Exception as e:  # no compiler, headers, ninja...: the Python step serves
        lines = str(e).strip().splitlines()
        _load_error = f"{type(e).__name__}: {lines[-1][:200] if lines else ''}"
    return _module


def _import_or_build():
    from torch.utils import cpp_extension

    codes = [p.read_bytes() for p in sources()]
    code = b"".join(codes)
    cpu = _cpu_flags()
    # -march=native: the build is for this CPU, so its flags are part of the build's name
    # (a home directory shared by different machines gets one build per kind of CPU)
    # -fopenmp: at::parallel_for runs its OpenMP loop only when the code including it is
    # compiled with OpenMP (else one thread); the library is torch's own libgomp
    cflags = ["-O3", "-fopenmp"] + (["-march=native"] if cpu else [])
    key = code + torch.__version__.encode() + cpu.encode() + " ".join(cflags).encode()
    tag = hashlib.sha256(key).hexdigest()[:16]
    name = f"fastgen_decoder_layers_{tag}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    built = build_dir / f"{name}.so"
    if built.exists():
        try:
            spec = importlib.util.spec_from_file_location(name, built)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        except (ImportError, OSError):  # a build cut short (killed while linking): again
            built.unlink(missing_ok=True)
    copies = []
    for src, text in zip(sources(), codes):
        copy = build_dir / src.name
        if not copy.exists() or copy.read_bytes() != text:
            tmp = copy.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(text)
            os.replace(tmp, copy)  # atomic: concurrent builders see a whole file
        copies.append(str(copy))
    # ninja is a declared requirement whose binary lies beside this Python (a venv's bin/,
    # not always on PATH when the venv's python is run directly)
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bindir, os.environ.get("PATH", "")])
    logger.warning("fairseq-fastgen: compiling the C++ decoder step once for this torch, "
                   "source and CPU (about 30-60 s with g++; `make install` or `python -m "
                   "fairseq_fastgen build-native` does it ahead), cached in %s", build_dir)
    return cpp_extension.load(name=name, sources=copies, build_directory=str(build_dir),
                              extra_cflags=cflags, extra_ldflags=["-fopenmp"], verbose=False)


def _cpu_flags() -> str:
    """The instruction-set flags of this CPU (Linux x86 /proc/cpuinfo), '' if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def load_error() -> Optional[str]:
    return _load_error


def _activation(fn) -> Optional[int]:
    """The C++ code of a layer's activation: 0 relu, 1 fairseq's gelu, None: unsupported."""
    if fn is F.relu:
        return 0
    try:
        from fairseq.modules.gelu import gelu
    except ImportError:  # pragma: no cover
        return None
    return 1 if fn is gelu else None


def _norm(m) -> Optional[Tuple[Optional[Tensor], Optional[Tensor], float]]:
    if type(m) is not nn.LayerNorm or len(m.normalized_shape) != 1:
        return None
    return m.weight, m.bias, float(m.eps)


def unsupported(stack) -> Optional[str]:
    """Why ``stack`` (a DecoderStack) cannot run the C++ layers (None: it can)."""
    if stack.device_dtype()[0].type != "cpu":
        return "not on CPU"
    if not stack.layers:
        return "no layers"
    acts, nbs = set(), set()
    for l in stack.layers:
        layer = l.layer
        projs = [l.qkv, l.sa_out, l.fc1, l.fc2]
        if layer.encoder_attn is not None:
            projs += [l.ea_q, l.ea_out]
        if not all(isinstance(p, TransposedLinear) for p in projs):
            return "a projection without a transposed copy"
        norms = [layer.self_attn_layer_norm, layer.final_layer_norm]
        if layer.encoder_attn is not None:
            norms.append(layer.encoder_attn_layer_norm)
        if any(_norm(m) is None for m in norms):
            return "a layer norm other than torch.nn.LayerNorm"
        act = _activation(layer.activation_fn)
        if act is None:
            return f"activation {getattr(layer.activation_fn, '__name__', '?')}"
        acts.add(act)
        nbs.add(bool(layer.normalize_before))
    if len(acts) > 1 or len(nbs) > 1 or len({(l.heads, l.head_dim) for l in stack.layers}) > 1:
        return "layers of different shapes or kinds"
    return None


def build(stack, fused_cross: bool = False) -> Optional["NativeLayers"]:
    """The C++ layers for ``stack``, or None after one log line saying why not;
    fused_cross: encoder-decoder attention by the C++ kernel (``fused_cross_attention``)."""
    reason = unsupported(stack)
    module = load() if reason is None else None
    if reason is None and module is None:
        reason = f"C++ extension unavailable ({load_error()})"
    if reason is not None:
        _log_once(f"fairseq-fastgen: native decoder step off ({reason}); Python step")
        return None
    return NativeLayers(stack, module, fused_cross)


_logged = set()


def _log_once(msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        logger.info(msg)


class NativeLayers:
    """Runs a DecoderStack's layers for one step through the C++ extension."""

    def __init__(self, stack, module, fused_cross: bool = False):
        self.stack = stack
        self.module = module
        self.per_layer = int(module.WEIGHTS_PER_LAYER)
        first = stack.layers[0]
        self.ints = [first.heads, first.head_dim, int(bool(first.layer.normalize_before)),
                     _activation(first.layer.activation_fn), int(fused_cross),
                     int(stack.onednn)]
        self.scalars: List[float] = []
        for l in stack.layers:
            layer = l.layer
            ea = layer.encoder_attn
            eps = [_norm(m)[2] if m is not None else 1e-5 for m in (
                layer.self_attn_layer_norm, layer.encoder_attn_layer_norm,
                layer.final_layer_norm)]
            self.scalars += [float(l.scaling), float(ea.scaling) if ea is not None else 1.0, *eps]

    def for_stack(self, stack) -> "NativeLayers":
        """These layers run for ``stack`` (the same layers on another GEMM kernel:
        :meth:`~fairseq_fastgen.models.layers.DecoderStack.with_gemm`)."""
        if stack is self.stack:
            return self
        return NativeLayers(stack, self.module, bool(self.ints[4]))

    def weights(self, rows: int) -> List[Optional[Tensor]]:
        """Every layer's weights in the C++ order, packs for ``rows`` where MKL has them."""
        out: List[Optional[Tensor]] = []
        for l in self.stack.layers:
            layer = l.layer
            ea = layer.encoder_attn is not None
            out += [*_norm(layer.self_attn_layer_norm)[:2], *_proj(l.qkv, rows),
                    *_proj(l.sa_out, rows)]
            if ea:
                out += [*_norm(layer.encoder_attn_layer_norm)[:2], *_proj(l.ea_q, rows),
                        *_proj(l.ea_out, rows)]
            else:
                out += [None] * 8
            out += [*_norm(layer.final_layer_norm)[:2], *_proj(l.fc1, rows), *_proj(l.fc2, rows)]
        return out

    def at_row_steps(self, x: Tensor, caches: List[Tensor], xs: List[Optional[Tensor]],
                     t_max: int, beam: int, ancestors: Tensor, lens: Tensor,
                     phys: Tensor, need_attn: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """Rows at their own steps: x (n, C) embedded queries;
        caches: each layer's (k, v) buffers (T, P, C), row h's step-s key/value in row
        ``ancestors[h, s]`` of step s; lens (n,) int64 each row's step + 1 (<= t_max + 1);
        phys (n,) int64 the buffer row each row writes at its step (column lens - 1 of
        ``ancestors`` is set to it); xs: each layer's (k, v, pad) of the rows' slots, or
        three None.  Returns (n, C) and, if need_attn, the last layer's head-averaged
        cross-attention (n, S)."""
        return self.module.layers_step(x, self.weights(x.size(0)), caches, xs, t_max, beam,
                                       self.scalars, self.ints, need_attn, ancestors, lens, phys)


def _proj(p: TransposedLinear, rows: int):
    """(wt, bias, pack or None) of a transposed projection for ``rows`` rows."""
    pack = p.packs.pack_for(rows, p.wt) if p.wt.dtype == torch.float32 else None
    return p.wt, p.bias, pack
