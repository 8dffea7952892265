"""Whether this CPU's 8-bit kernels in ONNX Runtime can saturate, which decides the weights `pipeline quantize`
writes.

ONNX Runtime multiplies INT8 tensors on x86 as activations in uint8 times weights in int8. On a CPU without
VNNI (AVX2, or AVX-512 without VNNI: an AMD EPYC before Zen 4, Intel before Cascade Lake) its kernels use
VPMADDUBSW, which adds two products in 16 bits and saturates where both are large (255 x 127 x 2 = 64,770 >
32,767): the answer is wrong, not rounded. VNNI's VPDPBUSD adds in 32 bits and never saturates, nor do ARM's
dot-product kernels. Weights in 7 bits (`reduce_range`) keep every sum within 16 bits (255 x 63 x 2 = 32,130)
on any CPU, for a little precision (ONNX Runtime's quantization guide advises it where saturation costs
accuracy). Measured on a small test model (Y = X W + B, 4 inputs, 3 outputs) on an AVX2-only CPU: with 8-bit
weights the INT8 output was 0.18 (calibrated) and 2.86 (dynamic) from FP32's, with 7-bit ones 0.003 and 0.03,
as with 8-bit weights on a VNNI CPU.
"""

from __future__ import annotations

import importlib
import platform
from collections.abc import Iterable
from pathlib import Path

#: The features of x86 CPUs whose 8-bit multiply-adds sum in 32 bits, named as `features` names them.
VNNI_FEATURES = frozenset({"AVX512VNNI", "AVXVNNI", "AMXINT8"})
#: What `platform.machine()` says on x86.
X86_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})


def _name(feature: str) -> str:
    """A feature's name as numpy and /proc/cpuinfo both give it: `avx512_vnni` and `AVX512VNNI` alike."""
    return feature.replace("_", "").upper()


def features() -> frozenset[str]:
    """This CPU's features: those numpy found when it chose its own kernels (CPUID, with what the OS enables,
    as ONNX Runtime finds them), else the flags of /proc/cpuinfo; empty where neither can be read."""
    for module in ("numpy._core._multiarray_umath", "numpy.core._multiarray_umath"):
        try:
            found = importlib.import_module(module).__cpu_features__
        except (ImportError, AttributeError):
            continue
        return frozenset(_name(name) for name, present in found.items() if present)
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(_name(flag) for flag in value.split())
    return frozenset()


def int8_saturates(machine: str | None = None, cpu_features: Iterable[str] | None = None) -> bool:
    """Whether 8-bit weights can saturate ONNX Runtime's kernels on a CPU: an x86 `machine` without VNNI
    among its `cpu_features`. Both default to this machine's; an x86 CPU whose features cannot be read is
    taken to saturate, as 7-bit weights are right on every CPU."""
    machine = (machine if machine is not None else platform.machine()).lower()
    if machine not in X86_MACHINES:
        return False
    found = features() if cpu_features is None else frozenset(_name(f) for f in cpu_features)
    return not (found & VNNI_FEATURES)
