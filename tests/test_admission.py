"""Admission (AFN-004): one negative fixture per boundary, each asserting its
stage and field; plus the positive case and the no-MLX property.

Fixture provenance (AFN-014): the admitted artifact is converted from an
upstream transformers checkpoint (tests/support/artifact_fixture.py); every negative
is a contract control that mutates exactly one field of it.
"""

import hashlib
import json
import os
import subprocess
import sys

import pytest
from support.artifact_fixture import (
    copy_artifact,
    edit_manifest,
    edit_safetensors_header,
    edit_source_file,
    patch_bytes,
    tiny_artifact,
)

from hebrus_mlx.admission import STAGES, admit
from hebrus_mlx.artifact.errors import ArtifactError


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return tiny_artifact(str(tmp_path_factory.mktemp("adm")), dtype="float32")[1]


def _set(*path, value):
    """A fixture edit: the manifest's field at `path` (keys and list indexes) set to `value`."""

    def edit(m):
        for k in path[:-1]:
            m = m[k]
        m[path[-1]] = value

    return lambda d: edit_manifest(d, edit)


def _const(name, value):
    return _set("model_constants", name, value=value)


def _config(key, value):
    """Change config.json consistently (digest and manifest constants follow)."""

    def mutate(d):
        from hebrus_mlx.artifact.manifest import model_constants

        edit_source_file(d, "config.json", lambda b: json.dumps({**json.loads(b), key: value}).encode())
        with open(os.path.join(d, "config.json")) as f:
            consts = model_constants(json.load(f))
        edit_manifest(d, lambda m: m.__setitem__("model_constants", consts))

    return mutate


def _tensor(fn, inventory=False):
    return lambda d: edit_safetensors_header(d, fn, inventory=inventory)


def _ple_header(offset, fmt, value):
    return lambda d: patch_bytes(os.path.join(d, "ple.0.hbpl"), offset, fmt, value)


def _experts_header(offset, fmt, value):
    # Refresh the header digest so the geometry check, not the digest, fires.
    return lambda d: patch_bytes(
        os.path.join(d, "experts.hbem"), offset, fmt, value, digest_range=(0, 256), digest_at=160
    )


def _experts_entry(d):
    p = os.path.join(d, "experts.hbem")
    with open(p, "r+b") as f:
        f.seek(256 + 5 * 128 + 8)  # record 5 offset
        f.write((12345).to_bytes(8, "little"))
        f.seek(256)
        table = f.read(8 * 4 * 128)
        f.seek(96)
        f.write(hashlib.sha256(table).digest())
    patch_bytes(p, 8, "<I", 2, digest_range=(0, 256), digest_at=160)


def _swap_offsets(h):
    a, b = "model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias"
    h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]


def _overlap(h):
    a, b = "model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias"
    h[b]["data_offsets"] = list(h[a]["data_offsets"])


def _add_tensor(name):
    def fn(h):
        end = max(e["data_offsets"][1] for k, e in h.items() if k != "__metadata__")
        h[name] = {"dtype": "F32", "shape": [0], "data_offsets": [end, end]}

    return fn


def _second_experts_store(d):
    import shutil

    shutil.copy(os.path.join(d, "experts.hbem"), os.path.join(d, "experts2.hbem"))
    edit_manifest(
        d,
        lambda m: m["stores"].append(
            {**{k: v for k, v in m["stores"][1].items() if k != "fast_check"}, "path": "experts2.hbem"}
        ),
    )


def _foreign_mtp_store(d):
    """An MTP store whose file is not an MTP head (here: a copy of the dense file)."""
    import shutil

    shutil.copy(os.path.join(d, "model.safetensors"), os.path.join(d, "mtp.safetensors"))
    edit_manifest(
        d,
        lambda m: m["stores"].append(
            {**m["stores"][0], "role": "mtp", "path": "mtp.safetensors", "tensors": {}, "source_tensors": 0}
        ),
    )


def _stray_file(d):
    with open(os.path.join(d, "ple.9.hbpl"), "wb") as f:
        f.write(b"x")


def _bytes_edit(name, fn):
    return lambda d: edit_source_file(d, name, fn, refresh_digest=False)


