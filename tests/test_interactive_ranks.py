"""fairseq-interactive --input FILE under torchrun (tasks/interactive_ranks.py): the ranks
share the buffers, rank 0 writes what one process writes, memory does not grow with the
file."""
import random
import sys
from pathlib import Path

import pytest

from conftest import bundled
from fairseq_fastgen.compare import compare_outputs, run_generate, side_by_side

INTERACTIVE = str(Path(sys.executable).parent / "fairseq-interactive")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            INTERACTIVE]
SPANISH = ["Y dijo Dios: Sea la luz: y fué la luz.",
           "EN el principio crió Dios los cielos y la tierra.",
           "Y la tierra estaba desordenada y vacía, y las tinieblas estaban sobre la haz del abismo.",
           "", "Y llamó Dios á la luz Día, y á las tinieblas llamó Noche.", "luz",
           "Y vió Dios que la luz era buena: y apartó Dios la luz de las tinieblas."]


def _es_en(path: Path, extra=()):
    b = bundled("es-en")
    return [str(b.data), "--path", str(b.path), "--source-lang", "es", "--target-lang", "en",
            "--bpe", "sentencepiece", "--sentencepiece-model", str(b.data.parent / "spm.model"),
            "--input", str(path), *extra]


def _no_times(out: str):
    return [l for l in out.splitlines() if l[:2] in ("S-", "H-", "D-", "P-", "A-", "C-")]


def test_two_ranks_write_what_one_process_writes(tmp_path):
    # 45 lines (an empty one, a one-word one) in 7 buffers of 7: the last one short,
    # rank 0 translates 4 of them, rank 1 3
    rng = random.Random(0)
    lines = [rng.choice(SPANISH) for _ in range(45)]
    lines[10] = ""
    src = tmp_path / "in.es"
    src.write_text("\n".join(lines) + "\n")
    args = _es_en(src, ["--beam", "4", "--nbest", "2", "--buffer-size", "7", "--batch-size", "3",
                        "--max-len-b", "12"])
    one = run_generate(args, plugin=True, entry="fairseq-interactive")
    two = run_generate(args, plugin=True, entry="fairseq-interactive", program=TORCHRUN)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    assert "buffer i translated by rank i mod 2" in two.stderr
    assert "rank 1: 3 buffer(s)" in two.stderr
    a, b = _no_times(one.stdout), _no_times(two.stdout)
    ids = [int(l.split("\t")[0][2:]) for l in b if l.startswith("S-")]
    assert ids == list(range(45))  # every line once, in input order
    assert len([l for l in b if l.startswith("H-")]) == 90
    assert [l.split("\t")[0] for l in a] == [l.split("\t")[0] for l in b]
    cmp = compare_outputs(one.stdout, two.stdout)  # W- times are not compared
    assert cmp.lossless, cmp.differences[:5]
    # and lossless against stock fairseq-interactive in one process
    res = side_by_side(args, entry="fairseq-interactive")
    assert res.comparison.lossless, res.comparison.differences[:5]
    assert compare_outputs(res.stock[0].stdout, two.stdout).lossless


def test_standard_input_is_refused_under_torchrun(tmp_path):
    args = _es_en("-")
    r = run_generate(args, plugin=True, entry="fairseq-interactive", program=TORCHRUN,
                     stdin="Y dijo Dios\n")
    assert r.returncode != 0
    assert "under torchrun every rank reads the input: give it as --input FILE" in r.stderr


def _tiny_lines(path: Path, n: int):
    rng = random.Random(n)
    path.write_text("".join(" ".join(f"w{rng.randrange(60)}" for _ in range(rng.randint(1, 12)))
                            + "\n" for _ in range(n)))


@pytest.mark.long  # a long input; the ranks' output: the gate's other tests here
def test_memory_does_not_grow_with_the_input(tiny, tmp_path):
    """20,000 lines against 2,000 under 2 ranks: every line out once, in order; the peak
    resident memory of the run (the launcher and its ranks) within 10%."""
    peaks = {}
    for n in (2000, 20000):
        src = tmp_path / f"in{n}.txt"
        _tiny_lines(src, n)
        args = [str(tiny.data), "--path", str(tiny.postln), "--source-lang", "src",
                "--target-lang", "tgt", "--input", str(src), "--beam", "2", "--max-len-b", "3",
                "--buffer-size", "200", "--batch-size", "50"]
        r = run_generate(args, plugin=True, entry="fairseq-interactive", program=TORCHRUN)
        assert r.returncode == 0, r.stderr[-3000:]
        ids = [int(l.split("\t")[0][2:]) for l in r.stdout.splitlines() if l.startswith("S-")]
        assert ids == list(range(n))
        assert r.stdout.count("\nH-") + r.stdout.startswith("H-") == n
        peaks[n] = r.peak_rss_mb
    assert peaks[20000] <= 1.10 * peaks[2000], peaks
