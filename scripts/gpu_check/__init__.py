"""One command that proves and times the engine's CUDA path, for the few minutes a GPU is lent (docs/gpu.md,
"Running the GPU check"):

    python -m scripts.gpu_check --out DIR [--device cuda|cpu] [--quick] [--sections exact,fast,app] [--budget-s 480]

It writes DIR/report.json (every number, machine-readable), DIR/summary.md (the same, short, for a person),
DIR/gpu-tables/TARGET+DRAFT.json (the graphed cost table of each shape pair measured: engine/measure/gpu_tables.py's
schema, ready to copy into assets/gpu/). The sections (their budgets: the SECTIONS table in __main__.py):

  exact  every strategy on the tiny pairs in fp32, CUDA graphs on and off, token for token against AR; seeded
         sampling reproducible; the static-step and CUDA-graph tests under TREEVIZ_TEST_DEVICE (exact.py).
         Whether graphs may default to on for CUDA is this section's verdict.
  fast   real-shape random models in bf16: eager and graphed cost tables (c, t(n)), capture seconds and memory, a
         graphed one-row step against its summed kernel time, the engine's host time per iteration at ~16 nodes,
         DynaTree end to end against AR on the same one-row graph and against a graphed chain (fast.py).
  app    the run generators behind the GPU boundary (treeviz/serving/work.py) driven as a handler drives them, and the
         ZeroGPU process model: a forked child that alone initialises CUDA (app.py, zerogpu.py).

Contract: every section is timed and guarded (an exception is recorded with its traceback's tail and the next section
still runs); one wall-time budget (--budget-s) skips what no longer fits, with the reason recorded; the report is
rewritten after every section and after every unit of work inside one, so a killed run still leaves one. `--device cpu
--quick` runs the same sections on tiny models in about a minute (tests/test_gpu_check.py runs it, so the script
cannot rot between GPU runs). Exit status 0 when no section failed or raised.
"""
