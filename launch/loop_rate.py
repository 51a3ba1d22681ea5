"""Steps per second of the training loop (`trainer.fit`) on the tiny random pair: what the loop's host side costs.

    PYTHONPATH=. python launch/loop_rate.py [--steps=60] [--runs=3]

Run it from two checkouts in turn (PYTHONPATH naming each) to compare loops: the program compiled is the same, so
the difference is the host's waits and work between steps. Prints one line: the median steps/s over the runs.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.getcwd(), "tests"))  # the tiny config and batches the tests train on

from helpers import Fixed, tiny_batch, tiny_config, trainer_for  # noqa: E402

from mot_jax.training.setup import make_mesh  # noqa: E402
from mot_jax.training.trainer import fit  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--runs", type=int, default=3)
args = parser.parse_args()
c = tiny_config()
c.log_every = 20
trainer, pair = trainer_for(c, make_mesh(c), steps=args.steps * (args.runs + 1))
batches = Fixed([tiny_batch(pair.source_tokenizer, pair.target_tokenizer, offset=2 * i) for i in range(4)])
fit(trainer, batches, 0, 2)  # compiles
rates = []
for _ in range(args.runs):
    began = time.perf_counter()
    fit(trainer, batches, 0, args.steps)
    rates.append(args.steps / (time.perf_counter() - began))
print(f"steps/s {statistics.median(rates):.2f} (runs: {' '.join(f'{r:.2f}' for r in rates)})")