A_LOG = "model.layers.0.linear_attn.A_log"
NORM = "model.layers.0.linear_attn.norm.weight"

# (id, mutation, stage, field prefix)
NEGATIVE_FIXTURES = [
    ("manifest-unknown-field", _set("extra", value=1), "bounds", "manifest.extra"),
    ("store-size", _set("stores", 1, "size", value=1), "bounds", "stores[1].size"),
    ("stray-store-file", _stray_file, "bounds", "bounds.ple.9.hbpl"),
    ("family-unregistered", _set("family", value="qwen9"), "family", "family"),
    ("family-other-geometry", _set("family", value="qwen3.8-flash-next"), "constants", "family.vocab_size"),
    ("profile", _set("profile", value="text-affine5-g64"), "family", "profile"),
    ("support-claim", _set("support", value="verified"), "family", "support"),
    ("config-digest", _bytes_edit("config.json", lambda b: b + b" "), "source", "source.files.config.json"),
    (
        "generation-config-digest",
        _bytes_edit("generation_config.json", lambda b: b + b" "),
        "source",
        "source.files.generation_config.json",
    ),
    ("config-hidden-size", _config("hidden_size", 128), "constants", "family.hidden_size"),
    (
        "config-layer-pattern",
        _config("layer_types", ["linear_attention"] * 2 + ["indexed_attention"] * 2),
        "constants",
        "family.layer_types",
    ),
    ("config-ple-base", _config("ngram_vocab_size_base", 1100), "constants", "family.ngram_vocab_size_base"),
    ("config-experts", _config("num_experts", 16), "constants", "family.num_experts"),
    ("layer-pattern", _const("layer_types", ["linear_attention"] * 4), "constants", "model_constants.layer_types[3]"),
    (
        "ple-prime",
        _const("ple_head_vocab_sizes", [[1009, 1013, 1019, 1031]]),
        "constants",
        "model_constants.ple_head_vocab_sizes[0]",
    ),
    (
        "ple-offset",
        _const("ple_head_offsets", [[0, 1009, 2022, 3042]]),
        "constants",
        "model_constants.ple_head_offsets[0]",
    ),
    ("ple-rows", _const("ple_rows", [4224]), "constants", "model_constants.ple_rows[0]"),
    ("ple-width", _const("ple_width", 32), "constants", "model_constants.ple_width"),
    (
        "ple-multiplier",
        _const("ple_layer_multipliers", [[1, 3, 5]]),
        "constants",
        "model_constants.ple_layer_multipliers[0]",
    ),
    ("constant-type-float", _const("hidden_size", 64.0), "constants", "model_constants.hidden_size"),
    ("constant-type-bool", _const("num_experts_per_tok", True), "constants", "model_constants.num_experts_per_tok"),
    (
        "constant-missing",
        lambda d: edit_manifest(d, lambda m: m["model_constants"].pop("seed")),
        "constants",
        "model_constants.seed",
    ),
    ("tokenizer-digest", _bytes_edit("tokenizer.json", lambda b: b + b" "), "tokenizer", "source.files.tokenizer.json"),
    (
        "template-digest",
        _bytes_edit("chat_template.jinja", lambda b: b + b" "),
        "tokenizer",
        "source.files.chat_template.jinja",
    ),
    (
        "eos-not-special",
        lambda d: edit_source_file(d, "tokenizer.json", lambda b: b.replace(b'"special": true', b'"special": false')),
        "tokenizer",
        "tokenizer.eos_token_ids",
    ),
    (
        "tensor-name",
        _tensor(lambda h: h.__setitem__("lm_head.weighx", h.pop("lm_head.weight"))),
        "tensors",
        "tensors.lm_head.weighx",
    ),
    ("tensor-shape", _tensor(lambda h: h[NORM].__setitem__("shape", [4, 4])), "tensors", f"tensors.{NORM}.shape"),
    ("tensor-dtype", _tensor(lambda h: h[NORM].__setitem__("dtype", "I32")), "tensors", f"tensors.{NORM}.dtype"),
    ("tensor-offset", _tensor(_swap_offsets), "tensors", f"tensors.{A_LOG}.offset"),
    (
        "tensor-length",
        _tensor(lambda h: h[NORM]["data_offsets"].__setitem__(1, h[NORM]["data_offsets"][1] - 4)),
        "tensors",
        f"tensors.{NORM}.length",
    ),
    ("tensor-missing", _tensor(lambda h: h.pop(NORM)), "tensors", f"tensors.{NORM}"),
    (
        "tensor-extra",
        _tensor(_add_tensor("model.layers.0.mlp.extra.weight")),
        "tensors",
        "tensors.model.layers.0.mlp.extra.weight",
    ),
    (
        "routed-expert-in-dense",
        _tensor(_add_tensor("model.layers.0.mlp.experts.0.gate_proj.weight")),
        "tensors",
        "tensors.model.layers.0.mlp.experts.0.gate_proj.weight",
    ),
    (
        "ple-shard-in-dense",
        _tensor(_add_tensor("model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight")),
        "tensors",
        "tensors.model.layers.0.ple.ple_embedding",
    ),
    ("overlap", _tensor(_overlap, inventory=True), "ownership", "ownership.model.safetensors"),
    (
        "experts-header-digest",
        lambda d: patch_bytes(os.path.join(d, "experts.hbem"), 32, "<I", 3),
        "experts",
        "experts.header_sha256",
    ),
    ("experts-top-k", _experts_header(32, "<I", 3), "experts", "experts.top_k"),
    ("experts-family-id", _experts_header(16, "<I", 4), "experts", "experts.family_id"),
    ("experts-codec", _experts_header(20, "<I", 3), "experts", "experts.codec_id"),
    ("experts-record-entry", _experts_entry, "experts", "experts.record[5]"),
    ("second-experts-store", _second_experts_store, "experts", "stores[3]"),
    ("ple-store-prime", _ple_header(120 + 4, "<I", 1019), "ple", "ple.head_sizes[1]"),
    ("ple-store-rows", _ple_header(56, "<Q", 4224), "ple", "ple.total_rows"),
    ("ple-store-width", _ple_header(28, "<I", 32), "ple", "ple.width"),
    ("ple-page-geometry", _ple_header(88, "<Q", 8192 * 2), "ple", "ple.page_stride"),
    ("ple-digest-table", _ple_header(512, "<I", 0xDEADBEEF), "ple", "ple.manifest_sha256"),
    ("ple-rows-per-page-record", _set("stores", 2, "rows_per_page", value=7), "ple", "stores[2].rows_per_page"),
    ("ple-layer", _set("stores", 2, "layer", value=1), "ple", "stores[2].layer"),
    ("mtp-store-not-a-head", _foreign_mtp_store, "mtp", "mtp.tensors.lm_head.weight"),
    ("vision-policy", _tensor(_add_tensor("model.visual.patch_embed.weight")), "policy", "policy.vision"),
    ("mtp-policy", _tensor(_add_tensor("mtp.fc.weight")), "policy", "policy.mtp"),
    ("modalities-policy", _set("policy", "modalities", value=["text", "image"]), "policy", "policy"),
    ("exclusion-counts", lambda d: edit_manifest(d, lambda m: m["exclusions"].pop("mtp")), "policy", "exclusions"),
    (
        "consumed-count",
        _set("conversion", "source_tensors_consumed", value=7),
        "policy",
        "conversion.source_tensors_consumed",
    ),
    (
        "conversion-state",
        _set("conversion", "state", value="partial"),
        "policy",
        "conversion.state",
    ),
]


