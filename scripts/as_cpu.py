"""Run a command as another CPU class would: torch's kernels limited to what that class has.

    python -m scripts.as_cpu avx2 -- python app.py                 # an AVX2-only, float32 machine (AMD Zen 3 class)
    python -m scripts.as_cpu avx2 -- python -m engine bench --pair default ...
    python -m scripts.as_cpu avx512-bf16 -- python app.py          # AVX-512 with native bf16, no AMX (AMD Zen 5 class)
    python -m scripts.as_cpu --print avx2                          # the variables, for a shell: eval "$(...)"

Each library torch computes with honours its own variable: ATen's vectorised kernels and inductor's generated code
ATEN_CPU_CAPABILITY, oneDNN ONEDNN_MAX_CPU_ISA (and its older name DNNL_MAX_CPU_ISA), MKL MKL_ENABLE_INSTRUCTIONS,
fbgemm (the dyn8 draft format) FBGEMM_ENABLE_INSTRUCTIONS: AVX2 without VNNI sums u8 x s8 pairs in int16, as a Zen 3
does. With all of them lowered, oneDNN has no bf16 GEMM (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT), so the engine's
`dtype auto` picks float32 and no bf16 packing is offered, as on the real part (engine/models/devices.py
`cpu_has_fast_bf16` reads what the libraries report, not the flags alone). Cost tables and packages measured under
an emulated class are kept apart from the machine's own (engine/measure/costs.py `kernel_isa`).

`avx512-bf16` takes an AMX machine (Sapphire Rapids or later) down to AVX-512 with bf16 and VNNI: oneDNN's bf16
GEMMs then run on AVX512_CORE_BF16 instead of AMX tiles, MKL on its AVX512_E3 path, fbgemm on AVX512_E1. A class
can only take a machine down: one that lacks the class's instructions is refused (an AVX2 machine cannot act as
an AVX-512 one).

What an emulation cannot show: the real part's memory bandwidth, cache sizes and core clocks (a forward that streams
its weights runs at this machine's bandwidth), and MKL's code path on a non-Intel CPU (MKL picks its kernels by
vendor as well as by ISA; on an AMD part its packed GEMM may lose where it wins here), nor the width of the real
part's AVX-512 datapath (full 512-bit on Zen 5 desktop and server parts, two 256-bit halves on its mobile ones).
docs/cpu.md.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

CLASSES = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512-bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                    "DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3",
                    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512_E1"},
}
# the instructions (/proc/cpuinfo flags) a machine needs to act as each class
NEEDS = {"avx2": ("avx2", "fma"), "avx512-bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")}


def missing(cpu_class: str, flags: str | None = None) -> list[str]:
    """The instructions `cpu_class` needs that this machine lacks, or the CPU whose `flags` are given (none: it can
    act as that class; none either where the machine does not list its flags: the libraries will say)."""
    if flags is None:
        from engine.measure.costs import cpu_info  # imported here: torch comes with it
        flags = cpu_info()["flags"]
    present = set(flags.split())
    return [flag for flag in NEEDS[cpu_class] if present and flag not in present]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cpu_class", choices=sorted(CLASSES))
    parser.add_argument("--print", action="store_true", help="print `export` lines instead of running a command")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --)")
    args = parser.parse_args(argv)
    env = CLASSES[args.cpu_class]
    lacking = missing(args.cpu_class)
    if lacking:
        parser.error(f"this CPU cannot act as {args.cpu_class}: it lacks {', '.join(lacking)} (a class can only take "
                     "a machine down)")
    if args.print:
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command after --")
    os.execvpe(command[0], command, {**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main())
