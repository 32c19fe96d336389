"""Captured steps: forwards compiled ahead of time (CPU) or graphed (CUDA), and AR at its fastest on them.

  packages.py     the pair's switch (auto | on | off), which packages each model gets, loading them, timing them
                  against the eager path and serving a row count only where they are faster
  aoti.py         one AOTInductor package: torch.export of one forward over a cache given as tensors, compiled
  captured_ar.py  AR in a bare loop over the one-row captured step: the bench's and the app's fastest AR
  compiled.py     AR through torch.compile on a static cache (where no captured step exists)

May import: engine.measure and engine.core (contract `engine-rooms`). Building runs in a process of its own:
engine/models/builder.py.
"""
