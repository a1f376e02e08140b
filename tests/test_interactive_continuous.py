"""fairseq-interactive --input FILE through the continuous-batching engine
(tasks/interactive_buffers.py): each buffer's batches share the slots, stock's lines come
out in input order."""
from fairseq_fastgen.compare import side_by_side
from test_interactive_workers import _input
from test_interactive_ranks import _es_en

ENGINE = "fairseq-interactive: continuous batching over each buffer's batches"


def _ids(out):
    return [int(l.split("\t")[0][2:]) for l in out.splitlines() if l.startswith("S-")]


def test_one_process_engine_writes_what_stock_writes(tmp_path):
    # 45 lines of very different lengths in buffers of 9, batches of 3; nbest 2, a
    # length limit some hypotheses reach
    args = _es_en(_input(tmp_path, 45, seed=3),
                  ["--beam", "4", "--nbest", "2", "--buffer-size", "9", "--batch-size", "3",
                   "--max-len-b", "9"])
    res = side_by_side(args, ["--fastgen-continuous", "on", "--fastgen-decode-workers", "1"],
                       entry="fairseq-interactive", threads=1)
    err = res.plugin[0].stderr
    assert ENGINE in err, err[-3000:]
    assert res.comparison.lossless, res.comparison.differences[:5]
    assert _ids(res.plugin[0].stdout) == list(range(45))


def test_workers_run_the_engine_on_their_buffers(tmp_path):
    args = _es_en(_input(tmp_path, 30, seed=4),
                  ["--beam", "5", "--buffer-size", "8", "--batch-size", "4", "--lenpen", "1.3"])
    res = side_by_side(args, ["--fastgen-continuous", "on"], entry="fairseq-interactive",
                       threads=2)
    err = res.plugin[0].stderr
    assert "2 decoding worker(s)" in err and ENGINE in err, err[-3000:]
    assert res.comparison.lossless, res.comparison.differences[:5]
    assert _ids(res.plugin[0].stdout) == list(range(30))


def test_engine_off_says_why(tmp_path):
    # constraints are not served by the engine (nor by the fast path): stock's per-batch
    # code, one log line
    path = tmp_path / "in.es"
    path.write_text("Y dijo Dios: Sea la luz\tlight\nluz\tlight\n")
    args = _es_en(path, ["--beam", "3", "--buffer-size", "2", "--batch-size", "2",
                         "--constraints"])
    res = side_by_side(args, ["--fastgen-continuous", "on", "--fastgen-decode-workers", "1"],
                       entry="fairseq-interactive", threads=1)
    err = res.plugin[0].stderr
    assert ("fairseq-interactive: continuous batching off: search strategy "
            "LexicallyConstrainedBeamSearch") in err, err[-3000:]
    assert res.comparison.lossless, res.comparison.differences[:5]
