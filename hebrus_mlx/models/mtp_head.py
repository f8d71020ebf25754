"""Qwen4Exp multi-token-prediction (MTP) head.

The released checkpoint ships `mtp.*` beside the text model: given the target's final pre-mixer
streams h_t (after consuming token t, [hc_count * hidden]) and the embedding of token t+1, it
predicts token t+2. Pre-norms on both inputs (the stream norm is one RMS over all streams), two
hidden -> hidden projections, the projected embedding added to every stream, one indexed-attention
decoder layer (QSA + MoE + hyper-connections, no PLE) with its own KV cache, its own stream mixer,
then the target's lm_head. Its pre-mixer output streams stand in for h_{t+1} when drafting further.

The pinned transformers reference drops these weights; the independent cross-check is mlx-vlm
0.7.10's qwen4_exp_mtp drafter (tests/test_mtp_head.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..format.checkpoint_keys import CheckpointKeyError, check_mtp_key_set, classify_mtp
from ..format.qwen4exp_config import ModelArgs, mtp_layer_args
from .cache import AttentionCache
from .qwen4exp import DecoderLayer, HyperConnection, ZeroCenteredRMSNorm


class MTPHead(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        layer_args = mtp_layer_args(args)
        H, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(H, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(args.hc_count * H, eps)
        self.fc_embedding = nn.Linear(H, H, bias=False)
        self.fc_hidden = nn.Linear(H, H, bias=False)
        self.layers = [DecoderLayer(layer_args, 0)]
        self.hyper_connection_mixer = HyperConnection(layer_args, inject=False)

    def make_cache(self) -> AttentionCache:
        return AttentionCache()

    def fuse(self, embeddings: mx.array, hidden: mx.array) -> mx.array:
        """embeddings [B, L, H] of tokens t+1, hidden [B, L, hc*H] states h_t -> layer input streams."""
        B, L, W = hidden.shape
        if W != self.args.hc_count * self.args.hidden_size:
            raise ValueError(f"hidden: expected width {self.args.hc_count * self.args.hidden_size}, got {W}")
        e = self.fc_embedding(self.pre_fc_norm_embedding(embeddings))
        h = self.pre_fc_norm_hidden(hidden).reshape(B, L, self.args.hc_count, self.args.hidden_size)
        return (self.fc_hidden(h) + e[..., None, :]).reshape(B, L, W)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: AttentionCache):
        """One MTP step over L pairs (h_t, token t+1) appended to `cache`.

        Returns (mixed [B, L, H] for the target's lm_head, pre-mixer streams [B, L, hc*H]).
        """
        streams = self.layers[0](self.fuse(embeddings, hidden), None, cache)
        mixed, _ = self.hyper_connection_mixer.mix(streams)
        return mixed, streams


def sanitize_mtp(weights: dict, args: ModelArgs) -> dict | None:
    """HF `mtp.*` tensors (per-expert or fused experts) -> MTPHead parameter names, or None when
    the checkpoint has no MTP tensors. Non-MTP keys are ignored; the MTP set must be exact."""
    report = check_mtp_key_set(list(weights), args)
    if report is None:
        return None
    out, experts = {}, {}
    for raw in report["keys"].values():
        cls = classify_mtp(raw, args)
        value = weights[raw]
        if cls.kind == "dense":
            out[cls.runtime_key[len("mtp.") :]] = value
        elif cls.kind == "expert":
            experts.setdefault(cls.component, {})[cls.expert] = value
        else:
            prefix = "layers.0.mlp.switch_mlp."
            if cls.component == "gate_up_proj":
                half = value.shape[1] // 2  # gate rows first, as upstream chunks the projection
                out[prefix + "gate_proj.weight"] = value[:, :half]
                out[prefix + "up_proj.weight"] = value[:, half:]
            else:
                out[prefix + "down_proj.weight"] = value
    for component, per_expert in experts.items():
        out[f"layers.0.mlp.switch_mlp.{component}.weight"] = mx.stack([per_expert[e] for e in range(args.num_experts)])
    return out


def load_mtp_head(weights: dict, args: ModelArgs, dtype=mx.float32) -> MTPHead | None:
    """Build the head from raw checkpoint tensors; None when there are none."""
    runtime = sanitize_mtp(weights, args)
    if runtime is None:
        return None
    head = MTPHead(args)
    if dtype is not None:
        runtime = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in runtime.items()}
    try:
        head.load_weights(list(runtime.items()), strict=True)
    except ValueError as e:  # a wrong shape names the parameter
        raise CheckpointKeyError(f"MTP head: {e}") from None
    mx.eval(head.parameters())
    head.eval()
    return head


def attach_mtp_head(model, head: MTPHead | None) -> None:
    """Set `model.mtp_head` (None when the checkpoint/artifact has none) without making the head a
    child module: the target's parameters, weight loading and streaming attach stay unchanged."""
    object.__setattr__(model, "mtp_head", head)
