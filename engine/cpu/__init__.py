"""The CPU room: what makes a forward fast on a CPU, kept apart from the algorithm it serves.

    kernels.py   each linear layer's weight formats (plain, mkl, packed, int8, int4, dyn8), one kernel per format,
                 routed per call by row count; torch's custom op that hides them from a compiler; handing freed
                 memory back to the system (malloc_trim, madvise)

The rooms above choose and build what this room runs: which formats each shape keeps and the memory plan
(engine/measure/formats.py, a measurement), the forwards compiled ahead of time (engine/capture/), and the builder
that compiles them in a process of its own (engine/models/builder.py). The decoder, the strategies, the rules, the
tree and the drafter never import this room (contract `algorithm-not-devices`): a model's linears run their formats
inside its forward, behind engine/core/steps.py. Plain `F.linear` on the original weight stays the reference every
format is tested against (tests/test_kernels.py).

May import: torch and the standard library; nothing of the engine (contract `engine-rooms`: `cpu` and `cuda` are the
bottom layer, and never import each other).
"""
