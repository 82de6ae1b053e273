"""layout.index_runs: a worker's shuffle buffer as pieces, the same as merging one piece per sample."""

import random

from vlp.data.layout import index_runs, merge_pieces


def test_runs_equal_merged_single_pieces():
    rng = random.Random(0)
    for _ in range(300):
        where = list({(rng.randint(0, 5), rng.randint(0, 60)) for _ in range(rng.randint(0, 120))})
        rng.shuffle(where)
        assert index_runs(where) == merge_pieces(sorted((s, i, i + 1) for s, i in where))
    assert index_runs([]) == []
    assert index_runs([(3, 7), (0, 2), (3, 5), (3, 6), (0, 1)]) == [(0, 1, 3), (3, 5, 8)]
    assert index_runs([(2, 2**39), (2, 2**39 + 1)]) == [(2, 2**39, 2**39 + 2)]
