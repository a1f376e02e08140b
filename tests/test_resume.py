"""--fastgen-resume-dir: a run killed mid-way and started again with the same command
writes what an uninterrupted run writes, and that is stock fairseq-generate's output (run
in the same test); another command against the directory is an error."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import bundled
from fairseq_fastgen.compare import compare_outputs, generate_command, run_generate
from fairseq_fastgen.tasks import resume

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(Path(sys.executable).parent / "fairseq-generate")]


def _args(extra=(), batch=2):
    """100 verses in 100 / batch batches: a window (16 batches of each rank) is saved
    when the window after next starts, so a run must have 3 windows or more per rank for
    a kill to come before the end (batch 2 in one process, batch 1 on two ranks)."""
    b = bundled("es-en")
    return b.args + ["--gen-subset", "test1", "--beam", "5", "--batch-size", str(batch),
                     "--required-batch-size-multiple", "1", *extra]


def _lines(out: str):
    return [l for l in out.splitlines() if l[:2] in ("S-", "T-", "H-", "D-", "P-")]


def _killed_run(args, resume_dir: Path, program=None, threads=None, plugin=()) -> str:
    """Start the run, SIGKILL its whole process group once a window is saved; its stdout."""
    cmd, env = generate_command(args, plugin=True, plugin_args=[
        *plugin, "--fastgen-resume-dir", str(resume_dir)], program=program, threads=threads)
    out = resume_dir.parent / f"{resume_dir.name}.killed.out"
    with open(out, "w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 240
        while not (resume_dir / "window-000000.pkl").exists():
            assert p.poll() is None and time.time() < deadline, "no window saved"
            time.sleep(0.1)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    return out.read_text()


@pytest.mark.parametrize("program", [None, TORCHRUN], ids=["one-process", "torchrun-2-ranks"])
def test_killed_run_resumes_to_the_uninterrupted_output(tmp_path, program):
    # byte for byte: one process in bitwise mode (one thread, so that the machine's load
    # cannot stall an OpenMP team); two ranks in lossless mode, one thread each either way
    threads = 1 if program is None else None
    args, plugin = (_args(), ["--fastgen-bitwise"]) if program is None else (_args(batch=1), [])
    stock = run_generate(args, plugin=False, threads=threads)
    full = run_generate(args, plugin=True, plugin_args=plugin, program=program, threads=threads)
    assert stock.returncode == 0 and full.returncode == 0, (stock.stderr + full.stderr)[-3000:]
    d = tmp_path / "resume"
    partial = _killed_run(args, d, program, threads, plugin)
    assert partial.count("\nH-") < full.stdout.count("\nH-")  # killed before the end
    again = run_generate(args, plugin=True, plugin_args=plugin + ["--fastgen-resume-dir", str(d)],
                         program=program, threads=threads)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resume: " in again.stderr + again.stdout
    assert _lines(again.stdout) == _lines(full.stdout)  # nothing lost, doubled or moved
    against_stock = compare_outputs(stock.stdout, again.stdout)
    assert against_stock.lossless, against_stock.differences[:5]
    if plugin:  # bitwise: stock's lines
        assert _lines(again.stdout) == _lines(stock.stdout)
    score = [l for l in full.stdout.splitlines() if l.startswith("Generate test1")]
    assert score and score == [l for l in again.stdout.splitlines() if l.startswith("Generate test1")]
    assert again.sentences == full.sentences == 100
    # a finished directory: the same command again decodes nothing and writes it all
    done = run_generate(args, plugin=True, plugin_args=plugin + ["--fastgen-resume-dir", str(d)],
                        program=program, threads=threads)
    assert done.returncode == 0 and _lines(done.stdout) == _lines(full.stdout)


# lossless resume in the gate: test_killed_run_resumes_to_the_uninterrupted_output[torchrun-2-ranks]
@pytest.mark.parametrize("extra", [[], ["--fastgen-continuous", "on", "--fastgen-decode-workers", "1"]],
                         ids=["decoding-workers", "continuous"])
@pytest.mark.long
def test_lossless_mode_resumes_too(tmp_path, extra):
    args = _args()
    stock = run_generate(args, plugin=False)
    full = run_generate(args, plugin=True, plugin_args=extra)
    d = tmp_path / "resume"
    _killed_run(args, d, plugin=extra)
    again = run_generate(args, plugin=True, plugin_args=extra + ["--fastgen-resume-dir", str(d)])
    assert again.returncode == 0, again.stderr[-3000:]
    for reference in (full, stock):
        cmp = compare_outputs(reference.stdout, again.stdout)
        assert cmp.lossless, cmp.differences[:5]
    assert [l.split("\t")[0] for l in _lines(again.stdout)] == \
        [l.split("\t")[0] for l in _lines(full.stdout)]


def test_sampling_resumes_to_the_output_of_one_run(tmp_path):
    """--sampling with a resume dir reseeds each batch (sampling_seed.py): the skipped
    batches do not shift the draws of the others."""
    args = _args(["--fastgen-bitwise"])
    args[args.index("--beam") + 1] = "1"
    args += ["--sampling", "--sampling-topk", "10", "--seed", "5"]
    full = run_generate(args, plugin=True, plugin_args=["--fastgen-sampling-seed", "batch"],
                        threads=1)
    assert full.returncode == 0, full.stderr[-3000:]
    d = tmp_path / "resume"
    partial = _killed_run(args, d, threads=1)
    assert partial.count("\nH-") < full.stdout.count("\nH-")
    again = run_generate(args, plugin=True, plugin_args=["--fastgen-resume-dir", str(d)],
                         threads=1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "reseeded before each batch" in again.stderr
    assert _lines(again.stdout) == _lines(full.stdout)


def test_another_command_against_the_directory_is_an_error(tmp_path):
    d = tmp_path / "resume"
    first = run_generate(_args(["--max-len-b", "5"]), plugin=True,
                         plugin_args=["--fastgen-resume-dir", str(d)])
    assert first.returncode == 0, first.stderr[-3000:]
    other = run_generate(_args(["--max-len-b", "6"]), plugin=True,
                         plugin_args=["--fastgen-resume-dir", str(d)])
    assert other.returncode != 0
    assert "holds the progress of another command" in other.stderr
    assert "generation.max_len_b: 5 before, 6 now" in other.stderr


def test_window_files_are_whole_and_stale_temporaries_go(tmp_path):
    fp = {"generation": {"beam": 5}}
    d = resume.ResumeDir(str(tmp_path), fp)
    (tmp_path / "window-000001.pkl.tmp-123").write_bytes(b"half")
    d.save(0, [(("text", []), (None, None, [], None, []))])
    d = resume.ResumeDir(str(tmp_path), fp)
    assert not list(tmp_path.glob("*.tmp-*"))
    assert len(list(d.saved())) == 1
    with pytest.raises(resume.ResumeMismatch, match="generation.beam: 5 before, 4 now"):
        resume.ResumeDir(str(tmp_path), {"generation": {"beam": 4}})


def test_counts_read_the_best_hypothesis_of_each_sentence():
    side_packed = (object(), None, [3, 4, 5], None, [2, 1])  # sentence 0: 2 hypotheses
    side_odd = (None, None, [0], [[1, 2]], [1])
    recs = [(None, side_packed), (None, side_odd)]
    assert resume.counts(recs) == (3, 3 + 5 + 2, True)
