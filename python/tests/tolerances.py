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
