"""The decoding core: what one iteration is made of, below every other room of the engine.

  tree.py         one iteration's draft tree (node 0 = the root)
  drafter.py      batched draft expansion: one draft forward per batch of frontier nodes, under a tree mask
  device_draft.py the draft phase and greedy verification queued on the device for strategies that plan their trees
                  in fixed-size levels (fixed, DynaTree, EAGLE-2, linear): one read to the host per iteration
  tensor_tree.py  a tree as device tensors of fixed shapes, grown level by level without reading the device
  steps.py        each model's forwards and KV cache: dynamic (the eager reference), or static with row-count
                  buckets, running whatever forward the device installed (transformers' own, engine/cuda's fused
                  step) eagerly, replayed from a CUDA graph (engine/cuda/graphs.py) or as a CPU package
                  (engine/cpu/packages.py): the one seam between the algorithm and a device's speed machinery
  kv.py           additive tree masks and cache row copies
  attention.py    tree_sdpa: grouped-query attention folded into rows, registered with transformers
  lookup.py       context-lookup drafts (no draft model): n-gram matches in the prompt and output
  reports.py      what a strategy reports beside its tree, typed (LookupReport, SelectorChoice)
  trace.py        IterationRecord, IterationCost, RunResult and its RunMetrics, RunConfig, Comparison, TokenSource,
                  StageTimes: the plain JSON-able records a run yields
  sampling.py     sampling settings and the processed distributions
  prompts.py      the shipped prompt sets and prompt encoding

May import: torch, transformers, numpy, and of the engine only the CUDA room and engine/runtime.py below it: steps.py
runs engine/cuda's graphs and fused step (pyproject.toml, contracts `engine-rooms` and `core-layers`;
`algorithm-not-devices` keeps tree.py and drafter.py from importing engine.cuda or engine.cpu themselves).
"""
