"""Draft sources for aggressive (draft-and-verify) greedy decoding.

:class:`SourceDrafts` copies from the source (input-guided aggressive decoding, Ge et al.
2022): the last 1..3 generated tokens are looked up among the source's n-grams; after a
match the draft is the source continuation.  All rows at once, on the device, with no
per-row Python: an n-gram match is the AND of shifted token equalities over the
``(rows, src_len)`` grid.  The longest order that matches wins; a unique match is used
as is, several matches are disambiguated by the running alignment (the match nearest to
the source position aligned with the previous token).  When nothing matches (a word the
source does not have), the model's token is taken to have replaced the aligned source
token and the draft continues after it.  At step 0 the draft is the start of the source.
:class:`SubstitutionMemory` learns token substitutions from rejected drafts (KJV "Thy"
-> WEB "Your") and drafts them from the next batch on.  :class:`DraftModelDrafts` drafts
with a small fairseq model instead.  Drafts only decide speed, never output: every
drafted token is verified.
"""
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..models.slot_decoder import SlotDecoder


class Proposal(NamedTuple):
    """Drafts of every row: draft (n, width) int64 tokens to verify; length (n,) int64
    how many of them are drafts; start (n,) int64 where they start (source index, or the
    hypothesis' length for a draft model); orig (n, width) int64 the tokens before
    substitution (what :class:`SubstitutionMemory` learns from; -1: none)."""
    draft: Tensor
    length: Tensor
    start: Tensor
    orig: Tensor


class SourceDrafts:
    """Per-batch state: the source in target ids, right-aligned, and a per-row alignment."""

    MAX_ORDER = 3

    def __init__(self, src_tokens: Tensor, pad: int, id_map: Optional[Tensor] = None,
                 substitutions: Optional[Tensor] = None, *, vocab_size: int):
        """src_tokens: (n, S) source ids (left or right padded); id_map: source id ->
        target id (None when the dictionaries are the same); substitutions: target id ->
        the id to draft instead (:class:`SubstitutionMemory`); vocab_size: the target
        dictionary's size (every hypothesis and mapped source id is below it)."""
        is_pad = src_tokens.eq(pad)
        # non-pad tokens first, order kept (stable sort of the pad flags)
        order = torch.sort(is_pad.to(torch.int8), dim=1, stable=True).indices
        src = src_tokens.gather(1, order)
        if id_map is not None:
            src = id_map[src]
        self.src_len = (~is_pad).sum(dim=1)
        self.width = src.size(1)
        dev = src.device
        self.cols = torch.arange(self.width, device=dev)
        src = src.masked_fill(self.cols.unsqueeze(0) >= self.src_len.unsqueeze(1), -1)
        # one extra -1 column so gathers past the end read "no token"
        self.orig = torch.cat([src, src.new_full((src.size(0), 1), -1)], dim=1)
        self.src = self.orig
        if substitutions is not None:
            self.src = torch.where(self.orig >= 0, substitutions[self.orig.clamp(min=0)], self.orig)
        self.ptr = torch.full_like(self.src_len, -1)  # source index aligned with the last token
        # n-gram keys: one integer per (order, source position) and per hypothesis suffix,
        # so that all orders match in one comparison
        self._base = vocab_size + 1
        self._pow = self._base ** torch.arange(self.MAX_ORDER, device=dev)
        self._orders = torch.arange(1, self.MAX_ORDER + 1, device=dev)
        self._keys = self._source_keys(self.src[:, : self.width])
        self._ar_width = None

    def _source_keys(self, src: Tensor) -> Tensor:
        """(n, MAX_ORDER, W) key of the n-gram of order k+1 ending at each source position
        (-1 where it does not exist)."""
        n, w = src.shape
        s1 = src + 1  # 0: no token
        keys, acc, valid = [], torch.zeros_like(s1), torch.ones_like(s1, dtype=torch.bool)
        for k in range(self.MAX_ORDER):
            shifted = torch.cat([s1.new_zeros(n, min(k, w)), s1[:, : max(w - k, 0)]], dim=1)
            acc = acc + shifted * self._pow[k]
            valid = valid & shifted.gt(0)
            keys.append(acc.masked_fill(~valid, -1))
        return torch.stack(keys, dim=1)

    def select(self, rows: Tensor) -> None:
        self.src = self.src.index_select(0, rows)
        self.orig = self.orig.index_select(0, rows)
        self.src_len = self.src_len.index_select(0, rows)
        self.ptr = self.ptr.index_select(0, rows)
        self._keys = self._keys.index_select(0, rows)

    def propose(self, tokens: Tensor, t: Tensor, want: Tensor, width: int) -> Proposal:
        """tokens: (n, >=max(t)+1) hypotheses with BOS in column 0; t: (n,) tokens
        generated so far; want: (n,) draft length wanted per row.  The proposal's start
        is the source index of the first draft token."""
        n = t.size(0)
        # the hypothesis' last 1..3 tokens (most recent first) and their keys
        last = tokens.gather(1, (t.unsqueeze(1) - self._orders + 1).clamp(min=0))
        q = ((last + 1) * self._pow).cumsum(dim=1)
        q = q.masked_fill(self._orders.unsqueeze(0) > t.unsqueeze(1), -2)  # order > generated
        match = self._keys.eq(q.unsqueeze(2))  # (n, orders, W)
        # the longest order that matches anywhere wins
        order = (match.any(dim=2) * self._orders).amax(dim=1)  # (n,) 0: no match
        best = order.gt(0)
        chosen = match.gather(1, (order - 1).clamp(min=0).view(n, 1, 1).expand(n, 1, self.width))
        # several matches: the one nearest to the running alignment
        dist = (self.cols.unsqueeze(0) - self.ptr.unsqueeze(1)).abs()
        end = dist.masked_fill(~chosen.squeeze(1), 1 << 30).argmin(dim=1)
        # no match (a word the source does not have): assume it replaced the aligned
        # source token and continue after it
        start = torch.where(best, end + 1, self.ptr + 1).clamp(min=0)
        length = torch.minimum(want, self.src_len - start).clamp(min=0)
        if self._ar_width is None or self._ar_width.numel() != width:
            self._ar_width = torch.arange(width, device=t.device)
        idx = (start.unsqueeze(1) + self._ar_width).clamp(max=self.width)
        return Proposal(self.src.gather(1, idx), length, start, self.orig.gather(1, idx))

    def advance(self, start: Tensor, accepted: Tensor, drafted: Tensor, moved: Tensor) -> None:
        """Record the alignment after a verification: accepted draft tokens came from
        source positions start .. start+accepted-1, and the model's own next token is
        taken to stand for the source token after them."""
        ptr = torch.where(drafted > 0, start + accepted, self.ptr + 1)
        self.ptr = torch.where(moved, ptr, self.ptr)


