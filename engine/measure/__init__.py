"""Measuring and sizing: what a forward costs on this machine, the metrics of a run, and the tree sizes they imply.

  costs.py      forward cost tables per model and kernel path, measured once per machine and cached (the performance
                model: c = draft / target, t(n) = a verify of n rows / a verify of one)
  graphed.py    a GPU's cost table through static steps, one CUDA graph per rung; the rung timer CPU packages use
  ladder.py     reading a measured ladder between its rungs (pure Python)
  gpu_tables.py a GPU's measured cost tables shipped in assets/gpu/ (pure Python: the app reads them)
  autosize.py   `auto`: each iteration's tree size from the cost table and the run's own acceptance, or AR steps
                where no tree pays (a run plug-in through the strategies' RunHooks)
  clock.py      the stage clock of one decoding iteration
  metrics.py    the metric definitions (its docstring) and their computation from records
  timeline.py   teaching numbers read back from a finished run's records (pure Python)

May import: engine.core and engine.strategies' sizing and run hooks (contract `engine-rooms`).
"""
