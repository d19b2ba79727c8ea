"""The accuracy bounds of each scheme, read from the table the C++ and Python suites
share (tests/tolerances/<scheme>.json), so that the two cannot drift apart. Each bound
carries its derivation ("why") in the table."""

import json
from pathlib import Path

_TABLE_DIR = Path(__file__).resolve().parents[2] / "tests" / "tolerances"


def bounds(scheme: str) -> dict:
    """{name: value} of the scheme's bounds, e.g. bounds("sage2_8b")["cos_min"]."""
    with open(_TABLE_DIR / f"{scheme}.json", encoding="utf-8") as f:
        table = json.load(f)
    assert table["scheme"] == scheme, f"{f.name} names scheme {table['scheme']!r}"
    return {name: float(entry["value"]) for name, entry in table["bounds"].items()}


_SAGE2 = bounds("sage2_8b")
MIN_COSSIM = _SAGE2["cos_min"]  # output CosSim to the exact result, at least
MAX_REL_L1 = _SAGE2["rel_l1_max"]  # output relative L1 error, at most
LSE_ATOL = _SAGE2["lse_abs_max"]  # natural-log LSE error per row, at most

# The exact FP32 backward (the fallback path: masks SageBwd does not run, CPU tensors), its
# gradients rounded to the inputs' 16-bit type and compared with FP64 autograd. bf16 keeps 8
# significant bits: a relative rounding error of at most 2^-9 per element, so relative L1
# is at most 2^-9 (the bound 2^-8 leaves a factor 2 for FP32 summation order) and
# 1 − CosSim ≈ ½·E[rel²] ≤ ½·2^-18 ≈ 1.9e-6 (the bound 1e-5 leaves a factor ~5).
FALLBACK_GRAD_COS_MIN = 0.99999
FALLBACK_GRAD_REL_L1_MAX = 2.0**-8
