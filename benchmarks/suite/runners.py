"""How the suite runs its systems.

Every fairseq-generate run, stock or fastgen, goes through one interface,
:class:`FairseqRunner`, whose command and environment come from
``fairseq_fastgen.compare.generate_command``: a fresh process per run
(:class:`ProcessRunner`; on CUDA through a launcher that reports peak GPU memory) or a fork
of a server that has already imported torch and fairseq (:class:`ForkServerRunner`, CPU).
CTranslate2 has its own runner (:class:`Ct2Runner`).
"""
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence

from fairseq_fastgen.compare import (
    TRANSLATED, Run, generate_command, run_generate, run_measured, stock_needs_route_around)

from .grid import BUNDLE, MAX_LEN_B, MODELS, ROOT

BENCHMARKS = ROOT / "benchmarks"
# Reference for --no-repeat-ngram-size on CPU: stock fairseq-generate with only fairseq #4709
# fixed (its CPU blocker compares trailing padding and bans nothing); fastgen's blocker has the
# CUDA kernel's semantics.  The same script is the reference of tests/test_ngram_e2e.py.
FIXED_NGRAM_PROGRAM = (sys.executable, str(ROOT / "tests" / "scripts" / "stock_generate_fixed_ngram.py"))
GPU_LAUNCH = r"""
import atexit, sys
def _peak():
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sys.stderr.write("SUITE_PEAK_GPU_MB %.1f\n" % (torch.cuda.max_memory_allocated() / 2**20))
    except Exception:
        pass
atexit.register(_peak)
sys.argv[0] = "fairseq-generate"
from fairseq_cli.generate import cli_main
cli_main()
"""
QUIET = {"PYTHONWARNINGS": "ignore"}


def fairseq_args(ddir: Path, model: str, split: str, beam: int, batch: int, ngram: int, device: str,
                 precision: str, extra: Sequence[str] = ()) -> List[str]:
    """fairseq-generate's arguments for one cell (the plugin's flags are added by the runner)."""
    src, tgt = MODELS[model]
    a = [str(ddir), "--path", str(BUNDLE / model / "checkpoint.pt"), "--source-lang", src,
         "--target-lang", tgt, "--gen-subset", split, "--beam", str(beam), "--batch-size", str(batch),
         "--post-process", "sentencepiece",
         # batches of exactly B sentences (fairseq's default multiple of 8 drops a last batch < 8)
         "--required-batch-size-multiple", "1"]
    if ngram:
        a += ["--no-repeat-ngram-size", str(ngram)]
    if device == "cpu":
        a += ["--cpu"]
    if precision == "fp16":
        a += ["--fp16"]
    return a + list(extra)


def precise_gen_time(r: Run) -> Run:
    """fairseq prints the generation time with 0.1 s resolution, the rates with 4-5 digits:
    recover the time from tokens / (tokens/s) (small cells take only a second or two)."""
    m = TRANSLATED.search(r.stderr or "")
    if m and m["tok_per_s"] and float(m["tok_per_s"]) > 0:
        return replace(r, gen_time=int(m["tokens"].replace(",", "")) / float(m["tok_per_s"]))
    return r


class Generated(NamedTuple):
    run: Run  # its gen_time recovered by precise_gen_time
    peak_gpu_mb: Optional[float]  # None unless measured (CUDA)


class FairseqRunner:
    """Runs fairseq-generate, stock or with the plugin; a context manager (closes what it started)."""

    def generate(self, args: Sequence[str], plugin: bool, plugin_args: Sequence[str] = ()) -> Generated:
        raise NotImplementedError

    def fixed_reference(self, args: Sequence[str]) -> Run:
        """Stock fairseq-generate with only fairseq #4709 fixed (CPU; untimed reference)."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "FairseqRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ProcessRunner(FairseqRunner):
    """One fresh process per run, imports included; on CUDA through GPU_LAUNCH, which prints the
    process's peak GPU memory (its threads are left to torch)."""

    def __init__(self, threads: int, device: str):
        self.device = device
        self.threads = threads if device == "cpu" else None
        self.program = None if device == "cpu" else (sys.executable, "-c", GPU_LAUNCH)

    def generate(self, args, plugin, plugin_args=()):
        r = run_generate(args, plugin, plugin_args, env=QUIET, threads=self.threads, program=self.program)
        return Generated(precise_gen_time(r), _peak_gpu_mb(r.stderr))

    def fixed_reference(self, args):
        return run_generate(args, False, env=QUIET, threads=self.threads, program=FIXED_NGRAM_PROGRAM)


def _peak_gpu_mb(stderr: str) -> Optional[float]:
    """GPU_LAUNCH's report; None for a process run without it."""
    g = re.search(r"SUITE_PEAK_GPU_MB ([\d.]+)", stderr)
    return float(g.group(1)) if g else None


