"""What the hardware computes natively, read without loading torch where no GPU driver is present (the
config resolves `model.mixed_precision: auto` with it, and a skipped rerun must stay light)."""

from __future__ import annotations


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU computes bfloat16 natively (x86 AVX512_BF16 or AMX-BF16 in its Linux flags); other
    CPUs emulate it, at a fraction of float32's speed."""
    try:
        with open(cpuinfo) as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_bf16() -> bool:
    """bfloat16 at full speed here: a CUDA device that supports it, else the CPU's flags. torch is imported
    only where a GPU driver is present, so a skipped rerun on a CPU machine does not pay for it."""
    import os
    import sys

    if "torch" in sys.modules or os.path.exists("/proc/driver/nvidia/version"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.is_bf16_supported()
    return cpu_has_bf16()
