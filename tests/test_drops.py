"""Inputs skipped as longer than max positions are named and counted (issue 18), on
fairseq-generate, fairseq-interactive and the hub; every output line stays stock's."""
import logging

import pytest

from fairseq_fastgen import drops
from fairseq_fastgen.compare import run_generate, side_by_side
from test_interactive_ranks import TORCHRUN

MAX_SRC = 10  # tokens, eos included: the tiny test set's longer sentences are skipped


def _too_long(tiny, split="test"):
    lines = (tiny.root / "raw" / f"{split}.src").read_text().splitlines()
    return lines, [i for i, l in enumerate(lines) if len(l.split()) + 1 > MAX_SRC]


def test_describe_names_every_id_up_to_a_count():
    assert drops.describe([2], lines=False) == "ids [2]"
    assert drops.describe([2, 5], lines=True) == "input lines [3, 6] (ids [2, 5])"
    many = drops.describe(list(range(120)), lines=False)
    assert many.startswith("ids [0, 1, 2,") and many.endswith(", 49, ... (70 more)]")


def test_tally_counts_across_datasets_and_stays_quiet_without_drops(caplog):
    caplog.set_level(logging.INFO, logger="fairseq_fastgen")
    with drops.counting(lines=True) as tally:
        drops.set_offset(0)
        drops.record([], total=2)
        drops.set_offset(2)
        drops.record([1, 0], total=2, max_positions=(10, 10))
    assert tally.skipped == [2, 3] and tally.seen == 4
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "fairseq-fastgen: 2 of 2 inputs are longer than max_positions=(10, 10) and skipped: "
        "input lines [3, 4] (ids [2, 3])",
        "fairseq-fastgen: skipped 2 of 4 input lines over max positions "
        "(max_positions=(10, 10)): input lines [3, 4] (ids [2, 3])"]
    caplog.clear()
    with drops.counting():
        drops.record([], total=5)
    drops.record([1], total=5)  # outside a counting run: nothing
    assert not caplog.records and drops.current() is None


def test_generate_names_and_counts_skipped_ids(tiny):
    lines, skipped = _too_long(tiny)
    assert 0 < len(skipped) < len(lines)
    args = [str(tiny.data), "--path", str(tiny.postln), "--beam", "2", "--max-len-b", "10",
            "--batch-size", "4", "--required-batch-size-multiple", "1",
            "--max-source-positions", str(MAX_SRC), "--skip-invalid-size-inputs-valid-test"]
    res = side_by_side(args, plugin_args=["--fastgen-bitwise"])
    assert res.comparison.identical, res.comparison.differences[:5]  # output lines unchanged
    err = res.plugin[0].stderr
    ids = ", ".join(map(str, skipped))
    mp = f"max_positions=({MAX_SRC}, 1024)"
    assert (f"fairseq-fastgen: {len(skipped)} of {len(lines)} inputs are longer than {mp} "
            f"and skipped: ids [{ids}]") in err
    summary = (f"fairseq-fastgen: skipped {len(skipped)} of {len(lines)} inputs over max "
               f"positions ({mp}): ids [{ids}]")
    assert err.rstrip().endswith(summary), err[-1500:]
    assert f"Translated {len(lines) - len(skipped)} sentences" in err
    assert "fairseq-fastgen: skipped" not in res.stock[0].stderr


def test_interactive_names_input_lines(tiny, tmp_path):
    lines, skipped = _too_long(tiny)
    lines, skipped = lines[:12], [i for i in skipped if i < 12]
    assert skipped
    path = tmp_path / "in.txt"
    path.write_text("\n".join(lines) + "\n")
    args = [str(tiny.data), "--path", str(tiny.postln), "--beam", "2", "--max-len-b", "10",
            "--source-lang", "src", "--target-lang", "tgt", "--buffer-size", "3",
            "--batch-size", "3", "--max-source-positions", str(MAX_SRC),
            "--skip-invalid-size-inputs-valid-test", "--input", str(path)]
    res = side_by_side(args, entry="fairseq-interactive", plugin_args=["--fastgen-bitwise"])
    assert res.comparison.identical, res.comparison.differences[:5]
    out, err = res.plugin[0].stdout, res.plugin[0].stderr
    shown = sorted(int(l.split("\t")[0][2:]) for l in out.splitlines() if l.startswith("S-"))
    assert shown == [i for i in range(len(lines)) if i not in skipped]
    summary = (f"fairseq-fastgen: skipped {len(skipped)} of {len(lines)} input lines over max "
               f"positions (max_positions=({MAX_SRC}, 1024)): input lines "
               f"[{', '.join(str(i + 1) for i in skipped)}] "
               f"(ids [{', '.join(map(str, skipped))}])")
    assert err.rstrip().endswith(summary), err[-1500:]  # the run's last line
    detail = [l for l in err.splitlines() if "inputs are longer" in l or "inputs is longer" in l]
    assert len(detail) == len({i // 3 for i in skipped})  # one line per buffer with a drop
    # decoding workers (2 threads) and 2 torchrun ranks: the same lines, one summary of all
    for name, program in (("workers", None), ("ranks", TORCHRUN)):
        r = run_generate(args, plugin=True, entry="fairseq-interactive", threads=2,
                         program=program)
        assert r.returncode == 0, (name, r.stderr[-3000:])
        if program is None:
            assert "2 decoding worker(s)" in r.stderr
        got = sorted(int(l.split("\t")[0][2:]) for l in r.stdout.splitlines() if l.startswith("S-"))
        assert got == shown, name
        assert r.stderr.rstrip().endswith(summary), (name, r.stderr[-1500:])


def test_hub_names_the_dropped_input(tiny, caplog):
    from fairseq.models.transformer import TransformerModel

    hub = TransformerModel.from_pretrained(str(tiny.root), tiny.postln.name, str(tiny.data),
                                           source_lang="src", target_lang="tgt")
    long = " ".join(["w5"] * 1100)  # over the model's 1024 positions
    inputs = ["w1 w2 w3", "w4 w5", long, "w6 w7"]
    caplog.set_level(logging.INFO, logger="fairseq_fastgen")
    out = hub.translate(inputs, beam=2, max_len_b=5, skip_invalid_size_inputs=True)
    assert out == hub.translate([inputs[0], inputs[1], inputs[3]], beam=2, max_len_b=5)
    msgs = [r.getMessage() for r in caplog.records if r.name == "fairseq_fastgen"]
    assert msgs == ["fairseq-fastgen: skipped 1 of 4 inputs over max positions "
                    "(max_positions=(1024, 1024)): ids [2]"]
    with pytest.raises(Exception, match="skip this example"):  # stock's error, unchanged
        hub.translate(inputs, beam=2, max_len_b=5)