def test_positive_artifact_is_admitted(artifact):
    """AFN-004: the unmutated artifact passes every stage and reports owners."""
    m = admit(artifact)
    r = m.report
    assert m.family.name == "qwen4exp-tiny-test" and m.experts.path == "experts.hbem" and m.args.hidden_size == 64
    assert r["admitted"] and r["family"] == "qwen4exp-tiny-test" and r["support"] == "unverified"
    assert r["expert_records"] == 4 * 8
    assert set(r["owners"]) == {"model.safetensors", "experts.hbem", "ple.0.hbpl"}
    # The converter records the norm convention it copied (tests/test_norm_weights.py: the loader).
    assert m.norm_weights == "zero_centered"
    with open(os.path.join(artifact, "manifest.json")) as f:
        assert json.load(f)["norm_weights"] == "zero_centered"


@pytest.mark.parametrize("name,mutate,stage,field", NEGATIVE_FIXTURES, ids=[f[0] for f in NEGATIVE_FIXTURES])
def test_negative_fixture_rejected_at_its_boundary(artifact, tmp_path, name, mutate, stage, field):
    """AFN-004: each single-field mutation fails at its own stage, naming its field."""
    d = copy_artifact(artifact, str(tmp_path / "a"))
    mutate(d)
    with pytest.raises(ArtifactError) as e:
        admit(d)
    assert (e.value.stage, e.value.field[: len(field)]) == (stage, field), str(e.value)


