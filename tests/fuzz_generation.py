"""Differential fuzzing of generation options: stock fairseq vs fairseq-fastgen, in-process.

:func:`cases` (hypothesis) draws a :class:`Case`: a tiny random model, source sentences
(empty, one token repeated, over the model's positions with or without skipping, mixed),
fairseq's batching (``--batch-size``, ``--max-tokens``), generation options,
``--fastgen-*`` switches (the developer ones included: kernels, guard) and 1 or 2 torch threads.  :func:`check` builds both generators through
``task.build_generator``, decodes every batch with both and returns the problems, as
docs/lossless.md defines them: stock's exception type when stock raises; per sentence the
same number of hypotheses, identical tokens and alignments, scores within 1e-4 (bitwise:
equal).  Differing tokens are a near-tie (reported, not a failure) only in lossless mode
when the stock model rescores both within 1e-4, as ``fairseq_fastgen.compare`` does.
``--no-repeat-ngram-size``: stock's CPU blocker bans nothing (fairseq #4709), so stock gets
it with only #4709 fixed (``corrected_stock_loop``, tests/test_ngram_e2e.py's reference)
unless the plugin runs stock's own blocker.  ``--fastgen-continuous on``: the batches go
through the continuous-batching engine as one stream.
"""
import math
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from hypothesis import strategies as st

from fairseq_fastgen.compare import score_tolerance
from fairseq_fastgen.config import FastGenConfig
from fairseq_fastgen.search.ngram_blocker import corrected_stock_loop

TOL = 1e-4
MODELS = ("postln", "preln", "bart", "short", "ensemble")
SHORT_POSITIONS = 24  # the "short" model's --max-source/target-positions
VOCAB_WORDS = 12  # sources use the first words of the dictionary: repeats are likely


# ---- what one example is ----------------------------------------------------------------

@dataclass
class Case:
    model: str
    sources: List[List[int]]  # word indices (offsets into the dictionary's words)
    targets: List[List[int]]  # the references --prefix-size takes its prefix from
    gen: Dict[str, object]  # fairseq generation options (build_generator's args)
    fastgen: Dict[str, object]  # FastGenConfig overrides
    batch_size: int = 8
    max_tokens: Optional[int] = None
    skip_invalid: bool = True  # --skip-invalid-size-inputs-valid-test
    prefix_size: int = 0
    seed: int = 0
    threads: int = 1  # torch threads of both sides (users run several: other GEMM blockings)


@dataclass
class Result:
    problems: List[str] = field(default_factory=list)
    near_ties: List[str] = field(default_factory=list)
    sentences: int = 0
    stock_error: Optional[str] = None


def _sentences(draw, n_min=1):
    """A source set: each of empty, one token repeated, long (over the short model's
    positions) or of a random length, in any mix."""
    n = draw(st.integers(n_min, 12))
    word = st.integers(-1, VOCAB_WORDS - 1)  # -1: <unk>
    out = []
    for _ in range(n):
        kind = draw(st.sampled_from(["mixed", "mixed", "empty", "repeat", "long"]))
        if kind == "empty":
            out.append([])
        elif kind == "repeat":
            out.append([draw(word)] * draw(st.integers(1, 20)))
        elif kind == "long":
            out.append(draw(st.lists(word, min_size=SHORT_POSITIONS - 2, max_size=SHORT_POSITIONS + 8)))
        else:
            out.append(draw(st.lists(word, min_size=1, max_size=16)))
    return out


def _rare(draw, k: int) -> bool:
    """True about once in k+1 draws (hypothesis favours 0, the simplest value: False)."""
    return draw(st.integers(0, k)) == k


