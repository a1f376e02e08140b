"""FastGenConfig: every fairseq-fastgen knob, in one place.

The same field names are reachable three ways:

* CLI: ``--fastgen-<name>`` on ``fairseq-generate`` / ``fairseq-interactive`` /
  ``fairseq-train`` / ``fairseq-eval-lm`` when ``--user-dir fairseq_fastgen`` is given
  (``--fastgen-bitwise``, ``--fastgen-off`` for ``enabled``) for the user fields; the
  fields marked ``developer`` (ablations and their knobs) through ``--fastgen-disable`` and
  ``--fastgen-tune`` (:mod:`fairseq_fastgen.developer_options`);
* Hydra/OmegaConf: a top-level ``fastgen`` node, e.g. ``+fastgen.bitwise=true``;
* Python: ``fairseq_fastgen.configure(bitwise=True)`` or
  ``FastSequenceGenerator(..., fastgen=FastGenConfig(bitwise=True))``.

Which config a run uses (precedence, one resolution per entry point) is
:mod:`fairseq_fastgen.run_config`; the CLI and Hydra surfaces are read by
:mod:`fairseq_fastgen.config_sources`. This module holds the fields, their validation and
the process default that runs start from.

Unknown keys and bad values raise :class:`FastGenConfigError` naming the key.
"""
import dataclasses
import math
import logging
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Mapping, Optional

from . import developer_options

logger = logging.getLogger(__name__)

NGRAM_BLOCKERS = ("auto", "torch", "cupy", "stock")
AGGRESSIVE_MODES = ("off", "on", "auto")
CONTINUOUS_MODES = ("auto", "on", "off")
SAMPLING_SEEDS = ("auto", "stream", "batch")
GEMM_KERNELS = ("auto", "mkl", "onednn")  # see models/gemm_kernel.py


class FastGenConfigError(ValueError):
    """A fastgen option was unknown or had a bad value."""


