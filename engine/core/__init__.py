"""The decoding core: what one iteration is made of, below every other room of the engine.

  tree.py         one iteration's draft tree (node 0 = the root)
  drafter.py      batched draft expansion: one draft forward per batch of frontier nodes, under a tree mask
  steps.py        each model's forwards and KV cache: dynamic, or static with row-count buckets served by captured
                  steps (CUDA graphs in cuda_graphs.py, AOTInductor packages from engine/capture/)
  kv.py           additive tree masks and cache row copies
  attention.py    tree_sdpa: grouped-query attention folded into rows, registered with transformers
  kernels.py      CPU kernel paths per linear layer (plain, packed, int8, int4) and their routing by row count
  lookup.py       context-lookup drafts (no draft model): n-gram matches in the prompt and output
  trace.py        IterationRecord, IterationCost, RunResult and its RunMetrics, RunConfig, Comparison, TokenSource,
                  StageTimes: the plain JSON-able records a run yields
  sampling.py     sampling settings and the processed distributions
  prompts.py      the shipped prompt sets and prompt encoding
  runtime.py      device synchronisation and the cache folder

May import: torch, transformers, numpy; nothing else of the engine (pyproject.toml, contract `engine-rooms`).
"""
