"""Benchmarks: strategies against AR at its fastest, size-knob sweeps, and other libraries' decoders as peers.

  tables.py   `python -m engine bench`: every method on every prompt, the ARs interleaved, ratios to the fastest AR
  sweep.py    one size knob swept over a prompt set (the app's Sweep tab and `python -m engine sweep`)
  peers.py    transformers' assisted generation and prompt lookup, run on the same pair
  captured_ar.py  AR in a bare loop over the one-row captured step: the bench's and the app's fastest AR
  compiled.py  AR through torch.compile on a static cache (where no captured step exists)
  configuration.py   the app's configuration, which every command defaults to, and how a report names the one it ran

May import: everything in the engine but the command line (contract `engine-rooms`).
"""
