"""The self-attention cache: reorders through one spare shared by the layers, shrinks,
grows from the source length by 1.25x (at least MARGIN positions), and holds 2L + 2 buffers."""
import torch

from fairseq_fastgen.models.kv_cache import GROWTH, MARGIN, KVCache, first_capacity


def _caches(layers, n, dim, cap, max_steps=100):
    return [KVCache(n, dim, max_steps, "cpu", torch.float32, initial=cap) for _ in range(layers)]


def _reorder_all(caches, order, spare):
    for c in caches:
        spare = c.reorder(order, spare)
    return spare


def test_reorders_share_one_spare_and_match_index_select():
    g = torch.Generator().manual_seed(0)
    layers, n, dim = 3, 6, 8
    caches = _caches(layers, n, dim, cap=5)
    ref = [[] for _ in range(layers)]  # per layer: list of (k, v) steps, fairseq's way
    spare = None
    rows = n
    storages = set()
    for step in range(12):  # past the first capacity: grows twice
        for i, c in enumerate(caches):
            k, v = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)
            keys, values = c.append(k, v)
            ref[i].append((k, v))
            assert torch.equal(keys, torch.stack([a for a, _ in ref[i]]))
            assert torch.equal(values, torch.stack([b for _, b in ref[i]]))
        new_rows = rows - 1 if step in (3, 8) else rows  # finished sentences shrink the batch
        order = torch.randint(0, rows, (new_rows,), generator=g)
        spare = _reorder_all(caches, order, spare)
        ref = [[(a[order], b[order]) for a, b in r] for r in ref]
        rows = new_rows
        storages = {t.untyped_storage().data_ptr() for c in caches for t in (c.k, c.v)}
        storages |= {t.untyped_storage().data_ptr() for t in spare}
        assert len(storages) == 2 * layers + 2  # not 4 per layer
    for i, c in enumerate(caches):
        assert torch.equal(c.k[: c.t], torch.stack([a for a, _ in ref[i]]))
        assert torch.equal(c.v[: c.t], torch.stack([b for _, b in ref[i]]))
    assert caches[0].k.size(0) == 5 + MARGIN  # grown once, by the least step


def test_first_capacity_follows_the_source_within_the_limit():
    assert first_capacity(20, 201) == 36
    assert first_capacity(300, 201) == 201
    assert first_capacity(None, 201) == 64
    assert first_capacity(None, 10) == 10


def test_growth_is_a_quarter_past_the_least_step():
    c = KVCache(1, 2, max_steps=1000, device="cpu", dtype=torch.float32, initial=100)
    for _ in range(101):
        c.append(torch.ones(1, 2), torch.ones(1, 2))
    assert c.k.size(0) == int(100 * GROWTH) == 125


def test_growth_stops_at_the_limit_then_steps_by_one():
    c = KVCache(2, 4, max_steps=4, device="cpu", dtype=torch.float32, initial=3)
    for _ in range(5):  # one past the limit: forced (prefix) decoding may write it
        c.append(torch.ones(2, 4), torch.ones(2, 4))
    assert c.t == 5 and c.k.size(0) == 5


def test_a_new_cache_takes_over_large_enough_buffers():
    """reuse: the last batch's buffers serve the next batch when they hold its first
    capacity (no fresh pages to fault in), with as many positions as they fit; too small
    or another dtype: new buffers.  Only positions written by the new cache are read."""
    old = KVCache(8, 4, max_steps=50, device="cpu", dtype=torch.float32, initial=20)
    for _ in range(3):
        old.append(torch.randn(8, 4), torch.randn(8, 4))
    new = KVCache(4, 4, max_steps=50, device="cpu", dtype=torch.float32, initial=10, reuse=old)
    assert new.k.data_ptr() == old.k.data_ptr() and new.v.data_ptr() == old.v.data_ptr()
    assert new.k.shape == (40, 4, 4) and new.k.is_contiguous()  # 8*20 rows-steps of room
    k, v = torch.randn(4, 4), torch.randn(4, 4)
    keys, values = new.append(k, v)
    assert keys.shape == (1, 4, 4) and torch.equal(keys[0], k) and torch.equal(values[0], v)
    big = KVCache(16, 4, max_steps=50, device="cpu", dtype=torch.float32, initial=20, reuse=old)
    assert big.k.data_ptr() != old.k.data_ptr() and big.k.shape == (20, 16, 4)
    other = KVCache(4, 4, max_steps=50, device="cpu", dtype=torch.float64, initial=10, reuse=old)
    assert other.k.dtype == torch.float64 and other.k.data_ptr() != old.k.data_ptr()
