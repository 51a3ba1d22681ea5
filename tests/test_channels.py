"""Channel maps: terminal, depth-ratio candidates and proxy search, explicit maps, layer interpolation."""

from __future__ import annotations

import numpy as np
import pytest

from mot_jax.errors import MotJaxError
from mot_jax.translate.channels import (
    ChannelMap,
    depth_ratio_candidates,
    explicit,
    full_depth,
    resolve,
    search_depth_ratio,
    target_to_source_layers,
    terminal,
    windows,
)


def test_terminal():
    assert terminal(12, 12, 0.5) == ChannelMap(range(6, 12), range(6, 12))
    assert terminal(2, 4, 0.5) == ChannelMap((1,), (3,))
    assert len(terminal(5, 9, 0.5)) == 2 and len(terminal(5, 9, 0.7)) == 4  # round(2.5) = 2, round(3.5) = 4
    assert terminal(5, 9, 0.0) == ChannelMap((4,), (8,)) and terminal(5, 9, 2.0) == ChannelMap(range(5), range(4, 9))


def test_depth_ratio_candidates():
    assert depth_ratio_candidates(12, 12) == [(i, i) for i in range(12)]
    assert depth_ratio_candidates(7, 5) == [(0, 0), (2, 1), (3, 2), (4, 3), (6, 4)]  # 1.5 -> 2, 4.5 -> 4
    assert depth_ratio_candidates(1, 6) == [(0, 5)] and depth_ratio_candidates(4, 2) == [(0, 0), (3, 1)]
    for ls, lt in ((30, 18), (18, 30)):
        pairs = np.array(depth_ratio_candidates(ls, lt))
        assert len(pairs) == 18 and (np.diff(pairs, axis=0) > 0).all()
        assert pairs.min(0).tolist() == [0, 0] and pairs.max(0).tolist() == [ls - 1, lt - 1]
    sizes = windows(depth_ratio_candidates(7, 5), 3)
    assert sizes == [
        ChannelMap((0, 2, 3), (0, 1, 2)),
        ChannelMap((2, 3, 4), (1, 2, 3)),
        ChannelMap((3, 4, 6), (2, 3, 4)),
    ]


def counting(score):
    calls = []

    def wrapped(channel_map):
        calls.append(channel_map)
        return score(channel_map)

    return wrapped, calls


def test_search_probe_only():
    """Two 24-layer models at 0.3/0.3: w = round(7.2) = 7, the best of 18 sliding windows, no growth."""
    score, calls = counting(lambda m: abs(m.source[0] - 9.2))
    chosen, table = search_depth_ratio(24, 24, 0.3, 0.3, score)
    assert len(table) == len(calls) == 18 and {len(m) for m, _ in table} == {7}
    assert chosen == ChannelMap(range(9, 16), range(9, 16))


def brute_force(ls, lt, size, score):
    return min(windows(depth_ratio_candidates(ls, lt), size), key=lambda m: (score(m), -m.source[0], -m.target[0]))


@pytest.mark.parametrize("ls,lt,centre", [(12, 12, 7.0), (30, 18, 20.0), (18, 30, 3.0)])
def test_search_greedy_growth(ls, lt, centre):
    def loss(m):
        return (np.mean(m.source) - centre) ** 2

    score, calls = counting(loss)
    chosen, table = search_depth_ratio(ls, lt, 0.25, 0.5, score)
    depth = min(ls, lt)
    assert len(chosen) == round(depth * 0.5)
    assert chosen == brute_force(ls, lt, len(chosen), loss)  # the quadratic bowl lets the greedy walk find it
    assert len(calls) == len(set(calls)) == len(table)  # each window scored once
    assert [len(m) for m, _ in table[: depth - round(depth * 0.25) + 1]] == [round(depth * 0.25)] * (
        depth - round(depth * 0.25) + 1
    )


def test_search_ties_and_worse_growth():
    # constant loss: the probe takes the largest start, each growth step the largest start within reach
    chosen, table = search_depth_ratio(12, 12, 0.25, 0.5, lambda m: 1.0)
    assert chosen == ChannelMap(range(6, 12), range(6, 12))
    assert [m.source[0] for m, _ in table if len(m) == 4] == [7, 8]  # starts 7..8 (9 + 2 clamped to 12 - 4)
    # loss grows with size: the reference grows anyway, grow_only_if_better stops at the probe
    by_size = lambda m: len(m) + m.source[0] / 100
    assert search_depth_ratio(12, 12, 0.25, 0.5, by_size)[0] == ChannelMap(range(0, 6), range(0, 6))
    assert search_depth_ratio(12, 12, 0.25, 0.5, by_size, grow_only_if_better=True)[0] == ChannelMap(
        (0, 1, 2), (0, 1, 2)
    )


