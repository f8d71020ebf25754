"""Issue 10: `hebrus-mlx convert` accepts block-FP8 source checkpoints
(transformers' FineGrainedFP8 layout: float8_e4m3fn `weight` + float
`weight_scale_inv` per block, per-tensor `weight_scale` for the PLE table).

Provenance (AFN-014): the base checkpoint is transformers'
`save_pretrained` of the tiny config (seed 0). The FP8 twin is quantized
here with torch ops (per-block amax / 448, cast to torch.float8_e4m3fn); the
oracle twin is dequantized here with torch (`q.float() * scale` expanded per
block), never by the code under test. Both twins are then converted and
must give byte-identical stores.
"""

import json
import os
import shutil

import numpy as np
import pytest
from support.artifact_fixture import sha, tiny_checkpoint

from hebrus_mlx.cli import main as cli_main
from hebrus_mlx.convert import convert
from hebrus_mlx.convert import sources as sources_mod
from hebrus_mlx.convert.fp8 import E4M3FN, Fp8Error

E4M3_MAX = 448.0


def _is_fp8_target(key):
    return (".mlp.experts." in key and key.endswith("_proj.weight")) or ".ngram_embedding.shard_" in key


def _quantize_blocks(w, block):
    """(float8 tensor, float32 scale_inv [ceil(r/br), ceil(c/bc)]) with torch ops."""
    import torch

    br, bc = block
    rows, cols = w.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = (amax / E4M3_MAX).to(torch.float32)
    q = (blocks / scale[:, None, :, None]).reshape(nr * br, nc * bc)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def _expand(scale, block, rows, cols):
    br, bc = block
    return scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]


def _copy_side_files(src, dst, config_edit=None):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            continue
        shutil.copy(os.path.join(src, name), dst)
    if config_edit is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        config_edit(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)


def fp8_twins(hf, root, block, ple_scale="block", mutate=None):
    """(fp8 dir, oracle dir). ple_scale: "block" (per-shard weight_scale_inv)
    or "tensor" (one ngram_embedding.weight_scale for every shard, as
    transformers' FP8Embedding stores it). mutate(tensors) edits the FP8
    twin's tensors before they are written."""
    import torch
    from safetensors.torch import load_file, save_file

    src = load_file(os.path.join(hf, "model.safetensors"))
    fp8, oracle = {}, {}
    ple_amax = {}
    if ple_scale == "tensor":
        for k, v in src.items():
            if ".ngram_embedding.shard_" in k:
                stem = k.split("shard_")[0]
                ple_amax[stem] = max(ple_amax.get(stem, 0.0), float(v.abs().max()))
    for k, v in src.items():
        if not _is_fp8_target(k):
            fp8[k] = oracle[k] = v
        elif ".ngram_embedding.shard_" in k and ple_scale == "tensor":
            stem = k.split("shard_")[0]
            s = torch.tensor([ple_amax[stem] / E4M3_MAX], dtype=torch.float32)
            q = (v / s).to(torch.float8_e4m3fn)
            fp8[k], fp8[stem + "weight_scale"] = q, s
            oracle[k] = q.float() * s
        else:
            q, s = _quantize_blocks(v, block)
            fp8[k], fp8[k + "_scale_inv"] = q, s
            oracle[k] = q.float() * _expand(s, block, *v.shape)
    if mutate is not None:
        mutate(fp8)
    qcfg = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head"],
    }
    if ple_scale == "tensor":  # transformers swaps in FP8Embedding only for the tables named here
        qcfg["modules_to_convert"] = ["ple_embedding.ngram_embedding"]
    fdir, odir = os.path.join(root, "fp8"), os.path.join(root, "oracle")
    _copy_side_files(hf, fdir, lambda c: c.__setitem__("quantization_config", qcfg))
    _copy_side_files(hf, odir)
    save_file(fp8, os.path.join(fdir, "model.safetensors"))
    save_file({k: v.contiguous() for k, v in oracle.items()}, os.path.join(odir, "model.safetensors"))
    return fdir, odir


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return tiny_checkpoint(str(tmp_path_factory.mktemp("fp8") / "hf"))


