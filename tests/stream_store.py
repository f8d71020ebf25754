"""A store file of random records for the engine tests (contract control, not a capture)."""

import numpy as np

REC = 2 * 4096  # two 4 KiB pages: O_DIRECT-aligned records


def random_store(tmp_path, records: int, seed: int, tail: int = 0):
    """(path, bytes) of `records` random records (plus `tail` bytes) written to tmp_path/store.bin."""
    data = np.random.default_rng(seed).integers(0, 256, size=records * REC + tail, dtype=np.uint8).tobytes()
    path = tmp_path / "store.bin"
    path.write_bytes(data)
    return path, data
