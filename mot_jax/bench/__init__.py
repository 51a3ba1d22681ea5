"""The benchmarks behind BENCHMARKS.md (`python -m mot_jax.bench`; its usage: `__main__.py`).

One module per part (`models`, `mixture`, `align`, `ttft`, `train`), each `bench_PART(plan) -> Section`; `common`
holds the plan, the section and table types and the timing helpers they share; `page` writes the page.
"""
