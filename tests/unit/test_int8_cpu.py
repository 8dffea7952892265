"""Which CPUs `pipeline quantize` gives 7-bit weights: those whose 8-bit kernels in ONNX Runtime can saturate
(x86 without VNNI), named by their features as numpy and /proc/cpuinfo give them."""

from __future__ import annotations

import pytest

from services.model.int8_cpu import features, int8_saturates

#: An AMD EPYC before Zen 4 (/proc/cpuinfo's flags, in part): AVX2, no VNNI.
EPYC_ZEN3 = ["fpu", "sse4_2", "avx", "f16c", "fma", "bmi2", "avx2", "sha_ni", "vaes", "vpclmulqdq"]
#: An Intel Xeon from Cascade Lake on (numpy's names).
XEON_CLX = ["AVX2", "AVX512F", "AVX512BW", "AVX512VNNI"]
#: A Skylake Xeon: AVX-512 without VNNI, so VPMADDUBSW too.
XEON_SKX = ["AVX2", "AVX512F", "AVX512BW"]
#: A client CPU with AVX-VNNI and no AVX-512 (/proc/cpuinfo's spelling).
ALDER_LAKE = ["avx2", "avx_vnni"]


@pytest.mark.parametrize(
    ("machine", "cpu", "saturates"),
    [
        ("x86_64", EPYC_ZEN3, True),
        ("x86_64", XEON_SKX, True),
        ("x86_64", XEON_CLX, False),
        ("x86_64", ALDER_LAKE, False),
        ("AMD64", [], True),  # features unknown: 7 bits are right everywhere
        ("aarch64", [], False),  # ARM's dot products add in 32 bits
        ("arm64", ["ASIMDDP"], False),
    ],
)
def test_7_bit_weights_go_to_x86_cpus_without_vnni(machine: str, cpu: list[str], saturates: bool) -> None:
    assert int8_saturates(machine, cpu) is saturates


def test_this_cpus_features_are_read() -> None:
    found = features()
    assert "SSE2" in found or "ASIMD" in found or "NEON" in found, sorted(found)
