"""benchmarks/real_sizes.py: its shapes are fairseq's real architectures, its FLOP count, and
``--tiny`` end to end (the same code path as the full-size CPU run and the device kit's
dry run): every cell measured, lossless vs stock, figures and report written."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "real_sizes.py"

# the script's own module, imported without running it (benchmarks/ stays off sys.path)
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import real_sizes as rs
finally:  # the script adds it too
    while str(ROOT / "benchmarks") in sys.path:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize("shape, want", [
    ("bart_large", dict(d=1024, ffn=4096, enc_layers=12, dec_layers=12, vocab=50265)),
    ("transformer_big", dict(d=1024, ffn=4096, enc_layers=6, dec_layers=6, vocab=32768)),
    ("lm_gpt", dict(d=768, ffn=3072, enc_layers=0, dec_layers=12, vocab=50264)),
])
def test_full_size_shapes_are_the_real_architectures(tmp_path, shape, want):
    """Dimensions come from fairseq's architecture defaults, not from this script."""
    assert rs.dims_of(rs.shape_of(shape, tiny=False), tmp_path) == want


def test_cnndm_recipe_flags(tmp_path):
    c = rs.CELLS["bart_large"]
    s = rs.shape_of(c.shape, tiny=False)
    a = rs.generate_args(c, s, tmp_path, tmp_path / "m.pt", 2, "cpu", "fp32")
    flat = " ".join(a)
    for flags in ("--beam 4", "--lenpen 2.0", "--min-len 55", "--max-len-b 140", "--no-repeat-ngram-size 3"):
        assert flags in flat
    lens = rs.source_lengths(s, 4)
    assert min(lens) == 512 and max(lens) <= 1024


def test_lm_flops_count_prompt_once_and_new_tokens_per_hypothesis():
    dims = dict(d=4, ffn=8, vocab=10, enc_layers=0, dec_layers=1)
    no_prompt = rs.lm_matmul_flops(dims, 0, 3, 1, 1)
    # each new token: 8d^2 + 4df layer GEMMs + 2dV output projection + 4 d per attended position
    assert no_prompt == 3 * (8 * 16 + 4 * 32 + 2 * 40) + 4 * 4 * (1 + 2 + 3)
    assert rs.lm_matmul_flops(dims, 0, 3, 4, 1) == 4 * no_prompt
    assert rs.lm_matmul_flops(dims, 0, 3, 1, 5) == 5 * no_prompt
    prompt_part = rs.lm_matmul_flops(dims, 2, 3, 4, 1) - 4 * rs.lm_matmul_flops(dims, 0, 3, 1, 1)
    assert prompt_part > 0  # the prompt, plus longer attention spans of the new tokens


@pytest.mark.long  # the script end to end; its limits and cells have unit tests here
def test_tiny_end_to_end(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--threads", "1", "--out", str(out),
                        "--work", str(work)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads((out / "real_sizes_cpu_tiny.json").read_text())
    assert res["tiny"] is True and res["machine"]["device"] == "cpu"
    assert [c["cell"] for c in res["cells"]] == list(rs.CELLS)
    for c in res["cells"]:
        assert c["lossless"] is True, (c["cell"], c["differences"])
        assert c["lines_compared"] > 0
        assert c["ratio"] > 0 and c["limit_s"] > 0
        for who in ("stock", "fastgen"):
            assert c[who]["gen_s"] > 0 and c[who]["x_limit"] > 0 and c[who]["peak_rss_mb"] > 0
    cells = {c["cell"]: c for c in res["cells"]}
    # lengths forced as designed: CNN/DM to --max-len-b (+ EOS), translation to the batch's
    # longest source (+ EOS), the LM to prompt + new tokens (+ EOS)
    bart, big = rs.shape_of("bart_large", True), rs.shape_of("transformer_big", True)
    lm = rs.shape_of("lm_gpt", True)
    assert cells["bart_large"]["out_tokens_mean"] == bart.max_len_b + 1
    assert cells["bart_large"]["reference"] == "stock, #4709 fixed"
    assert cells["transformer_big"]["out_tokens_mean"] == big.src_lens[1] + 1
    for name in ("lm_gpt.beam1", "lm_gpt.beam4", "lm_gpt.sampling"):
        assert cells[name]["out_tokens_mean"] == lm.prompt + lm.new_tokens + 1
    md = (out / "real_sizes_cpu_tiny.md").read_text()
    assert md.count("| yes") == len(rs.CELLS) and "python benchmarks/real_sizes.py --tiny" in md
