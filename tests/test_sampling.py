"""--sampling on the fast path (search/sampling.py, tasks/sampling_seed.py): stock's draws,
the draws near a boundary counted, and a seed per batch under torchrun."""
import sys
from pathlib import Path

import pytest
import torch
from fairseq import search
from fairseq.data import Dictionary

from conftest import bundled
from fairseq_fastgen.compare import compare_outputs, run_generate, side_by_side
from fairseq_fastgen.search.sampling import TOLERANCE, _draw_one, audited_step
from fairseq_fastgen.tasks.sampling_seed import batch_seed

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
GENERATE = str(Path(sys.executable).parent / "fairseq-generate")


def _dict(n=50):
    d = Dictionary()
    for i in range(n):
        d.add_symbol(str(i))
    return d


@pytest.mark.parametrize("topk,topp", [(-1, -1.0), (10, -1.0), (3, -1.0), (-1, 0.9), (-1, 1.0)])
def test_audited_step_draws_as_stock(topk, topp):
    """Same outputs as fairseq's Sampling.step from the same seed, and the same stream after."""
    d = _dict()
    s = search.Sampling(d, topk, topp)
    for beam in (1, 3):
        for step in (0, 1, 4):
            for seed in range(4):
                torch.manual_seed(100 + seed)
                lp = torch.randn(4, beam, len(d)).mul(3).log_softmax(-1)
                sc = torch.randn(4, beam, step).cumsum(-1) if step else torch.zeros(4, beam, 0)
                torch.manual_seed(seed)
                want = s.step(step, lp.clone(), sc)
                want_next = torch.rand(3)
                torch.manual_seed(seed)
                got = audited_step(s, step, lp.clone(), sc)
                assert all(torch.equal(a, b) for a, b in zip(want, got[:3]))
                assert torch.equal(want_next, torch.rand(3))


def test_draw_is_torch_multinomial():
    for shape in [(16, 6003), (5, 2), (3, 767), (7, 1)]:
        p = torch.rand(shape) ** 4
        torch.manual_seed(3)
        want = torch.multinomial(p, 1, replacement=True)
        torch.manual_seed(3)
        got, _ = _draw_one(p)
        assert torch.equal(want, got)
    p = torch.rand(5, 40)[:, :21]  # a truncated (non-contiguous) width, as top-p makes
    torch.manual_seed(4)
    want = torch.multinomial(p, 1, replacement=True)
    torch.manual_seed(4)
    assert torch.equal(want, _draw_one(p)[0])


def test_invalid_probabilities_raise_stock_error():
    d = _dict()
    s = search.Sampling(d)
    lp = torch.randn(2, 1, len(d)).log_softmax(-1)
    lp[1, 0, 3] = float("nan")
    with pytest.raises(RuntimeError) as want:
        s.step(2, lp.clone(), torch.zeros(2, 1, 2))
    with pytest.raises(RuntimeError) as got:
        audited_step(s, 2, lp.clone(), torch.zeros(2, 1, 2))
    assert str(got.value) == str(want.value)


def _probs(*head, n=50):
    p = torch.zeros(1, 1, n)
    for i, v in enumerate(head):
        p[0, 0, i] = v
    p[0, 0, len(head):] = (1 - sum(head)) / (n - len(head))
    return p.log()


def test_boundary_draws_counted():
    d = _dict()
    zero = torch.zeros(1, 1, 1)
    topp = search.Sampling(d, -1, 0.5)
    # the mass before the last kept word is 1e-7 under p: a rounding keeps one word less
    assert int(audited_step(topp, 1, _probs(0.5 - 1e-7, 0.3), zero)[3]) == 1
    assert int(audited_step(topp, 1, _probs(0.4, 0.3), zero)[3]) == 0
    topk = search.Sampling(d, 2, -1.0)
    lp = torch.full((1, 1, len(d)), -10.0)
    lp[0, 0, :3] = torch.tensor([-1.0, -2.0, -2.0 + TOLERANCE / 2])
    assert int(audited_step(topk, 1, lp.clone(), zero)[3]) == 1
    lp[0, 0, 2] = -3.0
    assert int(audited_step(topk, 1, lp.clone(), zero)[3]) == 0
    banned = torch.full((1, 1, len(d)), -float("inf"))
    banned[0, 0, 0] = 0.0  # one word allowed, k = 2: the -inf ties are never drawn
    assert int(audited_step(topk, 1, banned, zero)[3]) == 0
    # the draw: counted when the best two p/q ratios are within the tolerance (two words
    # of equal probability: the two exponentials decide)
    p = torch.tensor([[0.5, 0.5]] * 200)
    torch.manual_seed(0)
    _, near = _draw_one(p)
    torch.manual_seed(0)
    q = torch.empty_like(p).exponential_(1)
    close = (q.max(-1).values - q.min(-1).values) <= TOLERANCE * q.max(-1).values
    assert int(near) == int(close.sum())


