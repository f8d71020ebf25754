"""Shared access to the committed reference fixtures (tests/support/fixtures/parity, see
tools/capture_reference.py for how they were made and provenance.json for each array)."""

from functools import cache
from pathlib import Path

import numpy as np

PARITY = Path(__file__).resolve().parent / "fixtures" / "parity"
CONFIG_NAMES = ("tiny_a", "tiny_b", "tiny_c")


@cache
def capture(name):
    return dict(np.load(PARITY / name / "capture.npz"))


@cache
def model(name):
    from hebrus_mlx.loader import load_hf_model

    return load_hf_model(PARITY / name)
