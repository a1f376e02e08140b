"""fairseq-generate under torchrun (2 ranks, gloo, localhost): rank 0 writes what one
process writes, and that is stock fairseq-generate's output (run in the same test); a rank
that fails ends the run."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import bundled
from fairseq_fastgen.compare import compare_outputs, generate_command, run_generate
from fairseq_fastgen.tasks import ranks

GENERATE = str(Path(sys.executable).parent / "fairseq-generate")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            GENERATE]


def _both(args, plugin_args=(), env=None):
    """(one process, two ranks) runs of the plugin; both must succeed, and the one process
    must give stock fairseq-generate's output (lossless; bitwise: the same lines)."""
    stock = run_generate(args, plugin=False, env=env)
    one = run_generate(args, plugin=True, plugin_args=plugin_args, env=env)
    two = run_generate(args, plugin=True, plugin_args=plugin_args, env=env, program=TORCHRUN)
    for r in (stock, one, two):
        assert r.returncode == 0, r.stderr[-3000:]
    against_stock = compare_outputs(stock.stdout, one.stdout)
    assert against_stock.lossless, against_stock.differences[:5]
    if "--fastgen-bitwise" in plugin_args:
        assert _lines(stock.stdout) == _lines(one.stdout)
    return one, two


def _lines(out: str, scores: bool = True):
    """The per-sentence lines in order (without H/D scores and P lines: ``scores`` off)."""
    lines = [l for l in out.splitlines() if l[:2] in ("S-", "T-", "H-", "D-", "P-", "A-")]
    if scores:
        return lines
    cut = [l.split("\t") for l in lines if not l.startswith("P-")]
    return [f[:1] + f[2:] if f[0][:2] in ("H-", "D-") else f for f in cut]


@pytest.mark.parametrize("opts,plugin_opts", [
    # 15 batches (the last one partial, kept): uneven shares, nbest, sacrebleu
    (["--beam", "5", "--nbest", "2", "--batch-size", "7", "--required-batch-size-multiple", "1",
      "--scoring", "sacrebleu"], []),
    # bitwise ranks: also the gate's test_two_ranks_bitwise_and_results_path (tiny model)
    pytest.param(["--beam", "5", "--batch-size", "16"], ["--fastgen-bitwise"], marks=pytest.mark.long),
    # continuous batching: a batch held back by a long sentence delays its window
    pytest.param(["--beam", "4", "--batch-size", "6", "--required-batch-size-multiple", "1"],
                 ["--fastgen-continuous", "on", "--fastgen-decode-workers", "1"], marks=pytest.mark.long),
], ids=["nbest-sacrebleu-uneven", "bitwise", "continuous"])
def test_two_ranks_write_what_one_process_writes(opts, plugin_opts, monkeypatch):
    # bitwise ranks take one default process's thread count (every core), whatever
    # torchrun sets OMP_NUM_THREADS to: so the single process gets its default too
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    b = bundled("es-en")
    one, two = _both(b.args + ["--gen-subset", "test1"] + opts, plugin_opts)
    if "--fastgen-bitwise" in plugin_opts:
        assert _lines(one.stdout) == _lines(two.stdout)  # byte for byte
    cmp = compare_outputs(one.stdout, two.stdout)
    assert cmp.lossless, cmp.differences[:5]
    # same text in the same order (scores: within 1e-4, a rank has fewer torch threads)
    assert _lines(one.stdout, scores=False) == _lines(two.stdout, scores=False)
    assert one.sentences == two.sentences and one.sentences >= 96
    score = [l for l in one.stdout.splitlines() if l.startswith("Generate test1")]
    assert score and score == [l for l in two.stdout.splitlines() if l.startswith("Generate test1")]
    assert "torchrun: rank 0 of 2" in two.stderr + two.stdout
    assert "rank 1:" in two.stderr + two.stdout  # rank 0 reports each rank's share and waits
    if "--fastgen-continuous" in plugin_opts:
        assert "generate pipeline: continuous batching" in two.stderr


def test_two_ranks_bitwise_and_results_path(tiny, tmp_path):
    args = [str(tiny.data), "--path", str(tiny.preln), "--beam", "3", "--max-len-b", "20",
            "--batch-size", "2", "--required-batch-size-multiple", "1"]
    outs = []
    for name, plugin, program in (("stock", False, None), ("one", True, None), ("two", True, TORCHRUN)):
        d = tmp_path / name
        r = run_generate(args + ["--results-path", str(d)], plugin=plugin,
                         plugin_args=["--fastgen-bitwise"], program=program)
        assert r.returncode == 0, r.stderr[-3000:]
        assert sorted(os.listdir(d)) == ["generate-test.txt"]
        outs.append((d / "generate-test.txt").read_text())
    assert _lines(outs[0]) and _lines(outs[0]) == _lines(outs[1]) == _lines(outs[2])  # byte for byte
    assert outs[2].count("\nH-") == outs[1].count("\nH-") == outs[0].count("\nH-")


def test_two_ranks_quiet_score_over_every_sentence(tiny):
    args = [str(tiny.data), "--path", str(tiny.postln), "--beam", "4", "--max-len-b", "20",
            "--batch-size", "3", "--required-batch-size-multiple", "1", "--quiet"]
    one, two = _both(args)
    assert not _lines(two.stdout)
    score = [l for l in one.stdout.splitlines() if l.startswith("Generate test")]
    assert score and score == [l for l in two.stdout.splitlines() if l.startswith("Generate test")]
    assert one.sentences == two.sentences == 40


def test_a_failing_rank_ends_the_run_and_is_named(tiny):
    args = [str(tiny.data), "--path", str(tiny.preln), "--beam", "2", "--max-len-b", "10",
            "--batch-size", "1"]
    cmd, env = generate_command(args, plugin=True, program=TORCHRUN)
    env[ranks.FAULT_ENV] = "1"
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=300)
    assert p.returncode != 0
    assert "planted fault on rank 1" in p.stderr
    assert "rank" in p.stderr and ": 1 (local_rank: 1)" in p.stderr  # torchrun's summary
    assert time.perf_counter() - t0 < 120
    left = subprocess.run(["pgrep", "-f", str(tiny.preln)], capture_output=True, text=True)
    assert left.stdout.strip() == "", "a rank outlived the run"


def test_env_reading():
    assert ranks.from_env({}) is None
    assert ranks.from_env({"RANK": "0", "WORLD_SIZE": "1"}) is None
    r = ranks.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (r.rank, r.world, r.local_rank, r.local_world, r.leader) == (3, 4, 1, 2, False)
    assert ranks.threads_per_rank(r, cores=16) == 8 and ranks.threads_per_rank(r, cores=1) == 1
    assert ranks.threads_per_rank(r, cores=16, bitwise=True) == 16
    with pytest.raises(ValueError, match="RANK=5, WORLD_SIZE=4"):
        ranks.from_env({"RANK": "5", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="not numbers"):
        ranks.from_env({"RANK": "x", "WORLD_SIZE": "4"})
