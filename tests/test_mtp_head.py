"""MTP head (`mtp.*`) against an independent implementation: mlx-vlm 0.7.10's qwen4_exp_mtp drafter
on the same weights (tests/support/mtp_fixture.py). fp32, prompt longer than the QSA window so the head's
sparse selection is exercised, then autoregressive draft steps on the head's own streams."""

import mlx.core as mx
import numpy as np
import pytest
from support.mtp_fixture import mlx_vlm_available, mlx_vlm_drafter, mtp_checkpoint, mtp_tensors
from support.parity_fixtures import capture

from hebrus_mlx.format.checkpoint_keys import CheckpointKeyError, check_mtp_key_set
from hebrus_mlx.loader import load_hf_model
from hebrus_mlx.models.qwen4exp import Capture

TOL = 1e-5
needs_oracle = pytest.mark.skipif(not mlx_vlm_available(), reason="mlx-vlm 0.7.10 not unpacked")


@pytest.fixture(scope="module", params=["unfused", "fused"])
def ckpt(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"mtp_{request.param}")
    return mtp_checkpoint(d, "tiny_a", seed=3, layout=request.param)


def _target_states(model, ids):
    cap = Capture()
    mx.eval(model(ids, capture=cap))
    return cap.hidden[-1]


@needs_oracle
def test_draft_logits_match_mlx_vlm(ckpt):
    model = load_hf_model(ckpt)
    head = model.mtp_head
    assert head is not None
    ids = mx.array(capture("tiny_a")["input_ids"].astype(np.int32))
    assert ids.shape[1] - 1 > model.args.qsa_window  # sparse selection inside the head's layer
    h = _target_states(model, ids)
    oracle, _ = mlx_vlm_drafter(ckpt)

    # Pairs (h_t, token t+1) over the prompt, then 4 draft steps on each side's own streams.
    cache = head.make_cache()
    mixed, streams = head(model.model.embed_tokens(ids[:, 1:]), h[:, :-1], cache)
    ours = model.lm_head(mixed)
    ref_mixed, ref_streams = oracle._forward_tokens(ids[:, 1:], h[:, :-1], mx.int32)
    ref = oracle._lm_head_fn(ref_mixed)
    err = np.abs(np.array(ours) - np.array(ref)).max()
    assert err <= TOL, f"prefill draft logits max |diff| {err}"
    assert np.abs(np.array(streams) - np.array(ref_streams)).max() <= TOL
    for step in range(4):
        tok = mx.argmax(ours[:, -1:], axis=-1).astype(mx.int32)
        assert tok.item() == mx.argmax(ref[:, -1:], axis=-1).item(), f"step {step}: draft token differs"
        mixed, streams = head(model.model.embed_tokens(tok), streams[:, -1:], cache)
        ours = model.lm_head(mixed)
        ref_mixed, ref_streams = oracle._forward_tokens(tok, ref_streams[:, -1:], mx.int32)
        ref = oracle._lm_head_fn(ref_mixed)
        err = np.abs(np.array(ours) - np.array(ref)).max()
        assert err <= TOL, f"draft step {step}: logits max |diff| {err}"
    # Control: the comparison can fail — a perturbed head disagrees with the oracle.
    head.fc_hidden.weight = head.fc_hidden.weight * 1.01
    cache = head.make_cache()
    mixed, _ = head(model.model.embed_tokens(ids[:, 1:]), h[:, :-1], cache)
    ref_mixed, _ = mlx_vlm_drafter(ckpt)[0]._forward_tokens(ids[:, 1:], h[:, :-1], mx.int32)
    assert np.abs(np.array(model.lm_head(mixed)) - np.array(oracle._lm_head_fn(ref_mixed))).max() > 100 * TOL


def test_checkpoint_without_mtp_has_no_head():
    from support.parity_fixtures import PARITY

    assert load_hf_model(PARITY / "tiny_a").mtp_head is None


def test_malformed_mtp_key_sets_are_named():
    import json

    from support.parity_fixtures import PARITY

    from hebrus_mlx.format.qwen4exp_config import ModelArgs

    config = json.loads((PARITY / "tiny_a" / "config.json").read_text())
    args = ModelArgs.from_dict(config)
    good = mtp_tensors(config)
    assert check_mtp_key_set(list(good), args)["consumed"] == len(good)
    missing = dict(good)
    missing.pop("mtp.fc_hidden.weight")
    with pytest.raises(CheckpointKeyError, match="mtp.fc_hidden.weight"):
        check_mtp_key_set(list(missing), args)
    for extra in ("mtp.layers.1.mlp.gate.weight", "mtp.layers.0.ple.key_proj.weight", "mtp.norm.weight"):
        with pytest.raises(CheckpointKeyError, match=extra.replace(".", r"\.")):
            check_mtp_key_set(list(good) + [extra], args)
    mixed = list(good) + ["mtp.layers.0.mlp.experts.gate_up_proj"]
    with pytest.raises(CheckpointKeyError, match="mixes fused"):
        check_mtp_key_set(mixed, args)