@dataclass
class FastGenConfig:
    enabled: bool = field(
        default=True,
        metadata={"help": "master switch; false builds fairseq's stock SequenceGenerator"},
    )
    bitwise: bool = field(
        default=False,
        metadata={
            "help": "use only optimizations that keep every float operation identical to "
            "stock fairseq, so output is byte-identical (slower than the default "
            "lossless mode, which reorders some reductions: scores agree to ~1e-6)"
        },
    )
    fast_decoder: bool = field(default=True, metadata={"developer": True, "help": (
        "drive fairseq's TransformerDecoder layers with a lean incremental step "
        "(fused q/k/v projection, encoder-decoder keys/values once per sentence, caches "
        "kept in place, no per-step dict state); lossless mode")})
    vocab_pad: bool = field(
        default=True,
        metadata={"developer": True,
            "help": "output projection through a copy of its weight padded to a multiple "
            "of 64 words (a vocabulary like 6,003 runs the GEMM at half speed); costs one "
            "output embedding of memory; lossless mode only (not used when bitwise)"
        },
    )
    packed_gemm_mb: int = field(
        default=256,
        metadata={"developer": True, "off": 0,
            "help": "MiB per decoder (per process) of MKL packed copies of the decoder's "
            "projection weights, one copy per row count a step uses often (CPU, fp32, "
            "lossless mode; 1.1-1.3x faster GEMMs at few rows); 0 switches it off; a model "
            "whose projections outgrow it runs plain GEMMs"
        },
    )
    gemm: str = field(
        default="auto",
        metadata={"developer": True, "off": "mkl",
            "help": "the fp32 GEMM kernel of continuous batching's decoder projections and "
            "encoder-decoder keys/values on CPU (lossless mode), under the margin guard: "
            "mkl (torch's addmm, stock's), onednn (1.2-2.4x faster on AMD EPYC, where MKL "
            "runs its AVX2 path), or auto (oneDNN where it measures clearly faster on the "
            "model's output projection, once per process). Whatever nothing guards (the "
            "batch-at-a-time path, aggressive decoding) stays on MKL",
            "choices": GEMM_KERNELS,
        },
    )
    margin_guard: float = field(
        default=8.0,
        metadata={"developer": True, "off": 0.0,
            "help": "continuous batching on oneDNN: the engine decodes its first batch on "
            "both kernels and takes as its margin this many times the largest move of a "
            "score s between them (relative to 1 + |s| / 25); a sentence whose beam search "
            "compared two candidates (or final hypotheses) closer than the margin is decoded "
            "again on MKL, so that oneDNN's other rounding cannot change a hypothesis; 0: "
            "off (oneDNN's output may then differ from stock's at near-ties)",
        },
    )
    native_step: bool = field(default=True, metadata={"developer": True, "help": (
        "decoder layers of a step from a C++ extension (compiled once by torch, cached): "
        "the Python step's operations, less dispatch; CPU, lossless mode")})
    fused_cross_attention: bool = field(default=True, metadata={"developer": True, "help": (
        "with native_step: encoder-decoder attention in one C++ pass over each sentence's "
        "keys/values (no reshape copies); lossless mode, CPU fp32")})
    native_candidates: bool = field(default=True, metadata={"developer": True, "help": (
        "beam candidates from one C++ pass over the log-probabilities (the C++ extension "
        "of native_step); lossless mode, CPU fp32")})
    attention: bool = field(
        default=False,
        metadata={"developer": True,
            "help": "always keep per-hypothesis cross-attention weights (hypo['attention']); "
            "by default they are computed only when alignments are printed"
        },
    )
    ngram_blocker: str = field(
        default="auto",
        metadata={"developer": True, "off": "stock",
            "help": "repeated n-gram blocker: auto (CuPy kernel on CUDA when available, "
            "else vectorized torch), torch, cupy, or stock (fairseq's own)",
            "choices": NGRAM_BLOCKERS,
        },
    )
    trust_checkpoint: bool = field(
        default=False,
        metadata={
            "help": "load checkpoints with full unpickling (weights_only=False); only for "
            "files you trust whose extra objects are not on the safe allow-list"
        },
    )
    pipeline: bool = field(
        default=True,
        metadata={"developer": True,
            "help": "fairseq-generate: asynchronous pipeline (decode in the main process, "
            "turn hypotheses into text in worker processes, write in batch order); the "
            "output is byte-identical to fairseq's loop with the same generator"
        },
    )
    pipeline_workers: int = field(
        default=0,
        metadata={"developer": True,
            "help": "postprocessing worker processes of the generate pipeline; 0: auto "
            "(the cores decoding leaves free, 1 to 4; 1 on a 2-core machine)"
        },
    )
    decode_workers: int = field(
        default=0,
        metadata={
            "help": "CPU fairseq-generate (and fairseq-interactive --input FILE): decode "
            "batches (buffers) side by side in this many forked worker processes (torch "
            "threads shared out between them; each worker also postprocesses its batches); "
            "0: auto (one per torch thread, at most 8, at least 2 batches each); 1: decode "
            "in the main process. Not used on a GPU, in bitwise mode, for sampling on one "
            "random stream or --retain-dropout"
        },
    )
    continuous: str = field(
        default="auto",
        metadata={
            "help": "continuous batching of beam search in fairseq-generate (main process "
            "and decoding workers): when a sentence finishes, the next one takes its rows, up to the largest batch's count of sentences is decoded at every step; "
            "each sentence keeps the length limit, prefix and rules of the batch stock puts "
            "it in. on, off, or auto (on for CUDA, and on CPU with the C++ step: "
            "native_step, fp32; see docs/continuous-batching.md). Lossless "
            "mode only",
            "choices": CONTINUOUS_MODES,
        },
    )
    continuous_rows: int = field(
        default=0,
        metadata={"developer": True,
            "help": "continuous batching: decoder rows (sentences x beam) in flight at most; "
            "fewer sentences than --batch-size in flight changes no output. 0: auto (on "
            "CPU 128 rows, where a step's logits stay in cache: measured faster than whole "
            "batches of 64 x beam 5, docs/continuous-batching.md; 256 with oneDNN GEMMs "
            "(--fastgen-tune gemm); on CUDA no bound below the largest batch)",
        },
    )
    keep_last_batch: bool = field(
        default=False,
        metadata={
            "help": "generate the final batch that fairseq's batch_by_size drops when it is "
            "smaller than --required-batch-size-multiple (fairseq #5036; 0.12.2 keeps it). "
            "Off: a warning names the dropped count and output matches stock line for line"
        },
    )
    log_fallbacks: bool = field(
        default=True,
        metadata={"developer": True, "help": "log one line whenever an option falls back to stock code"},
    )
    aggressive: str = field(
        default="off",
        metadata={
            "help": "lossless aggressive decoding for greedy search (beam 1): draft tokens "
            "copied from the source (or from --fastgen-draft-model) and verified in one "
            "decoder pass; on, off, or auto (on when source and target dictionaries are "
            "the same)",
            "choices": AGGRESSIVE_MODES,
        },
    )
    draft_model: str = field(
        default="",
        metadata={
            "help": "path to a small fairseq checkpoint with the same target dictionary "
            "whose greedy output is the draft for aggressive decoding (speculative "
            "decoding, greedy-exact); empty: drafts copied from the source",
        },
    )
    sampling: bool = field(
        default=True,
        metadata={"developer": True,
            "help": "serve --sampling (top-k, top-p, temperature) on the fast decoder, "
            "drawing with fairseq's own Sampling search in stock's batch layout, so the "
            "same seed draws the same numbers; false: fairseq's loop"
        },
    )
    sampling_seed: str = field(
        default="auto",
        metadata={
            "help": "fairseq-generate --sampling's random numbers: stream (one stream "
            "seeded once by --seed, batch after batch, as stock), batch (reseeded before "
            "each batch from --seed and the batch's smallest sentence id, so the output does "
            "not depend on the number of ranks, on decoding workers or on a resumed run), "
            "or auto (batch under torchrun or with --fastgen-resume-dir, else stream)",
            "choices": SAMPLING_SEEDS,
        },
    )
    bf16: bool = field(
        default=False,
        metadata={
            "help": "generation's GEMMs in bfloat16 (CPU: AVX512-BF16 / AMX; CUDA: Ampere "
            "or newer), accumulation, norms, softmax, log-probabilities and scores in fp32; "
            "a device without bfloat16 support logs one line and runs fp32. Set by "
            "fairseq's own --bf16 (Hydra common.bf16), which stock generation ignores",
            "fairseq_flag": "bf16",
        },
    )
    resume_dir: str = field(
        default="",
        metadata={
            "help": "fairseq-generate: keep finished batches in this directory as they are "
            "written (atomic files), so that the same command started again after a kill "
            "skips them and writes the whole output; another command against the same "
            "directory is an error. Empty: off",
        },
    )

    def __post_init__(self):
        for f in fields(self):
            _check_value(f, getattr(self, f.name))

    def replace(self, **overrides) -> "FastGenConfig":
        """A copy with ``overrides`` applied (validated)."""
        return FastGenConfig.from_mapping({**self.to_dict(), **overrides})

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], base: Optional["FastGenConfig"] = None):
        """Build from a dict-like (Hydra node, kwargs), rejecting unknown keys."""
        known = {f.name: f for f in fields(cls)}
        merged = (base or cls()).to_dict()
        values = dict(values)
        try:
            values.update(developer_options.expand(
                values.pop("disable", None), values.pop("tune", None), cls.developer_fields()))
        except ValueError as e:
            raise FastGenConfigError(str(e)) from None
        for key, value in values.items():
            if key.startswith("_"):
                continue  # Hydra bookkeeping such as ``_name``
            if key not in known:
                raise FastGenConfigError(
                    f"unknown fastgen option {key!r}; known options: "
                    f"{', '.join(sorted([*known, 'disable', 'tune']))}"
                )
            merged[key] = _coerce(known[key], value)
        return cls(**merged)

    @classmethod
    def developer_fields(cls) -> Dict[str, Any]:
        """Name -> dataclass field of the fields ``disable`` / ``tune`` reach."""
        return {f.name: f for f in fields(cls) if f.metadata.get("developer")}

    def active_optimizations(self) -> Dict[str, bool]:
        """Which optimizations this config switches on (for the one start-up log line)."""
        on = self.enabled
        fast = on and self.fast_decoder and not self.bitwise  # bitwise: stock's loop
        fp32 = not self.bf16  # bfloat16 steps aside the fp32 machinery (models/precision.py)
        return {
            "fast_decoder": fast,
            "native_step": fast and fp32 and self.native_step,
            "fused_cross_attention": fast and fp32 and self.native_step and self.fused_cross_attention,
            "native_candidates": fast and self.native_candidates,
            "gemm=" + self.gemm: fast and fp32,
            "continuous_batching=" + self.continuous: fast and fp32 and self.continuous != "off",
            "ngram_blocker=" + self.ngram_blocker: on,
            "bf16": on and self.bf16,
            "aggressive_greedy=" + self.aggressive + (
                "+draft_model" if self.draft_model else ""): fast and self.aggressive != "off",
        }

    def describe(self) -> str:
        opts = [k for k, v in self.active_optimizations().items() if v]
        mode = "off" if not self.enabled else ("bitwise" if self.bitwise else "lossless")
        if mode == "lossless" and self.gemm == "onednn" and self.margin_guard == 0:
            mode = "unguarded"  # oneDNN without the margin guard: near-ties may flip
        return f"fairseq-fastgen: mode={mode}; active: {', '.join(opts) or 'none'}"


