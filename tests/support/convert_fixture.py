"""Conversion sources for the loader and convert tests.

`parity_source`: a reference checkpoint of tests/support/fixtures/parity staged with
a tokenizer. Provenance (AFN-014): config and tensors are the committed
upstream-captured checkpoint; tokenizer.json (the config's EOS ids as special
tokens) and the chat template are contract controls written here.

`bulk_checkpoint`: synthetic expert-heavy checkpoint for the bounded-memory
conversion evidence (family qwen4exp-bulk-test: 4 layers x 256 experts of
[256 x 128]). Provenance: contract control. Values are seeded Gaussian noise;
the key set and shapes follow the checkpoint key tables, PLE constant buffers
are derived from the config. Only memory and throughput are measured on it,
never numerics. Written shard by shard with the safetensors numpy writer, so
building it holds one layer's experts (~100 MB) at a time.
"""

import json
import os
import shutil

import numpy as np

from support import families  # noqa: F401  (registers the bulk family)
from support.artifact_fixture import TINY_CONFIG, word_level_tokenizer
from support.parity_fixtures import PARITY

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def parity_source(name, d):
    """Copy reference checkpoint `name` into `d` and add tokenizer files."""
    os.makedirs(d, exist_ok=True)
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(PARITY / name / f, d)
    with open(PARITY / name / "config.json") as f:
        eos = json.load(f)["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    tok = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": i,
                "content": f"<|eos{i}|>",
                "special": True,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
            }
            for i in eos
        ],
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0}, "unk_token": "<unk>"},
    }
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    return d


# The tiny artifact's config widened: 256 experts of 256 (bulk conversion), head dims of 32.
BULK_CONFIG = dict(
    TINY_CONFIG,
    architectures=["Qwen4ExpForCausalLM"],
    model_type="qwen4_exp_text",
    hidden_size=128,
    head_dim=32,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    moe_intermediate_size=256,
    num_experts=256,
    num_experts_per_tok=8,
    indexer_head_dim=32,
)

TOKENIZER = word_level_tokenizer()


def bulk_checkpoint(d, seed=0):
    """Write the checkpoint into `d`; returns its total safetensors bytes."""
    from safetensors.numpy import save_file

    from hebrus_mlx.artifact import manifest as M
    from hebrus_mlx.format import checkpoint_keys as keys
    from hebrus_mlx.format.qwen4exp_config import (
        ModelArgs,
        ple_constants,
        ple_table_rows,
    )

    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(BULK_CONFIG, f)
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(TOKENIZER, f)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    args = ModelArgs.from_dict(BULK_CONFIG)
    rng = np.random.default_rng(seed)

    def noise(shape):
        return rng.standard_normal(shape, dtype=np.float32) * 0.02

    rest = {}
    shapes = M.dense_shapes(args)
    for key in sorted(keys.expected_hf_keys(args)):
        if ".mlp.experts." in key:
            continue
        if key in shapes:
            shape = shapes[key]
            if key.endswith(keys.DEPTHWISE_CONV_SUFFIXES):
                shape = (shape[0], 1, shape[1])  # HF layout [C, 1, K]
            rest[key] = noise(shape)
        elif ".ngram_embedding.shard_" in key:
            t = args.ple_index(int(key.split(".")[2]))
            rest[key] = noise(
                (ple_table_rows(args, t) // args.split_ngram_parts, args.ple_embed_dim // args.ngram_heads)
            )
        else:  # PLE constant buffer
            t = args.ple_index(int(key.split(".")[2]))
            rest[key] = np.array(ple_constants(args, t)[key.rsplit(".", 1)[1]], np.int64)
    save_file(rest, os.path.join(d, "model-rest.safetensors"))
    h, m = args.hidden_size, args.moe_intermediate_size
    for layer in range(args.num_hidden_layers):
        shard = {}
        for e in range(args.num_experts):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            shard[p + "gate_proj.weight"] = noise((m, h))
            shard[p + "up_proj.weight"] = noise((m, h))
            shard[p + "down_proj.weight"] = noise((h, m))
        save_file(shard, os.path.join(d, f"model-experts-{layer}.safetensors"))
        del shard
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