def _stores(d):
    skip = {"manifest.json", "config.json"}  # config differs by quantization_config only
    return {n: sha(os.path.join(d, n)) for n in sorted(os.listdir(d)) if n not in skip}


def test_e4m3_table_matches_torch():
    """The product decodes float8_e4m3fn without torch; the table equals
    torch's own conversion for all 256 bytes (NaN where torch has NaN)."""
    import torch

    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(E4M3FN, want, equal_nan=True)
    assert np.isnan(E4M3FN).sum() == 2 and E4M3FN[0x7E] == 448.0 and E4M3FN[0x01] == 2.0**-9


# [128, 128]: every block is partial (64-wide experts, 16-wide PLE rows);
# [48, 40]: several blocks per matrix with partial edge blocks both ways,
# and PLE chunks of 100 rows cut through scale blocks.
@pytest.mark.parametrize("block,ple_scale,chunk", [((128, 128), "tensor", None), ((48, 40), "block", 100)])
def test_fp8_source_converts_like_its_dequantized_twin(hf, tmp_path, monkeypatch, block, ple_scale, chunk):
    if chunk is not None:
        monkeypatch.setattr(sources_mod, "PLE_CHUNK_ROWS", chunk)
    fdir, odir = fp8_twins(hf, str(tmp_path), block, ple_scale)
    for profile in ({"dtype": "float32"}, {"q_bits": 4}):
        name = "-".join(f"{k}{v}" for k, v in profile.items())
        a, b = str(tmp_path / f"a-{name}"), str(tmp_path / f"b-{name}")
        ra = convert(fdir, a, quiet=True, **profile).report
        rb = convert(odir, b, quiet=True, **profile).report
        assert _stores(a) == _stores(b)
        assert ra["expert_records"] == rb["expert_records"] == 4 * 8


def test_fp8_artifact_logits_equal_dequantized(hf, tmp_path):
    import mlx.core as mx

    from hebrus_mlx import load

    fdir, odir = fp8_twins(hf, str(tmp_path), (48, 40))
    convert(fdir, str(tmp_path / "a"), dtype="float32", quiet=True)
    convert(odir, str(tmp_path / "b"), dtype="float32", quiet=True)
    ids = mx.array([[2, 3, 3, 2, 1, 0, 2, 3]])
    la = load(str(tmp_path / "a"))[0](ids)
    lb = load(str(tmp_path / "b"))[0](ids)
    assert np.array_equal(np.array(la), np.array(lb))


EXPERT = "model.layers.1.mlp.experts.5.down_proj.weight"
SHARD = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_2.weight"


def _set(key, fn):
    def mutate(t):
        t[key] = fn(t[key])

    return mutate


def _drop(key):
    return lambda t: t.pop(key)


def _nan_at(v):
    v = v.clone()
    v.view(-1)[-1] = float("nan")
    return v


def _inf_at(v):
    v = v.clone()
    v.view(-1)[0] = float("inf")
    return v


@pytest.mark.parametrize(
    "mutate,field,words",
    [
        (_drop(EXPERT + "_scale_inv"), f"source.{EXPERT}_scale_inv", "missing"),
        (_set(EXPERT + "_scale_inv", lambda v: v[:1]), f"source.{EXPERT}_scale_inv.shape", "!= [2, 2]"),
        (_set(EXPERT + "_scale_inv", _nan_at), f"source.{EXPERT}_scale_inv", "non-finite scale nan at block [1, 1]"),
        (_set(SHARD + "_scale_inv", _inf_at), f"source.{SHARD}_scale_inv", "non-finite scale inf at block [0, 0]"),
        (_set(EXPERT + "_scale_inv", lambda v: v.double()), f"source.{EXPERT}_scale_inv.dtype", "F64"),
    ],
)
def test_malformed_fp8_scales_are_typed_errors(hf, tmp_path, mutate, field, words):
    fdir, _ = fp8_twins(hf, str(tmp_path), (48, 40), mutate=mutate)
    out = str(tmp_path / "out")
    with pytest.raises(Fp8Error) as e:
        convert(fdir, out, dtype="float32", quiet=True)
    assert e.value.field == field and words in str(e.value)
    assert not os.path.exists(out)


