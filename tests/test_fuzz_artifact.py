"""Fuzz (AFN-003/004): random byte flips and truncations of every artifact
file end in a typed error or byte-identical data, never a crash and never
silently different bytes. Mutations are contract controls (seeded)."""

import pytest
from support.artifact_fixture import fuzz, tiny_artifact

CASES = 360


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return tiny_artifact(str(tmp_path_factory.mktemp("fuzz")), dtype="bfloat16")[1]


def test_flips_and_truncations_are_typed_or_identical(artifact):
    counts = fuzz(artifact, CASES, seed=1)
    assert sum(counts.values()) == CASES
    files = {name for name, _ in counts}
    assert {"manifest.json", "model.safetensors", "experts.hbem", "ple.0.hbpl", "tokenizer.json"} <= files
    # Every store mutation must be caught: digests cover every byte of a store.
    for (name, outcome), n in counts.items():
        if name.endswith((".hbem", ".hbpl", ".safetensors")):
            assert outcome == "typed", (name, n)
