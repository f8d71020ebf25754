"""A store file of random records for the engine tests (contract control, not a capture)."""

import numpy as np

REC = 2 * 4096  # two 4 KiB pages: O_DIRECT-aligned records


def random_store(tmp_path, records: int, seed: int, tail: int = 0):
    """(path, bytes) of `records` random records (plus `tail` bytes) written to tmp_path/store.bin."""
    data = np.random.default_rng(seed).integers(0, 256, size=records * REC + tail, dtype=np.uint8).tobytes()
    path = tmp_path / "store.bin"
    path.write_bytes(data)
    return path, data


def cache_gb(art, fraction):
    """(GiB, rows) for an expert cache of ceil(fraction x records) arena rows of artifact `art`
    (bf16 parts held as fp32), at least one decode token's top-k; the half record of slack keeps
    the loader's floor division on `rows`."""
    import math

    from hebrus_mlx.admission import admit
    from hebrus_mlx.artifact import expert_major as em
    from hebrus_mlx.loading import plan

    m = admit(str(art))
    fam = m.family
    record = sum(2 * n if d == "uint16" else n for _, _, d, _, _, n in em.record_layout(fam, m.experts.codec))
    rows = max(math.ceil(fraction * fam.num_hidden_layers * fam.num_experts), fam.num_experts_per_tok)
    return (rows * record + record // 2) / plan.GIB, rows


def flip_byte(path, offset: int, mask: int = 0xFF):
    """XOR one byte of a file in place (a corrupted record, page or header)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))
