"""Progress of long work, the ecosystem's way: a tqdm bar on a terminal; otherwise (logs, CI, a pipe) tqdm's
one-line meter on stderr about every `EVERY` seconds and once when the work ends.

    with Progress("Tokenizing the chunk table", "doc", total=len(documents)) as progress:
        for document in documents:
            ...
            progress.update()

The evaluation engine reports an absolute count instead: `progress(done, total)`; `metered(items, desc)` counts the
items of a loop as it takes them.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

EVERY = 15.0  # seconds between meter lines when stderr is not a terminal


class Progress:
    def __init__(self, desc: str, unit: str = "it", total: int | None = None, every: float | None = None):
        self.desc, self.unit, self.total, self.done = desc, unit, total, 0
        self.every = EVERY if every is None else every
        self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, disable=not sys.stderr.isatty())
        self.began = self.logged = time.perf_counter()

    def update(self, n: int = 1):
        self.done += n
        self.bar.update(n)  # a disabled bar counts nothing: `done` is ours
        if self.bar.disable and time.perf_counter() - self.logged >= self.every:
            self._line()

    def __call__(self, done: int, total: int):
        self.total = self.bar.total = total
        self.update(done - self.done)
        if done >= total:
            self.close()

    def close(self):
        if self.bar.disable and self.logged != -1:
            self._line()
            self.logged = -1  # closed: one final line only
        self.bar.close()

    def _line(self):
        self.logged = time.perf_counter()
        meter = tqdm.format_meter(self.done, self.total, self.logged - self.began, prefix=self.desc, unit=self.unit)
        print(meter, file=sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def metered(items, desc: str, unit: str = "batch", total: int | None = None):
    """`items`, yielded one by one and counted by a Progress (`total`: len(items) unless given)."""
    with Progress(desc, unit, total=len(items) if total is None else total) as progress:
        for item in items:
            yield item
            progress.update()