@st.composite
def search_options(draw) -> Dict[str, object]:
    """fairseq's generation options, as fairseq-generate's flags set them."""
    beam = draw(st.integers(1, 6))
    gen = dict(beam=beam, nbest=draw(st.integers(1, beam)))
    if draw(st.booleans()):
        gen["lenpen"] = draw(st.sampled_from([0.0, 0.6, 1.0, 2.0]))
    if draw(st.booleans()):
        gen["unkpen"] = draw(st.sampled_from([-2.0, 1.5, 100.0]))
    if _rare(draw, 3):  # above the length limit: stock's own assertion
        gen["min_len"] = draw(st.sampled_from([1, 2, 3, 5, 10, 25]))
    gen["max_len_a"] = draw(st.sampled_from([0, 0.5, 1.0, 1.2]))
    # 0 with max_len_a 0: a limit of 0, under the default min_len (stock's assertion)
    gen["max_len_b"] = draw(st.sampled_from([200, 10, 30, 5, 3, 2, 1, 0]))
    if draw(st.booleans()):
        gen["no_repeat_ngram_size"] = draw(st.integers(0, 4))
    if draw(st.booleans()):
        gen["temperature"] = draw(st.sampled_from([0.5, 0.7, 1.3]))
    strategy = draw(st.sampled_from(["beam"] * 6 + ["match", "sampling", "diverse", "siblings"]))
    if strategy == "match":
        gen["match_source_len"] = True
    elif strategy == "sampling":
        gen["sampling"] = True
        if draw(st.booleans()):
            gen["sampling_topk"] = draw(st.integers(1, 20))
        elif draw(st.booleans()):
            gen["sampling_topp"] = draw(st.sampled_from([0.3, 0.9, 1.0]))
    elif strategy == "diverse":
        gen["diverse_beam_groups"] = draw(st.integers(1, beam))
        gen["diverse_beam_strength"] = draw(st.sampled_from([0.0, 0.5, 2.0]))
    elif strategy == "siblings":
        gen["diversity_rate"] = draw(st.sampled_from([0.0, 0.5, 1.0]))
    if _rare(draw, 7):
        gen["print_alignment"] = "hard"
    return gen


@st.composite
def fastgen_options(draw) -> Dict[str, object]:
    """``--fastgen-*`` switches (the ones that act in a generator built by hand)."""
    opts = dict(bitwise=draw(st.booleans()),
                aggressive=draw(st.sampled_from(["off", "on", "auto"])),
                continuous=draw(st.sampled_from(["off", "on"])))
    for key in ("fast_decoder", "vocab_pad"):
        if _rare(draw, 4):
            opts[key] = False
    if _rare(draw, 4):
        opts["attention"] = True
    opts["ngram_blocker"] = draw(st.sampled_from(["auto", "auto", "torch", "stock"]))
    if _rare(draw, 15):
        opts["enabled"] = False
    # the kernels: C++ step and its parts, GEMM kernel and guard, packed weights.  Not the
    # unguarded oneDNN ablation (margin_guard 0), whose output may differ at near-ties;
    # decoding workers are fairseq-generate's (tests/test_decode_workers.py, against stock)
    for key in ("native_step", "fused_cross_attention", "native_candidates"):
        if _rare(draw, 5):
            opts[key] = False
    opts["gemm"] = draw(st.sampled_from(["auto", "auto", "mkl", "onednn"]))
    if _rare(draw, 4):
        opts["margin_guard"] = 1e-3
    if _rare(draw, 4):
        opts["packed_gemm_mb"] = draw(st.sampled_from([0, 1]))
    return opts


@st.composite
def cases(draw) -> Case:
    sources = _sentences(draw)
    # a prefix longer than its reference takes eos (stock copies beams) or padding (a
    # -inf score: stock's "step < max_len" assertion), so most references are long enough
    targets = [[] if _rare(draw, 5) else draw(st.lists(st.integers(-1, VOCAB_WORDS - 1),
                                                        min_size=4, max_size=8))
               for _ in sources]
    longest = max(len(s) for s in sources + targets) + 1  # a pair's size: its longer side
    max_tokens = None
    if draw(st.booleans()):
        max_tokens = draw(st.integers(longest, 4 * longest + 16))
    return Case(model=draw(st.sampled_from(MODELS)), sources=sources, targets=targets,
                gen=draw(search_options()), fastgen=draw(fastgen_options()),
                batch_size=draw(st.integers(1, 16)), max_tokens=max_tokens,
                skip_invalid=draw(st.booleans()), prefix_size=draw(st.sampled_from([0, 0, 1, 2, 4])),
                seed=draw(st.integers(0, 2**16)), threads=draw(st.sampled_from([1, 1, 2])))


# ---- the batches ------------------------------------------------------------------------

