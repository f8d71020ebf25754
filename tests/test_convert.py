"""`hebrus-mlx convert`: determinism, fused expert sources, codec rejection and
bounded memory.

Provenance (AFN-014): tiny_a is the committed upstream-captured reference
checkpoint; its fused twin takes gate_up_proj/down_proj from the upstream
transformers module's own fused parameters (an independent cross-check of
the gate-rows-first split). The bulk checkpoint (tests/support/convert_fixture.py) is
a contract control used for memory only.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from support.artifact_fixture import sha, tiny_checkpoint
from support.convert_fixture import bulk_checkpoint, parity_source
from support.parity_fixtures import CONFIG_NAMES

from hebrus_mlx.artifact.errors import CodecError
from hebrus_mlx.convert import convert


def _digests(d):
    return {n: sha(os.path.join(d, n)) for n in sorted(os.listdir(d))}


def test_converting_twice_is_byte_identical(tmp_path):
    """Issue 3 evidence: the artifact is a pure function of the source
    (affine4-g64 profile, which also runs MLX quantization)."""
    hf = tiny_checkpoint(str(tmp_path / "hf"))
    convert(hf, str(tmp_path / "a"), q_bits=4, quiet=True)
    convert(hf, str(tmp_path / "b"), q_bits=4, quiet=True)
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")


def _fused_twin(unfused, d):
    """Same checkpoint with routed experts in the upstream fused layout."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers import Qwen4ExpForCausalLM

    model = Qwen4ExpForCausalLM.from_pretrained(unfused, dtype=torch.float32)
    state = model.state_dict()
    tensors = {
        k: v for k, v in load_file(os.path.join(unfused, "model.safetensors")).items() if ".mlp.experts." not in k
    }
    for k, v in state.items():
        if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[k] = v.detach().numpy().copy()
    for name in os.listdir(unfused):
        if not name.endswith(".safetensors"):
            with open(os.path.join(unfused, name), "rb") as f, open(os.path.join(d, name), "wb") as g:
                g.write(f.read())
    save_file(tensors, os.path.join(d, "model.safetensors"))
    return d


def test_fused_and_unfused_sources_give_identical_stores(tmp_path):
    """gate_up_proj [E, 2m, h] / down_proj [E, h, m] convert to the very same
    ExpertMajor bytes (AFN-002), dense file and PLE pages as per-expert
    tensors; only the consumed-tensor count in the manifest differs."""
    unfused = parity_source("tiny_a", str(tmp_path / "unfused"))
    os.makedirs(tmp_path / "fused")
    fused = _fused_twin(unfused, str(tmp_path / "fused"))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ra = convert(unfused, a, dtype="float32", quiet=True).report
    rb = convert(fused, b, dtype="float32", quiet=True).report
    da, db = _digests(a), _digests(b)
    assert da.pop("manifest.json") != db.pop("manifest.json")
    assert da == db and "experts.hbem" in da
    assert ra["expert_records"] == rb["expert_records"] == 4 * 8


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_group_64_codec_rejected_for_irregular_widths(name, tmp_path):
    """AFN-002: expert rows of width 32/24/80 are not a multiple of group 64;
    affine4-g64 is refused (never padded) and nothing is published."""
    hf = parity_source(name, str(tmp_path / "hf"))
    out = str(tmp_path / "out")
    with pytest.raises(CodecError) as e:
        convert(hf, out, q_bits=4, q_group_size=64, quiet=True)
    assert e.value.field.startswith("experts.") and "multiple of group 64" in str(e.value)
    assert not os.path.exists(out) and os.listdir(tmp_path) == ["hf"]


# Peak RSS is read from VmHWM (this process image only): ru_maxrss would
# inherit the parent's high-water mark across fork/exec.
_CHILD = textwrap.dedent("""
    import resource, sys
    def hwm():
        return int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
    cap, mode = int(sys.argv[1]), sys.argv[2]
    from support import families  # the bulk family (tests/ is on PYTHONPATH)
    from hebrus_mlx.convert import convert
    import numpy as np
    base = hwm()
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    if mode == "convert":
        convert(sys.argv[3], sys.argv[4], dtype="float32", quiet=True)
    else:  # control: hold the checkpoint's worth of bytes
        np.ones(int(sys.argv[3]), np.uint8)
    print(base, hwm())
""")


@pytest.fixture(scope="module")
def bulk(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("bulk") / "hf")
    return d, bulk_checkpoint(d)


def test_conversion_memory_is_bounded_under_a_cap(bulk, tmp_path):
    """Issue 3: peak memory is about the largest tensor plus a constant,
    independent of checkpoint size. A ~390 MiB checkpoint converts in a child
    whose data segment (RLIMIT_DATA: heap + anonymous mappings) is capped at
    160 MiB, well below the checkpoint; the control shows the cap is real.
    Measured: peak RSS ~52 MiB, ~18 MiB above the post-import baseline."""
    hf, size = bulk
    cap = 160 << 20
    assert size > 2 * cap
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    control = subprocess.run(
        [sys.executable, "-c", _CHILD, str(cap), "control", str(size)], capture_output=True, text=True, env=env
    )
    assert control.returncode != 0 and "MemoryError" in control.stderr
    out = str(tmp_path / "art")
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, str(cap), "convert", hf, out], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr[-2000:]
    base_kib, peak_kib = map(int, res.stdout.split())
    assert (peak_kib - base_kib) * 1024 < size / 8
    assert sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)) > size * 0.9
