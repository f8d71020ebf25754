"""The projection's terms beyond compute and expert reads: the GPU waiting on the host per streamed
layer, PLE page reads, the wavefront's overlap and concurrent requests (docs/PROJECTION.md)."""

import dataclasses

import numpy as np
import pytest

from hebrus_mlx.artifact import constants as C
from hebrus_mlx.errors import UsageError
from hebrus_mlx.simulate import model as S

FAM = C.QWEN38_FLASH_NEXT


def _machine(**kw):
    base = dict(name="m", ssd_gbps={1: 2.0, 8: 4.0}, layer_s=0.7e-3, pre_router=0.5, threads=8)
    base.update(kw)
    return S.Machine(**base)


def _replay(misses_per_layer=3.0, L=48, k=10):
    return S.Replay(100, np.full(L, misses_per_layer), np.zeros(L), np.zeros(L), L * k)


def _project(machine, geom=None, rep=None, **kw):
    geom = geom or S.geometry_of_family(FAM, "affine2-g64")
    return S.project(machine, geom, rep or _replay(), cache_gb=8, capacity=1000, policy="clock", prefetch="off", **kw)


def test_the_hand_off_is_charged_once_per_streamed_layer():
    base = _project(_machine())
    with_h = _project(_machine(handoff_ms=0.25))
    assert with_h.handoff_ms == pytest.approx(48 * 0.25)
    assert with_h.token_ms - base.token_ms == pytest.approx(48 * 0.25)
    # A verify step of 3 tokens pays it once: a third per token at full acceptance.
    spec = _project(_machine(handoff_ms=0.25), draft_depth=2, acceptance=0.999999)
    assert spec.handoff_ms == pytest.approx(48 * 0.25 / 3, rel=1e-4)


def test_ple_pages_are_counted_and_a_slow_disk_exposes_them():
    geom = S.geometry_of_family(FAM, "affine2-g64")
    assert geom.ple_reads_per_token == 16 and geom.ple_page_bytes == C.PLE_DEFAULT_PAGE_BYTES
    fast = _project(_machine())
    assert fast.ple_bytes_per_token == 16 * C.PLE_DEFAULT_PAGE_BYTES
    slow = _project(_machine(ssd_gbps={1: 0.01}))  # 1 MiB at 10 MB/s: ~100 ms, far past the window
    window_ms = 0.5 * 0.7
    assert slow.ple_ms == pytest.approx(16 * C.PLE_DEFAULT_PAGE_BYTES / 0.01e9 * 1e3 - window_ms)
    cached = _project(_machine(ssd_gbps={1: 0.01}, ple_hit=1.0))
    assert cached.ple_ms == 0 and cached.ple_bytes_per_token == 0
    no_ple = dataclasses.replace(geom, ple_reads_per_token=0, ple_page_bytes=0)
    assert _project(_machine(ssd_gbps={1: 0.01}), geom=no_ple).ple_ms == 0


def test_the_wavefront_computes_residents_first_then_each_miss_as_it_lands():
    """The runtime's one-token wavefront (stream.switch): compute waits only where the reads run
    ahead of it: for the first miss (behind the resident experts' compute) or the last (behind
    every expert's compute but its own)."""
    geom = S.geometry_of_family(FAM, "affine2-g64")
    R = geom.record_bytes
    m = _machine(ssd_gbps={1: 0.5, 8: 1.0}, expert_share=0.3)
    waits = _project(m)
    wave = _project(dataclasses.replace(m, wavefront=True))
    # 3 misses per layer at QD3 (0.5 + 2/7 * 0.5 GB/s): far longer than a layer's compute, so every
    # expert but the last to land computes under the reads: 9 experts of 0.3 * 0.7 ms / 10 each.
    t = 3 * R / ((0.5 + 2 / 7 * 0.5) * 1e9) * 1e3
    assert waits.exposed_ms == pytest.approx(48 * t, rel=1e-6)
    assert wave.exposed_ms == pytest.approx(48 * (t - 9 * 0.3 * 0.7 / 10), rel=1e-6)
    # Experts that compute longer than the reads take: nothing exposed.
    slow = dataclasses.replace(m, wavefront=True, expert_share=1.0, layer_s=0.1)
    assert _project(slow).exposed_ms == 0.0
    # No resident expert: the first miss is waited for whatever the compute (QD8, 1 GB/s).
    all_miss = _replay(misses_per_layer=10.0)
    t10 = 10 * R / 1e9 * 1e3
    assert _project(slow, rep=all_miss).exposed_ms == pytest.approx(48 * t10 / 10, rel=1e-6)
    # A batched step resolves all its records first (the runtime's wavefront is one-token only).
    assert _project(dataclasses.replace(m, wavefront=True), batch=4, union=0.5).exposed_ms == pytest.approx(
        _project(m, batch=4, union=0.5).exposed_ms
    )


def test_batch_union_counts_distinct_records_of_unrelated_tokens():
    same = np.tile(np.arange(10), (50, 4, 1))  # every token routes to the same 10 experts
    assert S.batch_union(same, 4) == pytest.approx(1 / 4)
    rng = np.random.default_rng(0)
    disjoint = np.stack([rng.permutation(512)[:10] for _ in range(50 * 4)]).reshape(50, 4, 10)
    assert 0.9 < S.batch_union(disjoint, 4) <= 1.0


def test_a_batched_step_shares_dense_compute_and_reads_each_record_once():
    m = _machine(expert_share=0.2)
    one = _project(m)
    four = _project(m, batch=4, union=0.5)
    # Compute per step: dense once + the experts' share per distinct record (4 x 0.5 = 2 tokens' worth).
    assert four.compute_ms * 4 == pytest.approx(one.compute_ms * (0.8 + 0.2 * 2))
    assert four.bytes_per_token == pytest.approx(one.bytes_per_token * 0.5)
    assert four.tok_s > one.tok_s
    with pytest.raises(UsageError):
        _project(m, batch=2, draft_depth=1)


@pytest.mark.parametrize(
    "field,value", [("handoff_ms", -1), ("handoff_ms", float("nan")), ("ple_hit", 1.5), ("expert_share", -0.1)]
)
def test_profile_terms_out_of_range_are_refused_naming_the_field(field, value):
    d = {"name": "x", "ssd_gbps": {"1": 1.0}, "layer_ms": 1.0, field: value}
    with pytest.raises(UsageError) as e:
        S.Machine.from_dict(d, "profile p")
    assert e.value.field == f"profile p.{field}"


def test_a_ple_row_codec_is_not_an_expert_codec():
    assert S.expert_codec("affine4-g64").bits == 4
    for name in C.PLE_AFFINE_CODECS:
        with pytest.raises(UsageError) as e:
            S.expert_codec(name)
        assert e.value.field == "--codec"