def _encode(words: List[int], d) -> torch.Tensor:
    ids = [d.unk() if w < 0 else d.nspecial + w for w in words]
    return torch.tensor(ids + [d.eos()], dtype=torch.long)


def make_batches(case: Case, task, models) -> List[dict]:
    """fairseq-generate's batches of the case's sentences (its iterator, in order)."""
    from fairseq import utils
    from fairseq.data import LanguagePairDataset

    sd, td = task.source_dictionary, task.target_dictionary
    src = [_encode(s, sd) for s in case.sources]
    tgt = [_encode(t, td) for t in case.targets]
    ds = LanguagePairDataset(src, [len(s) for s in src], sd, tgt, [len(t) for t in tgt], td,
                             left_pad_source=True, left_pad_target=False)
    max_positions = None
    if case.skip_invalid:  # else: sources over the limit reach the models
        max_positions = utils.resolve_max_positions(task.max_positions(),
                                                    *[m.max_positions() for m in models])
    itr = task.get_batch_iterator(
        dataset=ds, max_tokens=case.max_tokens, max_sentences=case.batch_size,
        max_positions=max_positions, ignore_invalid_inputs=True, required_batch_size_multiple=1,
        seed=1, disable_iterator_cache=True).next_epoch_itr(shuffle=False)
    out = list(itr)
    if case.gen.get("diverse_beam_groups", -1) > 0:
        for b in out:  # fairseq's DiverseBeamSearch indexes by position in the batch
            b["id"] = torch.arange(len(b["id"]))
    return out


# ---- the two sides ----------------------------------------------------------------------

class FixedStockBlocker(torch.nn.Module):
    """fairseq's CPU n-gram blocker with only #4709 fixed: the lossless reference."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, tokens, lprobs, bsz: int, beam_size: int, step: int):
        return corrected_stock_loop(tokens, lprobs, bsz, beam_size, step, self.n)


def build_pair(case: Case, task, models):
    """(stock generator or its build exception, plugin generator or its build exception,
    FastGenConfig), both through ``task.build_generator`` as ``conftest.generators`` does."""
    from fairseq.tasks import FairseqTask
    from fairseq_fastgen import run_config

    fastgen = FastGenConfig(log_fallbacks=False).replace(**case.fastgen)
    built = []
    for side in ("stock", "plugin"):
        try:
            if side == "stock":
                built.append(FairseqTask.build_generator.__wrapped__(task, models, Namespace(**case.gen)))
            else:
                with run_config.run(fastgen):
                    built.append(task.build_generator(models, Namespace(**case.gen)))
        except Exception as e:  # noqa: BLE001 - option errors are compared, stock vs plugin
            built.append(e)
    stock = built[0]
    n = case.gen.get("no_repeat_ngram_size", 0)
    # the plugin switched off, or with --fastgen-tune ngram_blocker=stock, is stock as shipped
    if not isinstance(stock, Exception) and n > 0 and fastgen.enabled and (
            fastgen.ngram_blocker != "stock"):
        stock.repeat_ngram_blocker = FixedStockBlocker(n)
    return stock, built[1], fastgen


def _decode_each(gen, models, batches, prefixes, seed, boundary=None):
    """Per batch: its hypotheses, or the exception generate raised (the rest not run).
    ``boundary`` (a list) gets each batch's sampling boundary draws (search/sampling.py)."""
    out = []
    for b, p in zip(batches, prefixes):
        torch.manual_seed(seed)
        before = getattr(gen, "sampling_boundary_draws", 0)
        try:
            out.append(gen.generate(models, b, prefix_tokens=p))
        except Exception as e:  # noqa: BLE001 - the exception is what is compared
            out.append(e)
            break
        finally:
            if boundary is not None:
                boundary.append(getattr(gen, "sampling_boundary_draws", 0) - before)
    return out


def _decode_stream(fast, task, models, batches, prefixes, seed):
    """The plugin's batches through the continuous engine, when it serves them."""
    from fairseq_fastgen.search.continuous import ContinuousBeamSearch, unsupported

    if unsupported(fast, task) is not None:
        return _decode_each(fast, models, batches, prefixes, seed)
    regular = lambda s, p: fast.generate(models, s, prefix_tokens=p)  # noqa: E731
    torch.manual_seed(seed)
    try:
        return [h for _, h in ContinuousBeamSearch(fast, regular=regular).run(zip(batches, prefixes))]
    except Exception as e:  # noqa: BLE001
        return [e]