def test_fixture_matrix_covers_every_stage():
    """AFN-004: every admission boundary has at least one negative fixture."""
    assert {f[2] for f in NEGATIVE_FIXTURES} == set(STAGES)


def test_admit_cli_imports_no_mlx(artifact, tmp_path):
    """AFN-004: admission (pass and fail) runs without MLX ever being imported."""
    bad = copy_artifact(artifact, str(tmp_path / "bad"))
    edit_manifest(bad, lambda m: m.__setitem__("profile", "nope"))
    code = (
        "import sys, json\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r}); from support import families  # the tiny family\n"
        "from hebrus_mlx.cli import main\n"
        "rcs = [main(['admit', sys.argv[1]]), main(['admit', sys.argv[2]])]\n"
        "print(json.dumps({'rcs': rcs, 'mlx': any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, artifact, bad], capture_output=True, text=True, check=True)
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last == {"rcs": [0, 2], "mlx": False}
    assert out.stderr.splitlines() == [
        "hebrus-mlx admit: error: profile: unknown profile 'nope'; known: text-affine{2,3,4,6,8}-g{32,64,128}, "
        "text-bf16, text-f32, text-mixed/dense=..,experts=..,ple=.. (admission stage family)"
    ]


# ---- malformed-but-parseable input: typed errors from explicit checks, never a relabelled bug ----
_WRONG = [None, 0, -1, 1.5, True, "x", "", [], [0], {}, {"a": 1}]


def _paths(node, at=()):
    """Every (path) to a value in a JSON tree, containers included."""
    yield at
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, at + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, at + (i,))


def _set(root, path, value):
    node = root
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


def _mutations(tree, n, seed):
    import random

    rng = random.Random(seed)
    paths = [p for p in _paths(tree) if p]
    for _ in range(n):
        yield rng.choice(paths), rng.choice(_WRONG)


def _admit_typed(d):
    """Admission either passes or raises a typed error; anything else (KeyError, AttributeError,
    TypeError ...) is a bug in admission and fails the test."""
    try:
        admit(d)
    except ArtifactError:
        return "typed"
    return "admitted"


def test_manifest_values_of_the_wrong_type_are_typed_errors(artifact, tmp_path):
    """Contract control: 300 seeded JSON-valid manifests with one value swapped for a wrong-typed
    one (in the store list, the tensor inventory, the constants ...) end in an ArtifactError."""
    d = copy_artifact(artifact, str(tmp_path / "m"))
    with open(os.path.join(d, "manifest.json")) as f:
        pristine = json.load(f)
    outcomes = []
    for path, value in _mutations(pristine, 300, seed=7):
        m = json.loads(json.dumps(pristine))
        _set(m, path, value)
        with open(os.path.join(d, "manifest.json"), "w") as f:
            json.dump(m, f)
        outcomes.append((path, _admit_typed(d)))
    assert sum(o == "typed" for _, o in outcomes) > 250, outcomes


def test_tensor_inventory_entries_are_checked_explicitly(artifact, tmp_path):
    """One inventory record that is not an object, and offsets that are not a pair."""
    name = "lm_head.weight"
    for bad, field in (([1, 2], f"manifest.tensors.{name}"), ({"data_offsets": 3}, f"manifest.tensors.{name}")):
        d = copy_artifact(artifact, str(tmp_path / f"t{len(field)}{type(bad).__name__}"))
        edit_manifest(
            d, lambda m: m["tensors"].__setitem__(name, bad if isinstance(bad, list) else {**m["tensors"][name], **bad})
        )
        with pytest.raises(ArtifactError) as e:
            admit(d)
        assert e.value.field.startswith(field) and e.value.stage == "tensors", str(e.value)


