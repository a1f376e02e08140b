"""Lossless aggressive decoding for greedy generation (beam 1), batched, with a KV cache.

Aggressive decoding (Ge et al., arXiv 2205.10350) drafts several tokens (here: copied from
the source, :mod:`~fairseq_fastgen.search.drafts`), verifies all of them in one decoder
pass, keeps the longest prefix greedy search would have produced plus the model's own next
token, and drafts again.  This implementation:

* **batches with the cache**: every row of a batch feeds its last token and its own draft
  in one block pass (:meth:`SlotDecoder.block <fairseq_fastgen.models.slot_decoder.SlotDecoder.block>`), rows accept
  different numbers of tokens, the self-attention cache keeps a length per row and a
  rejected draft is rolled back by not advancing that length (masked, then overwritten);
  finished rows leave the batch at once (:class:`~.rows.Rows`);
* **is greedy-exact**: each verified position gets stock ``SequenceGenerator``'s rules for
  its own step (:mod:`~fairseq_fastgen.search.step_rules`: the repeated n-gram ban is
  computed on the hypothesis *including the draft tokens before that position*), then
  the top candidate is taken as fairseq's ``BeamSearch`` (beam 1) does.  Scores are
  accumulated in float32 step by step as stock does, and each hypothesis is finalized as
  ``finalize_hypos`` does (:mod:`~.finalize`);
* **near ties**: a block pass computes logits with other GEMM shapes than stock's one-token
  step, so scores may differ in the last bits (~1e-6).  A verified position whose top-2
  margin is below ``Tunables.near_tie`` (1e-4, plus the float32 rounding of the running
  score) is not trusted: the row keeps only the positions before it, and if it is the
  row's first position, the next pass is a plain one-token step for the batch (no
  drafts), which decides it as the regular fast path does (``topk`` over cumulative
  scores, as stock);
* **adapts**: each row keeps decayed counts of accepted / rejected draft positions
  (prior: the acceptance seen so far in this generator); every pass picks the block
  length that maximizes expected tokens per unit of cost (:mod:`~.block_cost`), so rows
  whose drafts keep failing stop drafting, a batch without useful drafts runs one-token
  steps (plain greedy), and rows that stopped drafting drift back to the prior and try
  again; per batch size, :mod:`~.speed_chooser` picks whichever of this and the regular
  greedy step is faster on the batches themselves;
* **drafts** (:mod:`~fairseq_fastgen.search.drafts`): copies of the source after an n-gram
  match with the hypothesis' last 1..3 tokens, with token substitutions learned from
  rejected drafts, or (``--fastgen-draft-model``) a small fairseq model's greedy output.

Acceptance statistics are kept in ``FastSequenceGenerator.aggressive_stats`` (cumulative)
and logged.
"""
from .decoding import AggressiveDecoding, unsupported
from .speed_chooser import AGGRESSIVE, PLAIN, SpeedChooser
from .stats import AcceptanceStats
from .tunables import Tunables

__all__ = ["AggressiveDecoding", "unsupported", "AGGRESSIVE", "PLAIN", "SpeedChooser",
           "AcceptanceStats", "Tunables"]