class SubstitutionMemory:
    """Token substitutions learned from verification, across batches.

    When a copied draft token ``x`` is rejected and the model writes ``y`` instead, the
    pair is counted; ``x`` is drafted as ``y`` from the next batch on once ``x -> y`` has
    been seen at least twice and more often than ``x`` was accepted as itself (KJV ->
    WEB: "Thy" -> "Your", "LORD" -> "Yahweh", "unto" -> "to").  Speed only: every
    drafted token is verified.  Observations are kept on the device as ``x * V + y``
    keys and counted when the table is rebuilt, so a verification pass pays no host
    round trip for them.
    """

    MIN_COUNT = 2
    REBUILD_EVERY = 16

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._new: list = []  # key tensors observed since the last count
        self._keys: Optional[Tensor] = None  # distinct keys counted so far (sorted)
        self._counts: Optional[Tensor] = None
        self._table: Optional[Tensor] = None
        self._calls = 0

    def observe(self, orig: Tensor, model: Tensor) -> None:
        """orig: (m,) source tokens at verified draft positions (accepted ones, and the
        first rejected one of a row); model: (m,) the model's token there (-1 entries
        are ignored)."""
        self._new.append((orig * self.vocab_size + model)[orig.ge(0) & model.ge(0)])

    def _count(self) -> None:
        keys = torch.cat([k.cpu() for k in self._new])
        self._new = []
        counts = torch.ones_like(keys)
        if self._keys is not None:
            keys = torch.cat([self._keys, keys])
            counts = torch.cat([self._counts, counts])
        self._keys, inverse = torch.unique(keys, return_inverse=True)
        self._counts = torch.zeros_like(self._keys).index_add_(0, inverse, counts)

    def pairs(self) -> dict:
        """{(x, y): count} of everything observed (y == x: x accepted as itself)."""
        if self._new:
            self._count()
        if self._keys is None:
            return {}
        v = self.vocab_size
        return {(k // v, k % v): c for k, c in zip(self._keys.tolist(), self._counts.tolist())}

    def table(self, device) -> Optional[Tensor]:
        """(V,) target id -> id to draft instead, or None before anything was learned."""
        if self._table is None and not self._new:
            return None
        self._calls += 1
        # recounted at most every REBUILD_EVERY batches: at batch 1 new observations
        # arrive with almost every sentence
        if self._table is None or (self._new and self._calls % self.REBUILD_EVERY == 0):
            self._count()
            self._table = self._build()
        return self._table.to(device)

    def _build(self) -> Tensor:
        v = self.vocab_size
        x, y, c = self._keys // v, self._keys % v, self._counts
        kept = torch.zeros(v, dtype=torch.long).index_add_(0, x[x == y], c[x == y])
        cand = (x != y) & (c >= self.MIN_COUNT) & (c > kept[x])
        x, y, c = x[cand], y[cand], c[cand]
        tab = torch.arange(v)
        if x.numel():
            # per x the most frequent y (keys are sorted by x, then y: the smallest y on ties)
            best = torch.zeros(v, dtype=torch.long).scatter_reduce_(0, x, c, reduce="amax")
            top = c == best[x]
            xs, ys = x[top], y[top]
            first = torch.ones_like(xs, dtype=torch.bool)
            first[1:] = xs[1:] != xs[:-1]
            tab[xs[first]] = ys[first]
        return tab


class DraftModelDrafts:
    """Drafts from a small autoregressive fairseq model with the target's dictionary
    (generalized aggressive decoding / speculative decoding, greedy-exact).

    The draft model runs on its own :class:`~fairseq_fastgen.models.slot_decoder.SlotDecoder`
    (held by the caller across batches; blocks of tokens per row, each row at its own length): each proposal first feeds the tokens of the hypothesis it has not
    seen yet (one block: the verified model's bonus token, and the last draft token when
    the whole draft was accepted), then drafts greedily one token per pass.  After a
    verification, the draft cache keeps the accepted prefix (rollback = length).
    """

    def __init__(self, vd: SlotDecoder, net_input, bsz: int, max_len: int, max_draft: int,
                 eos: int, pad: int, min_len: int = 0):
        """vd: the draft model's decoder (beam 1); net_input: the batch's (the draft model
        encodes the source itself)."""
        self.vd = vd
        enc = vd.stack.model.encoder.forward_torchscript(net_input)
        self.vd.start(enc, bsz, max_len + max_draft + 2, room=2 * max_draft + 2)
        self.eos, self.pad, self.min_len = eos, pad, min_len
        dev = net_input["src_tokens"].device
        self.seen = torch.zeros(bsz, dtype=torch.long, device=dev)  # hypothesis tokens cached
        self.t_at = torch.zeros_like(self.seen)
        self.k = 0

    def select(self, rows: Tensor) -> None:
        self.vd.select(rows)
        self.seen = self.seen.index_select(0, rows)
        self.t_at = self.t_at.index_select(0, rows)

    def propose(self, tokens: Tensor, t: Tensor, want: Tensor, width: int) -> Proposal:
        """As :meth:`SourceDrafts.propose`; the start is t (the draft continues the
        hypothesis) and the draft is its own orig (no substitutions)."""
        n = t.numel()
        k = int(want.max()) if n else 0
        dev = t.device
        draft = torch.full((n, width), -1, dtype=torch.long, device=dev)
        self.t_at, self.k = t.clone(), k
        if k == 0:
            return Proposal(draft, torch.zeros_like(t), t, draft)
        # catch up: tokens seen .. t (at least the last one)
        c = t - self.seen + 1
        L = int(c.max())
        idx = (self.seen.unsqueeze(1) + torch.arange(L, device=dev)).clamp(max=tokens.size(1) - 1)
        block = tokens.gather(1, idx)
        last = c - 1
        flat = torch.arange(n, device=dev) * L + last
        logits = self.vd.block(block, self.seen, flat).scores
        nxt = self._pick(logits, t)
        draft[:, 0] = nxt
        pos = t + 1
        for i in range(1, k):
            logits = self.vd.block(nxt.unsqueeze(1), pos, None).scores
            nxt = self._pick(logits, pos)
            draft[:, i] = nxt
            pos = pos + 1
        self.seen = t + k  # cache holds positions 0 .. t+k-1
        # a draft ends with its first eos
        is_eos = draft[:, :k].eq(self.eos)
        first = torch.where(is_eos.any(dim=1), is_eos.float().argmax(dim=1) + 1,
                            torch.full_like(t, k))
        return Proposal(draft, torch.minimum(want, first), t, draft)

    def _pick(self, logits: Tensor, step: Tensor) -> Tensor:
        """Greedy draft token; pad never, eos not before --min-len (as the verifier)."""
        logits[:, self.pad] = float("-inf")
        if self.min_len > 0:
            early = step < self.min_len
            if bool(early.any()):
                logits[early, self.eos] = float("-inf")
        return logits[:, : self.vd.vocab].argmax(dim=-1)

    def advance(self, start: Tensor, accepted: Tensor, drafted: Tensor, moved: Tensor) -> None:
        # draft-cache positions t+1 .. t+a hold accepted tokens; the bonus is not cached
        if self.k:
            keep = self.t_at + 1 + torch.minimum(accepted, torch.full_like(accepted, self.k - 1))
            self.seen = torch.minimum(self.seen, keep)


def load_draft_model(path: str, target_model, tgt_dict):
    """A fairseq checkpoint built with the target model's dictionaries (same target
    dictionary required), in eval mode on the target's device and dtype."""
    from fairseq import checkpoint_utils
    from fairseq.tasks.translation import TranslationTask

    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    cfg = state["cfg"]
    src_dict = getattr(target_model.encoder, "dictionary", tgt_dict)
    task = TranslationTask(cfg.task, src_dict, tgt_dict)
    model = task.build_model(cfg.model)
    model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)
    if model.decoder.dictionary != tgt_dict:
        raise ValueError(f"draft model {path}: target dictionary differs from the model's")
    w = target_model.decoder.output_projection.weight
    return model.to(device=w.device, dtype=w.dtype).eval()