def check(case: Case, pool: Dict[str, Namespace]) -> Result:
    """Decode the case with stock and the plugin; the problems found (empty: lossless)."""
    task, models = pool[case.model].task, pool[case.model].models
    res = Result()
    for m in models:  # a generator sets BART's beam size only when > 1: undo the last case's
        if hasattr(m, "set_beam_size"):
            m.set_beam_size(1)
    stock, fast, fastgen = build_pair(case, task, models)
    if isinstance(stock, Exception) or isinstance(fast, Exception):
        _compare_errors([stock], [fast], "build", res)
        return res
    batches = make_batches(case, task, models)
    prefixes = [b["target"][:, : case.prefix_size] if case.prefix_size else None for b in batches]
    threads = torch.get_num_threads()
    torch.set_num_threads(case.threads)
    try:
        expected = _decode_each(stock, models, batches, prefixes, case.seed)
        boundary: List[int] = []
        if fastgen.continuous == "on":
            got = _decode_stream(fast, task, models, batches, prefixes, case.seed)
        else:
            got = _decode_each(fast, models, batches, prefixes, case.seed, boundary)
    finally:
        torch.set_num_threads(threads)
    if not _compare_errors(expected, got, "generate", res):
        _compare_runs(expected, got, batches, fastgen.bitwise, case, models, res, boundary)
    return res


def _compare_errors(expected, got, what: str, res: Result) -> bool:
    """Stock's first exception must be the plugin's (same type); the plugin must not raise
    where stock does not.  True when either side raised."""
    s_err = next((e for e in expected if isinstance(e, Exception)), None)
    f_err = next((e for e in got if isinstance(e, Exception)), None)
    if s_err is None and f_err is None:
        return False
    name = lambda e: "no error" if e is None else f"{type(e).__name__}: {str(e)[:200]}"  # noqa: E731
    if s_err is not None:
        res.stock_error = f"{what}: {name(s_err)[:100]}"
    if s_err is None or f_err is None or type(s_err) is not type(f_err):
        res.problems.append(f"{what}: stock {name(s_err)}; plugin {name(f_err)}")
    return True


def _compare_runs(expected, got, batches, bitwise, case, models, res, boundary=()):
    if len(got) != len(expected):
        res.problems.append(f"{len(expected)} batches decoded by stock, {len(got)} by the plugin")
        return
    for i, (b, s_out, f_out) in enumerate(zip(batches, expected, got)):
        if i < len(boundary) and boundary[i] and not bitwise:
            # lossless sampling: the plugin counted a draw within a rounding of a boundary;
            # from there its batch may differ (reported, not a failure)
            res.near_ties.append(f"batch {i}: {boundary[i]} sampling boundary draw(s)")
            continue
        if len(s_out) != len(f_out):
            res.problems.append(f"{len(s_out)} sentences (stock), {len(f_out)} (plugin)")
        for j, (s_hyps, f_hyps) in enumerate(zip(s_out, f_out)):
            res.sentences += 1
            where = f"sentence {int(b['id'][j])}"
            if len(s_hyps) != len(f_hyps):
                res.problems.append(f"{where}: {len(s_hyps)} hypotheses (stock), {len(f_hyps)} (plugin)")
                continue
            for r, (hs, hf) in enumerate(zip(s_hyps, f_hyps)):
                diff = hypo_difference(hs, hf, bitwise)
                if diff is None:
                    continue
                tie = None
                if not bitwise and not torch.equal(hs["tokens"], hf["tokens"]):
                    tie = near_tie(case, models, b, j, hs, hf)
                msg = f"{where} hypothesis {r}: {diff}"
                (res.near_ties if tie else res.problems).append(msg + (f" ({tie})" if tie else ""))