def _check_value(f, value):
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise FastGenConfigError(
            f"fastgen option {f.name!r}: {value!r} is not one of {', '.join(choices)}"
        )
    if f.type in (bool, "bool") and not isinstance(value, bool):
        raise FastGenConfigError(f"fastgen option {f.name!r} must be true/false, got {value!r}")
    if f.type in (int, "int") and (isinstance(value, bool) or not isinstance(value, int)
                                   or value < 0):
        raise FastGenConfigError(
            f"fastgen option {f.name!r} must be a non-negative integer, got {value!r}")
    if f.type in (float, "float") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                       or not math.isfinite(value) or value < 0):
        raise FastGenConfigError(
            f"fastgen option {f.name!r} must be a finite number >= 0, got {value!r}")


def _coerce(f, value):
    if f.type in (bool, "bool") and isinstance(value, str):
        low = value.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise FastGenConfigError(f"fastgen option {f.name!r} must be true/false, got {value!r}")
    if f.type in (int, "int") and isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise FastGenConfigError(
                f"fastgen option {f.name!r} must be a non-negative integer, got {value!r}"
            ) from None
    if f.type in (float, "float") and isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise FastGenConfigError(
                f"fastgen option {f.name!r} must be a finite number >= 0, got {value!r}"
            ) from None
    return value


# The process default: what configure() or the last parsed command line set.  Runs start
# from it (run_config.resolve) and read their own config through run_config.current(),
# so a Hydra node of one run never leaks into the next run of the same process.
_active = FastGenConfig()


def active() -> FastGenConfig:
    """The process default (the config of a run in progress is ``run_config.current()``)."""
    return _active


def set_active(cfg: FastGenConfig) -> FastGenConfig:
    global _active
    _active = cfg
    return cfg


def configure(**options) -> FastGenConfig:
    """Python entry point: ``fairseq_fastgen.configure(bitwise=True)``."""
    return set_active(FastGenConfig.from_mapping(options, base=_active))