def test_explicit_and_resolve():
    assert explicit([1, 5], [2, 3]) == ChannelMap((1, 5), (2, 3))
    assert resolve(12, 8, "explicit", source_layers=[1, 5], target_layers=[2, 3]) == ChannelMap((1, 5), (2, 3))
    assert resolve(12, 12, "terminal", ratio=0.5) == terminal(12, 12, 0.5)
    assert len(resolve(24, 24, "depth-ratio", min_ratio=0.3, max_ratio=0.3, score=lambda m: 0.0)) == 7
    with pytest.raises(MotJaxError, match="proxy search .* explicit map"):
        resolve(24, 24, "depth_ratio", min_ratio=0.3, max_ratio=0.3)
    with pytest.raises(MotJaxError, match="needs ratio"):
        resolve(24, 24, "terminal")
    with pytest.raises(MotJaxError, match="Unknown channel mode 'injection'"):
        resolve(24, 24, "injection")
    with pytest.raises(MotJaxError, match="Target layer 8 does not exist in a 8-layer model"):
        resolve(12, 8, "explicit", source_layers=[1, 5], target_layers=[2, 8])


def test_validation():
    with pytest.raises(MotJaxError, match="Source layer 12 does not exist in a 12-layer model; use layers 0 to 11"):
        ChannelMap((3, 12), (0, 1)).validate(12, 4)
    with pytest.raises(MotJaxError, match="Target layer -1 does not exist"):
        ChannelMap((3,), (-1,)).validate(12, 4)
    with pytest.raises(MotJaxError, match="Source layer 3 follows 3"):
        ChannelMap((3, 3), (0, 1))
    with pytest.raises(MotJaxError, match="Target layer 0 follows 1"):
        ChannelMap((3, 4), (1, 0))
    with pytest.raises(MotJaxError, match="2 source layers and 1 target layers"):
        ChannelMap((3, 4), (1,))
    with pytest.raises(MotJaxError, match="empty"):
        ChannelMap((), ())
    with pytest.raises(MotJaxError, match="not a list of integers"):
        ChannelMap((1.5,), (1,))
    with pytest.raises(MotJaxError, match="positive layer count"):
        terminal(0, 4, 0.5)


def test_json_round_trip():
    channel_map = ChannelMap(np.array([2, 5, 9]), (0, 1, 7))
    assert ChannelMap.from_json(channel_map.to_json()) == channel_map
    assert channel_map.to_json() == '{"source": [2, 5, 9], "target": [0, 1, 7]}'
    with pytest.raises(MotJaxError, match="JSON is not valid"):
        ChannelMap.from_json('{"source": [1]}')


def test_target_to_source_layers():
    assert target_to_source_layers(ChannelMap((5,), (3,)), 6, 8).tolist() == [5] * 6
    assert target_to_source_layers(ChannelMap((2, 4), (1, 3)), 6, 10).tolist() == [1, 2, 3, 4, 5, 6]
    # interpolation with round half to even (6.5 -> 6) and extrapolation past the last pair (7.25 -> 7)
    assert target_to_source_layers(ChannelMap((0, 6, 7), (0, 2, 6)), 8, 8).tolist() == [0, 3, 6, 6, 6, 7, 7, 7]
    assert target_to_source_layers(ChannelMap((5, 7), (0, 1)), 4, 8).tolist() == [5, 7, 7, 7]  # clamped to 7
    assert target_to_source_layers(ChannelMap((0, 3), (2, 3)), 4, 8).tolist() == [0, 0, 0, 3]  # clamped to 0
    assert target_to_source_layers(ChannelMap((0, 3), (2, 3)), 4, 8).dtype == np.int32


def test_full_depth():
    assert full_depth(4, 7).tolist() == [0, 0, 1, 2, 2, 2, 3]  # j / 2: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    assert full_depth(4, 7).tolist() == target_to_source_layers(ChannelMap((0, 3), (0, 6)), 7, 4).tolist()
    assert full_depth(30, 18).tolist() == target_to_source_layers(ChannelMap((0, 29), (0, 17)), 18, 30).tolist()
    assert full_depth(12, 12).tolist() == list(range(12)) and full_depth(5, 1).tolist() == [4]
