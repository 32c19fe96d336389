"""The CUDA room: what makes a forward fast on a GPU, kept apart from the algorithm it serves.

    fused.py     one decoder forward with Q/K/V and gate/up fused into one GEMM each (made once at load, the
                 model's own weights become views of them), grouped-query attention over the static cache without
                 repeating key/value heads, and the layer compiled by inductor where torch.compile may run.
    graphs.py    one CUDA graph per row-count bucket of a model's static steps, captured and replayed.
    aot.py       the same layer as AOTInductor packages (weights and cache as inputs), for where torch.compile may
                 not run (a ZeroGPU Space); exact on the CPU, not yet loadable on CUDA (docs/gpu.md).

The decoder and the drafter never import this room: engine/core/steps.py's StaticSteps runs whatever forward is
installed on a model (`fused.installed`), replayed through a CUDA graph per bucket (engine/cuda/graphs.py). The
eager transformers forward stays the reference it is tested against (tests/test_fused.py). The device-side draft
phase (engine/core/device_draft.py) stays in the core: it is the algorithm's, runs on either device, and is tested on
the CPU.

May import (contract `engine-rooms`): engine/runtime.py alone (the room sits under the core, which runs it); never the
CPU room.
"""