def test_batch_seed_depends_on_ids_only():
    a = {"id": torch.tensor([7, 3, 9])}
    assert batch_seed(1, a) == batch_seed(1, {"id": torch.tensor([3, 9, 7])})
    assert batch_seed(1, a) != batch_seed(2, a) != batch_seed(1, {"id": torch.tensor([4])})


RECIPE = ["--beam", "1", "--batch-size", "16", "--sampling", "--sampling-topk", "10",
          "--seed", "7", "--gen-subset", "test1"]


def test_generate_sampling_lossless_and_bitwise():
    """es->en, the back-translation recipe (top-k 10): stock's tokens, on the fast path."""
    b = bundled("es-en")
    res = side_by_side(b.args + RECIPE)
    assert res.comparison.lossless, res.comparison.differences[:5]
    log = res.plugin[0].stderr
    assert "stock generator loop" not in log and "boundary" not in log
    assert res.plugin[0].stdout.count("\nH-") >= 90
    for extra in ([], ["--sampling-topp", "0.9", "--temperature", "0.8"]):
        res = side_by_side(b.args + RECIPE + extra, plugin_args=["--fastgen-bitwise"])
        assert res.comparison.identical, res.comparison.differences[:5]


def test_top_p_boundary_draws_are_reported():
    """kjv->web, top-p 0.9: lossless mode logs the draws it counted near a boundary."""
    b = bundled("kjv-web")
    args = b.args + RECIPE[:5] + ["--sampling-topp", "0.9", "--seed", "7", "--gen-subset", "test1"]
    r = run_generate(args, plugin=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "draw(s) so far within 2e-06 of a boundary" in r.stderr


@pytest.mark.long  # ranks: test_ranks.py; batch reseeding: test_resume's sampling test
def test_sampling_same_output_for_one_and_two_ranks(tiny):
    """Under torchrun each batch is reseeded: 1 rank, 2 ranks and one process with
    --fastgen-sampling-seed batch (and its decoding workers) write the same lines."""
    args = [str(tiny.data), "--path", str(tiny.preln), "--beam", "1", "--sampling",
            "--sampling-topk", "5", "--seed", "3", "--max-len-b", "20", "--batch-size", "2",
            "--required-batch-size-multiple", "1"]
    outs = {}
    for name, program, extra in (
            ("one rank", TORCHRUN + ["1", GENERATE], []),
            ("two ranks", TORCHRUN + ["2", GENERATE], []),
            ("one process", None, ["--fastgen-sampling-seed", "batch", "--fastgen-decode-workers", "1"]),
            ("workers", None, ["--fastgen-sampling-seed", "batch", "--fastgen-decode-workers", "2"])):
        r = run_generate(args, plugin=True, plugin_args=extra, program=program)
        assert r.returncode == 0, (name, r.stderr[-3000:])
        outs[name] = r.stdout
    assert "reseeded before each batch" in r.stderr
    assert "decoding worker(s)" in r.stderr
    base = outs["one rank"]
    assert base.count("\nH-") >= 8
    for name, out in outs.items():
        cmp = compare_outputs(base, out)
        assert cmp.lossless, (name, cmp.differences[:5])
    stream = run_generate(args, plugin=True).stdout  # one process: stock's one stream
    assert not compare_outputs(base, stream).identical