class ForkServerRunner(FairseqRunner):
    """CPU runs of fairseq-generate through benchmarks/fork_server.py (imports paid once per
    server, not per run; see that file).  One server per mode: stock (or stock-routed on
    stack B), plugin, fixed; each started on first use with its mode's environment."""

    def __init__(self, threads: int, scratch: Path):
        self.threads, self.scratch = threads, Path(scratch)
        self.scratch.mkdir(parents=True, exist_ok=True)
        self._procs: Dict[str, subprocess.Popen] = {}
        self._requests = 0

    def generate(self, args, plugin, plugin_args=()):
        cmd, env = generate_command(args, plugin, plugin_args, env=QUIET, threads=self.threads)
        mode = "plugin" if plugin else "stock-routed" if stock_needs_route_around() else "stock"
        return Generated(precise_gen_time(self._request(mode, cmd[1:], env)), None)

    def fixed_reference(self, args):
        cmd, env = generate_command(args, False, env=QUIET, threads=self.threads, program=FIXED_NGRAM_PROGRAM)
        return self._request("fixed", cmd[len(FIXED_NGRAM_PROGRAM):], env)

    def _request(self, mode: str, argv: Sequence[str], env: Dict[str, str]) -> Run:
        p = self._server(mode, env)
        self._requests += 1
        so, se = self.scratch / f"{self._requests}.out", self.scratch / f"{self._requests}.err"
        p.stdin.write(json.dumps(dict(argv=list(argv), stdout=str(so), stderr=str(se))) + "\n")
        p.stdin.flush()
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server {mode} died (see its stderr above)")
        rep = json.loads(line)
        stdout, stderr = so.read_text(), se.read_text()
        so.unlink()
        se.unlink()
        return Run.parse(stdout, stderr, rep["wall"], rep["code"], rep["maxrss_mb"])

    def _server(self, mode: str, env: Dict[str, str]) -> subprocess.Popen:
        if mode not in self._procs:
            self._procs[mode] = subprocess.Popen(
                [sys.executable, str(BENCHMARKS / "fork_server.py"), mode],
                env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return self._procs[mode]

    def close(self):
        for p in self._procs.values():
            p.stdin.close()
            p.wait()
        self._procs = {}


def fairseq_runner(device: str, threads: int, scratch: Path, fork_server: bool) -> FairseqRunner:
    """The fork servers on CPU unless turned off; fresh processes otherwise (and on CUDA,
    which is not fork-safe)."""
    if device == "cpu" and fork_server:
        return ForkServerRunner(threads, scratch)
    return ProcessRunner(threads, device)


class Ct2Runner:
    """CTranslate2: the bundled checkpoint converted once (OUT/work/ct2), then one process per run
    (benchmarks/ct2_worker.py) so that its peak RSS is its own."""

    def __init__(self, work: Path, threads: int, device: str):
        self.work, self.threads, self.device = work, threads, device

    def convert(self, model: str, quant: str) -> Path:
        """Convert with CTranslate2's fairseq converter (cached)."""
        dst = self.work / "ct2" / f"{model}-{quant}"
        if (dst / "model.bin").exists():
            return dst
        src, tgt = MODELS[model]
        conv = Path(sys.executable).parent / "ct2-fairseq-converter"
        cmd = [str(conv), "--model_path", str(BUNDLE / model / "checkpoint.pt"), "--data_dir", str(BUNDLE / model),
               "--source_lang", src, "--target_lang", tgt, "--output_dir", str(dst), "--quantization", quant,
               "--force", "--unsafe_deserialization"]
        env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", PYTHONWARNINGS="ignore")
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"ct2-fairseq-converter failed:\n{p.stderr[-3000:]}")
        return dst

    def translate(self, model_dir: Path, compute_type: str, sources: List[List[str]], beam: int, batch: int,
                  ngram: int) -> dict:
        """translate_batch over the sources (pieces): its time, counts, texts, wall and peak RSS."""
        spec = self.work / "ct2" / "spec.json"
        res = self.work / "ct2" / "result.json"
        spec.write_text(json.dumps(dict(model_dir=str(model_dir), compute_type=compute_type, device=self.device,
                                        threads=self.threads, beam=beam, batch=batch, ngram=ngram,
                                        max_decoding_length=MAX_LEN_B + 1,
                                        sources=sources, out=str(res))))
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(self.threads))
        t0 = time.perf_counter()
        # its own small script: importing this package would import fairseq, which takes longer than
        # the job (see benchmarks/results/NOTES.md, "Import time of torch + fairseq")
        worker = BENCHMARKS / "ct2_worker.py"
        so, se, code, rss = run_measured([sys.executable, str(worker), str(spec)], env, None)
        wall = time.perf_counter() - t0
        if code != 0:
            raise RuntimeError(f"CTranslate2 worker failed ({code}):\n{se[-3000:]}")
        r = json.loads(res.read_text())
        r.update(wall=wall, peak_rss_mb=rss)
        return r
