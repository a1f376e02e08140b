"""Draft sources of aggressive decoding: source n-gram matching and learned substitutions.

Drafts decide speed only (every drafted token is verified; the end-to-end tests in
test_aggressive_decoding.py compare with stock), so these tests pin the drafting rules
themselves: the longest matching order wins, the match nearest to the alignment is taken,
and a substitution is learned only when it was seen often enough.
"""
import torch

from fairseq_fastgen.search.drafts import SourceDrafts, SubstitutionMemory

PAD = 1
V = 50


def hyp(*toks):
    """tokens (1, W) with BOS (0) first, and t (1,)"""
    row = torch.tensor([[0, *toks] + [PAD] * 20])
    return row, torch.tensor([len(toks)])


def test_longest_order_wins_over_a_nearer_shorter_match():
    # "7" alone matches at 0 and 4; the 3-gram "5 6 7" only at positions 2..4
    src = torch.tensor([[7, 9, 5, 6, 7, 11, 12, 2]])
    dr = SourceDrafts(src, PAD, vocab_size=V)
    tokens, t = hyp(5, 6, 7)
    draft, length, start, _ = dr.propose(tokens, t, torch.tensor([3]), 4)
    assert start.tolist() == [5]
    assert draft[0, :3].tolist() == [11, 12, 2] and length.tolist() == [3]


def test_several_matches_nearest_to_the_alignment():
    src = torch.tensor([[5, 6, 20, 30, 5, 6, 40, 41, 2]])
    dr = SourceDrafts(src, PAD, vocab_size=V)
    tokens, t = hyp(5, 6)
    dr.ptr = torch.tensor([0])  # aligned near the first "5 6"
    start = dr.propose(tokens, t, torch.tensor([2]), 4).start
    assert start.tolist() == [2]
    dr.ptr = torch.tensor([4])  # aligned near the second
    draft, _, start, _ = dr.propose(tokens, t, torch.tensor([2]), 4)
    assert start.tolist() == [6] and draft[0, :2].tolist() == [40, 41]


def test_no_match_continues_after_the_aligned_token_and_rows_are_independent():
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 11, PAD, PAD]])
    dr = SourceDrafts(src, PAD, vocab_size=V)
    tokens = torch.tensor([[0, 44, PAD, PAD], [0, 9, 10, PAD]])
    t = torch.tensor([1, 2])
    dr.ptr = torch.tensor([1, -1])
    draft, length, start, _ = dr.propose(tokens, t, torch.tensor([8, 8]), 8)
    # row 0: 44 is not in the source: it stands for the aligned source[1], the draft
    # resumes at 2; row 1: "9 10" matches: the draft is the rest of the (unpadded) source
    assert start.tolist() == [2, 2]
    assert length.tolist() == [3, 1]  # never past the source's end
    assert draft[0, :3].tolist() == [7, 8, 2] and draft[1, :1].tolist() == [11]


def test_short_sources_and_empty_rows():
    src = torch.tensor([[2], [PAD]])
    dr = SourceDrafts(src, PAD, vocab_size=V)
    tokens = torch.tensor([[0, 2, 2, 2], [0, 3, 3, 3]])
    length = dr.propose(tokens, torch.tensor([3, 3]), torch.tensor([4, 4]), 4).length
    assert length.tolist() == [0, 0]


def test_proposal_orig_is_the_source_before_substitution():
    """Substituted drafts are verified; what the memory learns from is the source token."""
    src = torch.tensor([[5, 6, 7, 8, 2]])
    subs = torch.arange(V)
    subs[7] = 9
    dr = SourceDrafts(src, PAD, substitutions=subs, vocab_size=V)
    tokens, t = hyp(5, 6)
    prop = dr.propose(tokens, t, torch.tensor([3]), 4)
    assert prop.draft[0, :3].tolist() == [9, 8, 2]
    assert prop.orig[0, :3].tolist() == [7, 8, 2]


def test_substitution_learned_after_two_sightings_and_not_when_kept_more():
    mem = SubstitutionMemory(V)
    assert mem.table("cpu") is None
    # x=7 drafted, the model wrote 8 instead, twice; x=9 -> 10 once; x=11 -> 12 twice but
    # 11 was accepted as itself three times; -1 entries (no source token) are ignored
    mem.observe(torch.tensor([7, 9, 11, 11, -1]), torch.tensor([8, 10, 12, 11, 5]))
    mem.observe(torch.tensor([7, 11, 11, 11]), torch.tensor([8, 12, 11, 11]))
    tab = mem.table("cpu")
    assert tab[7] == 8
    assert tab[9] == 9 and tab[11] == 11
    assert tab[5] == 5 and tab.tolist()[:5] == list(range(5))
    assert mem.pairs()[(7, 8)] == 2 and mem.pairs()[(11, 11)] == 3


def test_substitution_table_is_recounted_only_every_few_batches():
    mem = SubstitutionMemory(V)
    mem.observe(torch.tensor([7, 7]), torch.tensor([8, 8]))
    assert mem.table("cpu")[7] == 8
    mem.observe(torch.tensor([7, 7, 7]), torch.tensor([9, 9, 9]))  # 7 -> 9 now wins
    seen = [int(mem.table("cpu")[7]) for _ in range(SubstitutionMemory.REBUILD_EVERY)]
    assert seen[0] == 8 and seen[-1] == 9
