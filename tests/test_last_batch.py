"""fairseq #5036: batch_by_size drops a final batch smaller than the required multiple.
The plugin warns about it, and with --fastgen-keep-last-batch generates it too."""
import numpy as np
import pytest

from conftest import bundled
from fairseq_fastgen.compare import parse_output, run_generate


def test_wrapper_keeps_or_reports_the_tail(caplog):
    from fairseq.data import data_utils
    import sys
    inst = sys.modules["fairseq_fastgen.install"]  # the package's `install` is the function
    from fairseq_fastgen.last_batch import guard_batch_by_size

    original = inst._originals.get((data_utils, "batch_by_size"), data_utils.batch_by_size)
    idx = np.arange(100, dtype=np.int64)
    kw = dict(max_tokens=None, max_sentences=32, required_batch_size_multiple=8)
    stock = original(idx, lambda i: 10, **kw)
    if sum(map(len, stock)) == 100:
        pytest.skip("this fairseq keeps the last batch (0.12.2)")
    warn = guard_batch_by_size(original, lambda: False)(idx, lambda i: 10, **kw)
    assert [list(b) for b in warn] == [list(b) for b in stock]
    assert "drops the last 4 of 100 sentences" in caplog.text
    kept = guard_batch_by_size(original, lambda: True)(idx, lambda i: 10, **kw)
    assert [list(b) for b in kept[:-1]] == [list(b) for b in stock]
    assert sorted(np.concatenate(kept).tolist()) == list(range(100))


def test_cli_keep_last_batch():
    b = bundled("es-en")
    args = b.args + ["--gen-subset", "test1", "--beam", "1", "--batch-size", "32", "--max-len-b", "5"]
    stock = run_generate(args, plugin=False, threads=1)
    kept = run_generate(args, plugin=True, plugin_args=["--fastgen-keep-last-batch",
                                                        "--fastgen-bitwise"], threads=1)
    assert stock.returncode == 0 and kept.returncode == 0, kept.stderr[-2000:]
    s, _ = parse_output(stock.stdout)
    k, _ = parse_output(kept.stdout)
    assert len({sid for kind, sid in k if kind == "S"}) == 100
    assert all(k[key] == lines for key, lines in s.items())  # stock's lines, unchanged
