"""End to end, as a user runs it: fairseq-generate / fairseq-interactive / hub interface,
stock vs ``--user-dir fairseq_fastgen``, on the bundled models and tiny random ones."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import bundled
from fairseq_fastgen.compare import run_generate, side_by_side

SHARD = ["--gen-subset", "test1"]  # the first 100 of the 1000 test verses


@pytest.mark.parametrize("task", ["es-en", pytest.param("kjv-web", marks=pytest.mark.long)])
def test_bundled_generate_lossless_and_bitwise(task):
    b = bundled(task)
    args = b.args + ["--beam", "5", "--batch-size", "32", "--scoring", "sacrebleu"] + SHARD
    res = side_by_side(args)
    assert res.comparison.lossless, res.comparison.differences[:5]
    assert "BLEU" in res.stock[0].stdout
    assert res.stock[0].stdout.count("\nH-") >= 90
    res = side_by_side(args, plugin_args=["--fastgen-bitwise"])
    assert res.comparison.identical, res.comparison.differences[:5]


def test_generate_needs_no_env_variable(tiny, monkeypatch):
    """With the plugin, --path loads under torch's weights_only default."""
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    r = run_generate([str(tiny.data), "--path", str(tiny.postln), "--beam", "2", "--max-len-b", "10"],
                     plugin=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("\nH-") + r.stdout.startswith("H-") >= 1


def test_missing_checkpoint_is_a_clear_error(tiny):
    r = run_generate([str(tiny.data), "--path", str(tiny.root / "missing.pt")], plugin=True)
    assert r.returncode != 0
    assert "missing.pt" in r.stderr


@pytest.mark.parametrize("opts", [
    ["--beam", "5", "--nbest", "3", "--batch-size", "7"],
    ["--beam", "1", "--batch-size", "1"],
    ["--beam", "5", "--print-alignment", "--batch-size", "16"],
    ["--beam", "5", "--score-reference"],
    ["--beam", "4", "--prefix-size", "1"],
], ids=["nbest3", "greedy-b1", "alignment", "score-reference", "prefix"])
def test_tiny_generate_options(tiny, opts):
    args = [str(tiny.data), "--path", str(tiny.preln), "--max-len-b", "30"] + opts
    res = side_by_side(args)
    assert res.comparison.lossless, res.comparison.differences[:5]
    res = side_by_side(args, plugin_args=["--fastgen-bitwise"])
    assert res.comparison.identical, res.comparison.differences[:5]


def test_ensemble_cli(tiny):
    args = [str(tiny.data), "--path", f"{tiny.postln}:{tiny.preln}", "--beam", "5", "--max-len-b", "20"]
    res = side_by_side(args, plugin_args=["--fastgen-bitwise"])
    assert res.comparison.identical, res.comparison.differences[:5]


def test_interactive_stdin():
    b = bundled("es-en")
    lines = "Y dijo Dios: Sea la luz: y fué la luz.\nEN el principio crió Dios los cielos y la tierra.\n"
    args = [str(b.data), "--path", str(b.path), "--source-lang", "es", "--target-lang", "en",
            "--bpe", "sentencepiece", "--sentencepiece-model", str(b.data.parent / "spm.model"),
            "--beam", "5", "--buffer-size", "2", "--batch-size", "2"]
    res = side_by_side(args, entry="fairseq-interactive", stdin=lines)
    assert res.comparison.lossless, res.comparison.differences[:5]
    assert res.plugin[0].stdout.count("\nH-") + res.plugin[0].stdout.startswith("H-") == 2
    res = side_by_side(args, entry="fairseq-interactive", stdin=lines, plugin_args=["--fastgen-bitwise"])
    assert res.comparison.identical


HUB = r"""
import sys, json, torch, warnings
warnings.filterwarnings("ignore")
from fairseq.models.transformer import TransformerModel
kw = dict(checkpoint_file="checkpoint.pt", data_name_or_path=".", bpe="sentencepiece",
          sentencepiece_model=sys.argv[2], source_lang="es", target_lang="en")
if sys.argv[3] == "plugin":
    kw["user_dir"] = sys.argv[4]
m = TransformerModel.from_pretrained(sys.argv[1], **kw)
m.eval()
sents = ["Y dijo Dios: Sea la luz: y fué la luz.", "Jesús lloró."]
out = m.generate([m.encode(s) for s in sents], beam=5)
print(json.dumps({"translations": m.translate(sents, beam=5),
                  "scores": [float(h[0]["score"]) for h in out]}))
"""


def test_hub_translate():
    import json
    import fairseq_fastgen
    b = bundled("es-en")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    results = {}
    for who in ("stock", "plugin"):
        e = dict(env)
        if who == "stock":
            e["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        p = subprocess.run([sys.executable, "-c", HUB, str(b.data), str(b.data.parent / "spm.model"),
                            who, fairseq_fastgen.__path__[0]], capture_output=True, text=True, env=e)
        assert p.returncode == 0, p.stderr[-2000:]
        results[who] = json.loads(p.stdout.strip().splitlines()[-1])
    assert results["stock"]["translations"] == results["plugin"]["translations"]
    for a, c in zip(results["stock"]["scores"], results["plugin"]["scores"]):
        assert abs(a - c) <= 1e-4
