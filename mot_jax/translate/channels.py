"""Channel maps: which source layers feed which target layers (docs/method.md §1.3; reference §1.6 and §4.2 step 1).

A channel is a (source layer, target layer) pair; a `ChannelMap` lists them strictly increasing on both sides.
Modes: `terminal` (the top `w` layers of each model paired), `depth_ratio` (a contiguous window of pairs spaced
evenly by relative depth, chosen by a proxy search with a caller-supplied score) and `explicit`. Rounding is
Python's `round` (half to even) everywhere, as in the reference.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from mot_jax.errors import MotJaxError

MODES = ("terminal", "depth_ratio", "explicit")


def _layers(name: str, layers) -> tuple[int, ...]:
    values = tuple(layers) if isinstance(layers, Iterable) and not isinstance(layers, str) else None
    if values is None or any(not isinstance(i, numbers.Integral) or isinstance(i, bool) for i in values):
        raise MotJaxError(f"{name} layers {layers!r} are not a list of integers; pass layer indices such as [6, 7].")
    return tuple(int(i) for i in values)


def _check_depth(name: str, value) -> int:
    if not isinstance(value, numbers.Integral) or value < 1:
        raise MotJaxError(f"{name}={value!r} is not a positive layer count; pass the model's number of layers.")
    return int(value)


@dataclasses.dataclass(frozen=True)
class ChannelMap:
    """Channels source[i] -> target[i], strictly increasing on both sides."""

    source: tuple[int, ...]
    target: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "source", _layers("Source", self.source))
        object.__setattr__(self, "target", _layers("Target", self.target))
        if len(self.source) != len(self.target):
            raise MotJaxError(
                f"{len(self.source)} source layers and {len(self.target)} target layers do not pair up; give both "
                "lists the same length."
            )
        if not self.source:
            raise MotJaxError("The channel map is empty; give at least one (source, target) layer pair.")
        for name, layers in (("Source", self.source), ("Target", self.target)):
            for previous, layer in zip(layers, layers[1:]):
                if layer <= previous:
                    raise MotJaxError(
                        f"{name} layer {layer} follows {previous}; list {name.lower()} layers strictly increasing."
                    )

    def __len__(self) -> int:
        return len(self.source)

    def validate(self, num_source_layers: int, num_target_layers: int) -> ChannelMap:
        """Raise MotJaxError on a layer outside the models; return self."""
        for name, layers, depth in (
            ("Source", self.source, num_source_layers),
            ("Target", self.target, num_target_layers),
        ):
            for layer in layers:
                if not 0 <= layer < depth:
                    raise MotJaxError(
                        f"{name} layer {layer} does not exist in a {depth}-layer model; use layers 0 to {depth - 1}."
                    )
        return self

    def to_json(self) -> str:
        return json.dumps({"source": list(self.source), "target": list(self.target)})

    @classmethod
    def from_json(cls, text: str) -> ChannelMap:
        try:
            data = json.loads(text)
            return cls(data["source"], data["target"])
        except (ValueError, KeyError, TypeError) as e:
            raise MotJaxError(
                f'The channel map JSON is not valid ({e}); write it as {{"source": [...], "target": [...]}}.'
            ) from None


def terminal(num_source_layers: int, num_target_layers: int, ratio: float) -> ChannelMap:
    """The top w layers of each side paired one to one, w = clip(round(min(Ls, Lt) * ratio), 1, min(Ls, Lt))."""
    ls, lt = _check_depth("num_source_layers", num_source_layers), _check_depth("num_target_layers", num_target_layers)
    depth = min(ls, lt)
    w = min(max(round(depth * ratio), 1), depth)
    return ChannelMap(range(ls - w, ls), range(lt - w, lt))


def _spread(num_layers: int, n: int) -> list[int]:
    if n == 1:
        return [num_layers - 1]
    out = []
    for p in range(n):
        low = out[-1] + 1 if out else 0
        out.append(min(max(round(p / (n - 1) * (num_layers - 1)), low), num_layers - 1 - (n - 1 - p)))
    return out


def depth_ratio_candidates(num_source_layers: int, num_target_layers: int) -> list[tuple[int, int]]:
    """min(Ls, Lt) (source, target) pairs spaced evenly by relative depth, strictly increasing on both sides."""
    ls, lt = _check_depth("num_source_layers", num_source_layers), _check_depth("num_target_layers", num_target_layers)
    n = min(ls, lt)
    return list(zip(_spread(ls, n), _spread(lt, n)))


def _window(candidates: Sequence[tuple[int, int]], start: int, size: int) -> ChannelMap:
    return ChannelMap(*zip(*candidates[start : start + size]))


def windows(candidates: Sequence[tuple[int, int]], size: int) -> list[ChannelMap]:
    """Every contiguous run of `size` candidate pairs, by start index."""
    return [_window(candidates, k, size) for k in range(len(candidates) - size + 1)]


def search_depth_ratio(
    num_source_layers: int,
    num_target_layers: int,
    min_ratio: float,
    max_ratio: float,
    score: Callable[[ChannelMap], float],
    grow_only_if_better: bool = False,
) -> tuple[ChannelMap, list[tuple[ChannelMap, float]]]:
    """The reference's proxy search over depth-ratio windows; `score` (lower is better) is called once per window.

    Every window of the probe size is scored; from the best, the window grows by one while below the maximum size,
    to the best window of the next size whose start is within 2 of the current one (ties: larger source start,
    then larger target start). The reference grows even when the loss gets worse; `grow_only_if_better` stops
    instead. Returns the chosen map and the scored windows in scoring order.
    """
    candidates = depth_ratio_candidates(num_source_layers, num_target_layers)
    n, depth = len(candidates), min(num_source_layers, num_target_layers)
    size = min(max(1, round(depth * min_ratio)), n)
    max_size = min(max(size, round(depth * max_ratio)), n)
    scores: dict[ChannelMap, float] = {}

    def loss(start: int, width: int) -> float:
        window = _window(candidates, start, width)
        if window not in scores:
            scores[window] = float(score(window))
        return scores[window]

    def best(starts, width: int) -> int:
        return min(starts, key=lambda k: (loss(k, width), -candidates[k][0], -candidates[k][1]))

    start = best(range(n - size + 1), size)
    while size < max_size:
        following = best(range(max(0, start - 2), min(n - size - 1, start + 2) + 1), size + 1)
        if grow_only_if_better and loss(following, size + 1) > loss(start, size):
            break
        start, size = following, size + 1
    return _window(candidates, start, size), list(scores.items())


def explicit(source_layers: Sequence[int], target_layers: Sequence[int]) -> ChannelMap:
    return ChannelMap(source_layers, target_layers)


def resolve(
    num_source_layers: int,
    num_target_layers: int,
    mode: str,
    *,
    ratio: float | None = None,
    min_ratio: float | None = None,
    max_ratio: float | None = None,
    source_layers: Sequence[int] | None = None,
    target_layers: Sequence[int] | None = None,
    score: Callable[[ChannelMap], float] | None = None,
    grow_only_if_better: bool = False,
) -> ChannelMap:
    """The validated channel map of a config: `resolve(Ls, Lt, **config.channels, score=...)`."""
    _check_depth("num_source_layers", num_source_layers)
    _check_depth("num_target_layers", num_target_layers)
    mode = str(mode).replace("-", "_")

    def need(**values):
        missing = [k for k, v in values.items() if v is None]
        if missing:
            raise MotJaxError(f"Channel mode {mode!r} needs {', '.join(missing)}; set it in the config.")

    if mode == "terminal":
        need(ratio=ratio)
        channel_map = terminal(num_source_layers, num_target_layers, ratio)
    elif mode == "depth_ratio":
        need(min_ratio=min_ratio, max_ratio=max_ratio)
        if score is None:
            raise MotJaxError(
                "Channel mode 'depth_ratio' chooses its window by a proxy search that needs the training step's "
                "score; run it from training or pass an explicit map."
            )
        channel_map = search_depth_ratio(
            num_source_layers, num_target_layers, min_ratio, max_ratio, score, grow_only_if_better
        )[0]
    elif mode == "explicit":
        need(source_layers=source_layers, target_layers=target_layers)
        channel_map = explicit(source_layers, target_layers)
    else:
        raise MotJaxError(f"Unknown channel mode {mode!r}; use one of {', '.join(MODES)}.")
    return channel_map.validate(num_source_layers, num_target_layers)


def target_to_source_layers(channel_map: ChannelMap, num_target_layers: int, num_source_layers: int) -> np.ndarray:
    """[Lt] int32: the source layer of every target layer, interpolated linearly between consecutive channels.

    Outside the channels the first or last two pairs extrapolate; results are clamped to [0, Ls - 1]. A single
    channel maps every target layer to its source layer.
    """
    source, target = np.array(channel_map.source, np.float64), np.array(channel_map.target, np.float64)
    j = np.arange(num_target_layers, dtype=np.float64)
    if len(source) == 1:
        layers = np.full(num_target_layers, source[0])
    else:
        k = np.clip(np.searchsorted(target, j, side="right") - 1, 0, len(target) - 2)
        s_left, t_left, s_right, t_right = source[k], target[k], source[k + 1], target[k + 1]
        layers = np.rint(s_left + (j - t_left) / (t_right - t_left) * (s_right - s_left))
    return np.clip(layers, 0, num_source_layers - 1).astype(np.int32)


def full_depth(num_source_layers: int, num_target_layers: int) -> np.ndarray:
    """[Lt] int32 source layer for every target layer, for a "direct" translator that emits all target layers.

    Target layer j reads source layer round(j / (Lt - 1) * (Ls - 1)) (Lt = 1: the top source layer). This is a plain
    array indexed by target layer rather than a ChannelMap, because source layers repeat when Ls < Lt; it equals
    `target_to_source_layers` of the two-channel map (0, 0), (Ls - 1, Lt - 1).
    """
    ls, lt = _check_depth("num_source_layers", num_source_layers), _check_depth("num_target_layers", num_target_layers)
    if lt == 1:
        return np.array([ls - 1], np.int32)
    return np.rint(np.arange(lt) / (lt - 1) * (ls - 1)).astype(np.int32)