def test_tokenizer_json_structure_is_checked_explicitly(artifact, tmp_path):
    """tokenizer.json that parses but has the wrong shape (digest refreshed, so the digest check
    passes): a typed error naming the tokenizer, not an AttributeError/TypeError."""
    cases = [
        (lambda t: [], "tokenizer.json"),
        (lambda t: {**t, "added_tokens": 5}, "tokenizer.added_tokens"),
        (lambda t: {**t, "model": []}, "tokenizer.model"),
        (lambda t: {**t, "model": {**t["model"], "vocab": {"a": "zero"}}}, "tokenizer.vocab"),
        (lambda t: {**t, "added_tokens": t["added_tokens"] + [{"id": "x", "special": True}]}, "tokenizer.added_tokens"),
    ]
    for i, (mutate, field) in enumerate(cases):
        d = copy_artifact(artifact, str(tmp_path / f"k{i}"))
        edit_source_file(d, "tokenizer.json", lambda b, mutate=mutate: json.dumps(mutate(json.loads(b))).encode())
        with pytest.raises(ArtifactError) as e:
            admit(d)
        assert e.value.field.startswith(field) and e.value.stage == "tokenizer", (i, str(e.value))


def test_a_bug_in_a_stage_is_not_relabelled_as_a_rejection(artifact, monkeypatch):
    """A genuine bug (here: a KeyError planted in a stage) propagates as itself."""
    from hebrus_mlx import admission

    def broken(self):
        return {}["planted"]

    monkeypatch.setattr(admission._Admission, "policy", broken)
    with pytest.raises(KeyError, match="planted"):
        admit(artifact)


def test_effective_vocabulary_is_checked_beside_the_physical_rows(tmp_path):
    """AFN-005: a product family's tokenizer must name exactly its effective vocabulary (the real
    family: IDs 0..248,076 of 248,320 physical rows; the demo: 0..4,104 of 4,224); one token more
    or less, or a gap, is refused at the tokenizer stage naming `tokenizer.effective_vocab_size`."""
    from hebrus_mlx.admission import EFFECTIVE_VOCAB, product_vocabulary
    from hebrus_mlx.artifact import constants as C
    from hebrus_mlx.loader import DEMO_DIR

    assert (EFFECTIVE_VOCAB["qwen3.8-flash-next"], C.QWEN38_FLASH_NEXT.vocab_size) == (248_077, 248_320)  # contract
    # the pairs whose loaded model masks its unassigned rows itself (tests/test_mlx_lm_generate.py)
    assert product_vocabulary(248_320, 248_077) and product_vocabulary(4224, 4105)
    assert not product_vocabulary(248_320, 248_320) and not product_vocabulary(512, 3)
    assert admit(str(DEMO_DIR)).family.name == "qwen4exp-demo"
    extra = {"id": 4105, "content": "<|extra|>", "special": True, "single_word": False}
    extra.update(lstrip=False, rstrip=False, normalized=False)
    cases = {
        "one-more": lambda t: {**t, "added_tokens": t["added_tokens"] + [extra]},
        "one-fewer": lambda t: {**t, "added_tokens": t["added_tokens"][:-1]},
        "gap": lambda t: {**t, "added_tokens": t["added_tokens"][:-1] + [{**t["added_tokens"][-1], "id": 4200}]},
    }
    for name, mutate in cases.items():
        d = copy_artifact(str(DEMO_DIR), str(tmp_path / name))
        edit_source_file(d, "tokenizer.json", lambda b, mutate=mutate: json.dumps(mutate(json.loads(b))).encode())
        with pytest.raises(ArtifactError) as e:
            admit(d)
        assert (e.value.stage, e.value.field) == ("tokenizer", "tokenizer.effective_vocab_size"), (name, str(e.value))