def hypo_difference(hs, hf, bitwise: bool) -> Optional[str]:
    """Why two hypotheses are not equal under the contract (None: they are)."""
    if not torch.equal(hs["tokens"], hf["tokens"]):
        return f"tokens {hs['tokens'].tolist()} != {hf['tokens'].tolist()}"
    a, b = hs["score"], hf["score"]
    pa, pb = hs["positional_scores"], hf["positional_scores"]
    if bitwise:
        if not (torch.equal(a, b) and torch.equal(pa, pb)):
            return f"scores not bitwise equal: {float(a)!r} vs {float(b)!r}"
    else:
        if not _close(float(a), float(b), score_tolerance(float(a))):
            return f"score {float(a)} vs {float(b)}"
        if pa.shape != pb.shape or not all(
                _close(x, y, t) for x, y, t in zip(pa.tolist(), pb.tolist(), positional_tolerance(pa))):
            return f"positional scores {pa.tolist()} vs {pb.tolist()}"
    sa, sb = hs.get("alignment"), hf.get("alignment")
    same = torch.equal(sa, sb) if isinstance(sa, torch.Tensor) and isinstance(sb, torch.Tensor) else (
        sa is None and sb is None) or (not isinstance(sa, torch.Tensor) and sa == sb)
    return None if same else f"alignment {sa} vs {sb}"


def _close(a: float, b: float, tol: float = TOL) -> bool:
    return a == b or abs(a - b) <= tol or (math.isnan(a) and math.isnan(b))


def positional_tolerance(pos: torch.Tensor) -> List[float]:
    """Per positional score: TOL, or two float32 units in the last place of the cumulative
    scores it is the difference of, where that is more (docs/lossless.md: past |1,024| one
    unit is 1.2e-4 already)."""
    cum = pos.double().cumsum(0).abs()
    big = torch.maximum(cum, torch.cat([cum.new_zeros(1), cum[:-1]]))
    ulp = torch.pow(2.0, torch.floor(torch.log2(big.clamp(min=1.0))) - 23)
    return torch.where(big.isfinite(), (2 * ulp).clamp(min=TOL), torch.full_like(big, TOL)).tolist()


# ---- near-ties ----------------------------------------------------------------------------

def near_tie(case: Case, models, batch, j: int, hs, hf) -> Optional[str]:
    """The near-tie proof of two differing hypotheses (None: not a near-tie): both rescored
    with the stock models under the generator's objective (ensemble log-probabilities at the
    temperature, unk penalty, length-normalized), within 1e-4.  Only for beam search, whose
    scores are that objective (diverse search runs stock's loop on both sides; sampling's
    differences are accepted only in a batch with a counted boundary draw)."""
    g = case.gen
    if g.get("sampling") or g.get("diverse_beam_groups", -1) > 0 or g.get("diversity_rate", -1) > -1:
        return None
    src = batch["net_input"]["src_tokens"][j]
    src = src[src.ne(models[0].encoder.padding_idx)] if hasattr(models[0], "encoder") else src
    sa, sb = (rescore(models, src, h["tokens"], g) for h in (hs, hf))
    if abs(sa - sb) <= TOL:
        return f"near-tie: stock model rescores {sa:.6f} vs {sb:.6f}"
    return None


def rescore(models, src: torch.Tensor, hyp: torch.Tensor, gen) -> float:
    """Sentence score of ``hyp`` (ending in eos) for ``src`` under the stock models.
    src: (S,) int64 unpadded; hyp: (T,) int64."""
    eos = int(hyp[-1])
    prev = torch.cat([hyp.new_tensor([eos]), hyp[:-1]]).unsqueeze(0)
    temperature = gen.get("temperature", 1.0)
    with torch.no_grad():
        per_model = []
        for m in models:
            logits, _ = m(src.unsqueeze(0), torch.tensor([src.numel()]), prev)
            lp = m.get_normalized_probs((logits / temperature, None), log_probs=True)[0]
            per_model.append(lp.gather(-1, hyp.unsqueeze(-1)).squeeze(-1))
        pos = torch.logsumexp(torch.stack(per_model), 0) - math.log(len(models))
    unk = models[0].decoder.dictionary.unk()
    pos = pos - hyp.eq(unk).float() * gen.get("unkpen", 0.0)
    return float(pos.sum() / (hyp.numel() ** gen.get("lenpen", 1.0)))
