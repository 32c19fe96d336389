"""The CPU room: everything that makes a forward fast on a CPU, kept apart from the algorithm it serves.

    kernels.py      each linear layer's weight formats (plain, mkl, packed, int8, int4, dyn8), one kernel per format,
                    routed per call by row count; torch's custom op that hides them from a compiler; handing freed
                    memory back to the system (malloc_trim, madvise)
    fusion.py       the draft's q|k|v and gate|up stacked into one linear each at load: fewer, wider GEMMs
    formats.py      which formats each weight shape keeps (a short probe on the model's own layers), the memory plan
                    that fits them in the budget, and the quantised formats kept on disk between starts
    aoti.py         one AOTInductor package: torch.export of one forward over a cache given as tensors, compiled
    packages.py     which packages each model gets, loading them, timing them against the eager path, and serving a
                    row count only where its package measured faster
    build_guard.py  what keeps a compile safe beside the app: one at a time, a memory budget, an end with its parent
    builder.py      the process that compiles a pair's missing packages (`python -m engine build`, started by the app)

The decoder, the strategies, the rules, the tree and the drafter never import this room (contract
`algorithm-not-devices`): a model's linears run their formats inside its forward, and its packages run behind
engine/core/steps.py, the one seam ("run n rows at these positions under this visibility; keep these rows"). Plain
`F.linear` on the original weight and the eager forward stay the references every format and package is tested
against (tests/test_kernels.py, tests/test_captured_steps.py).

May import (contract `engine-rooms`): the measurements (engine/measure, whose cost tables read this room's router
through engine/runtime.py, never by importing it), the core and engine/runtime.py; never the models (the builder's
pair is loaded by the command line that starts it) and never the CUDA room (contract `devices-apart`).
"""