def test_fp8_tensor_without_quantization_config_is_refused(hf, tmp_path):
    fdir, _ = fp8_twins(hf, str(tmp_path), (128, 128))
    _copy_side_files(hf, fdir)  # restores the plain config.json
    with pytest.raises(Fp8Error) as e:
        convert(fdir, str(tmp_path / "out"), dtype="float32", quiet=True)
    assert e.value.field.startswith("source.") and "no fp8 quantization_config" in str(e.value)


def test_unsupported_quantization_config_is_refused_at_the_cli(hf, tmp_path, capsys):
    fdir, _ = fp8_twins(hf, str(tmp_path), (128, 128))
    path = os.path.join(fdir, "config.json")
    cfg = json.load(open(path))
    cfg["quantization_config"]["weight_block_size"] = [128]
    json.dump(cfg, open(path, "w"))
    assert cli_main(["convert", "--hf-path", fdir, "--out", str(tmp_path / "out"), "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "quantization_config.weight_block_size" in err


def _has(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(not _has("accelerate"), reason="transformers' FP8 loader needs accelerate")
def test_transformers_reads_the_fixture_as_its_oracle(hf, tmp_path):
    """The FP8 twin is the layout transformers reads: loaded with
    FineGrainedFP8Config(dequantize=True), its experts equal the oracle twin
    bitwise, and its FP8Embedding PLE rows (per-tensor weight_scale) too.
    Blocks of 128 (every block partial here): transformers' dequantize-at-load
    derives the block from the scale grid (rows // grid rows) and so agrees
    with the ceil-grid layout only when each axis has one block or divides
    evenly; the partial-block case is checked against mlx-vlm below."""
    import torch
    from transformers import FineGrainedFP8Config, Qwen4ExpForCausalLM

    fdir, odir = fp8_twins(hf, str(tmp_path), (128, 128), "tensor")
    got = Qwen4ExpForCausalLM.from_pretrained(
        fdir, dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True)
    )
    want = Qwen4ExpForCausalLM.from_pretrained(odir, dtype=torch.float32).state_dict()
    state = got.state_dict()
    experts = [k for k in want if ".mlp.experts." in k]
    assert len(experts) == 8 and all(torch.equal(state[k], want[k]) for k in experts)
    table = got.model.layers[0].ple.ple_embedding.ngram_embedding
    assert type(table).__name__ == "FP8Embedding"
    rows = table(torch.arange(table.num_embeddings))
    assert torch.equal(rows, want["model.layers.0.ple.ple_embedding.ngram_embedding.weight"])


def test_partial_blocks_match_mlx_vlm_dequantizer(hf, tmp_path):
    """Edge blocks (48 x 48 blocks over 64 x 64 experts and 1024 x 16 PLE
    shards): the torch oracle equals mlx-vlm's independent block-FP8
    dequantizer (pad, reshape, scale; square blocks only) bit for bit, so the
    partial-block semantics are not this test's invention."""
    from support import mlx_vlm_fixture as V

    if not V.available():
        pytest.skip("mlx-vlm not unpacked")
    import importlib

    import mlx.core as mx
    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as load_torch

    V.import_mlx_vlm()
    dequantize = importlib.import_module("mlx_vlm.fp8")._dequantize_fp8_weight
    fdir, odir = fp8_twins(hf, str(tmp_path), (48, 48), "block")
    q = load_torch(os.path.join(fdir, "model.safetensors"))
    oracle = load_file(os.path.join(odir, "model.safetensors"))
    n = 0
    for k, scale in q.items():
        if k.endswith("_scale_inv"):
            w = k[: -len("_scale_inv")]
            got = dequantize(mx.array(q[w].view(torch.uint8).numpy()), mx.array(scale.numpy()), block_size=48)
            assert got.dtype == mx.float32 and np.array_equal(np.array(got), oracle[w]), w
            n += 1
    assert n == 4 * 8 * 3 + 4
