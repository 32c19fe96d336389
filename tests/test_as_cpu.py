"""scripts/as_cpu: the CPU classes a machine can act as, and the variables each sets."""
import subprocess
import sys

import pytest

from scripts import as_cpu

ZEN3 = "fpu sse sse2 avx avx2 fma bmi2"
SAPPHIRE_RAPIDS = "fpu avx avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8"


def test_a_class_can_only_take_a_machine_down():
    assert as_cpu.missing("avx2", ZEN3) == []
    assert as_cpu.missing("avx512-bf16", ZEN3) == ["avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"]
    assert as_cpu.missing("avx512-bf16", SAPPHIRE_RAPIDS) == []


def test_bf16_without_amx_drops_amx_from_every_library():
    env = as_cpu.CLASSES["avx512-bf16"]
    assert env["ONEDNN_MAX_CPU_ISA"] == env["DNNL_MAX_CPU_ISA"] == "AVX512_CORE_BF16"  # below AVX512_CORE_AMX
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX512_E3"  # bf16 without AMX (E4 adds AMX)
    assert set(env) == set(as_cpu.CLASSES["avx2"])  # every library of the float32 class is set here too


@pytest.mark.parametrize("cpu_class", sorted(as_cpu.CLASSES))
def test_the_class_runs_a_command_or_says_why_not(cpu_class):
    lacking = as_cpu.missing(cpu_class)
    done = subprocess.run([sys.executable, "-m", "scripts.as_cpu", cpu_class, "--", sys.executable, "-c",
                           "import os; print(os.environ['ONEDNN_MAX_CPU_ISA'])"], capture_output=True, text=True)
    if lacking:
        assert done.returncode != 0 and "cannot act as" in done.stderr and lacking[0] in done.stderr
    else:
        assert done.returncode == 0 and done.stdout.strip() == as_cpu.CLASSES[cpu_class]["ONEDNN_MAX_CPU_ISA"]
