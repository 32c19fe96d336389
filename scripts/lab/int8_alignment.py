"""Lab probe behind docs/experiments/2026-12-06-zen4.md ("The suite crashed on this class"): whether torch's
`_weight_int8pack_mm` runs on a weight that does not start on a 64-byte boundary, as safetensors maps one.

    python -m scripts.lab.int8_alignment

Each case (the weight's offset from a 64-byte boundary, the activation dtype, the row count) runs in a fresh process,
50 calls on a 256x64 int8 weight, so a crash is a row of the table and not the end of the probe.
"""
import subprocess
import sys

CASE = """
import torch
offset, dtype, rows = {offset}, torch.{dtype}, {rows}
base = torch.randint(-128, 127, (256 * 64 + 64,), dtype=torch.int8)
start = (offset - base.data_ptr()) % 64
weight = base[start:start + 256 * 64].view(256, 64)
scales, x = torch.rand(256, dtype=dtype), torch.randn(rows, 64, dtype=dtype)
for _ in range(50):
    out = torch.ops.aten._weight_int8pack_mm(x, weight, scales)
reference = (x.float() @ weight.float().t()) * scales.float()
print(float((out.float() - reference).abs().max() / reference.abs().max()))
"""


def main() -> None:
    print("offset  dtype     rows  result")
    for dtype in ("bfloat16", "float32"):
        for offset in (0, 8, 16, 32, 40):
            for rows in (1, 2, 4, 16):
                done = subprocess.run([sys.executable, "-c", CASE.format(offset=offset, dtype=dtype, rows=rows)],
                                      capture_output=True, text=True, timeout=120)
                result = (f"ran, relative error {float(done.stdout.split()[-1]):.1e}" if done.returncode == 0
                          else f"exit {done.returncode}")
                print(f"{offset:6}  {dtype:8}  {rows:4}  {result}", flush=True)


if __name__ == "__main__":
    main()
