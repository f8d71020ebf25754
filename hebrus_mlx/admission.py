"""`hebrus-mlx admit DIR`: CPU-only, ordered artifact admission (AFN-004).

Stages run cheapest-first and the first failure stops admission, naming its
field:

    bounds -> family/profile -> source digests -> model constants ->
    tokenizer/template identity -> exact tensor set -> ExpertMajor manifest
    and records -> PLE manifest and geometry -> optional MTP head store ->
    policy -> byte ownership

No stage reads a sparse payload, and this module imports no MLX at all
(a test runs it in a subprocess and checks sys.modules): `load()` calls
`admit()` before it allocates a single graph buffer.
"""

import hashlib
import json
import os

from .artifact import constants as C
from .artifact import expert_major as em
from .artifact import fast_check as FC
from .artifact import manifest as M
from .artifact import untrusted as U
from .artifact.errors import AdmissionError, ArtifactError
from .artifact.expert_major import ExpertMajorReader
from .artifact.ple_pages import PleReader
from .artifact.safetensors import read_safetensors_header
from .format import checkpoint_keys as keys
from .format.qwen4exp_config import ConfigError, mtp_layer_args

STAGES = (
    "bounds",
    "family",
    "source",
    "constants",
    "tokenizer",
    "tensors",
    "experts",
    "ple",
    "mtp",
    "policy",
    "ownership",
)

# The tokenizer's effective vocabulary of the product's families (AFN-005): IDs [0, n) name tokens,
# the physical rows past n (family vocab_size: 248,320 and 4,224) are unassigned. Both numbers are
# admission equalities; a family registered elsewhere (tests, tools) pins none.
EFFECTIVE_VOCAB = {C.QWEN38_FLASH_NEXT.name: 248_077, C.QWEN4EXP_DEMO.name: 4105}


def product_vocabulary(physical_rows: int, effective_ids: int) -> bool:
    """Whether (physical output rows, tokenizer IDs) is a product family's pair (248,320 / 248,077;
    the demo's 4,224 / 4,105), artifact or HF checkpoint alike: the loaded model then masks its
    unassigned rows itself (models.qwen4exp.Model.effective_vocab_size)."""
    return any((C.family(name).vocab_size, n) == (physical_rows, effective_ids) for name, n in EFFECTIVE_VOCAB.items())


_TENSOR_FIELDS = {"dtype", "shape", "data_offsets", "codec", "sha256"}  # sha256: optional, all or none
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_REQUIRED_KEYS = {
    "schema": str,
    "schema_version": int,
    "family": str,
    "profile": str,
    "support": str,
    "source": dict,
    "model_constants": dict,
    "codecs": dict,
    "stores": list,
    "tensors": dict,
    "policy": dict,
    "exclusions": dict,
    "conversion": dict,
}
# Optional in schema v1; absent means C.NORM_WEIGHTS_DEFAULT_V1 (see constants.NORM_WEIGHTS).
_OPTIONAL_KEYS = {"norm_weights": str}


class Report(dict):
    """The JSON ownership report of an admitted artifact."""

    def to_json(self):
        return json.dumps(self, indent=1, sort_keys=True)


class _Admission:
    def __init__(self, path):
        self.dir = os.path.abspath(path)
        self.owners = {}  # file -> [(start, end, owner)]
        self.sources = {}  # source identity file -> the bytes whose digest was checked
        self.fast = {}  # store path -> its admitted XXH3-128 digest table (artifact/fast_check.py)

    def file(self, name):
        return os.path.join(self.dir, name)

    # 1 ------------------------------------------------------------------
    def bounds(self):
        if not os.path.isdir(self.dir):
            raise AdmissionError("path", f"{self.dir} is not a directory")
        try:  # a regular file of the directory (no symlink), size-capped before it is read
            m = U.loads(U.read_bytes(self.dir, C.MANIFEST_NAME, "manifest", field="manifest"), "manifest")
        except FileNotFoundError:
            raise AdmissionError("manifest", "manifest.json missing") from None
        if type(m) is not dict:
            raise AdmissionError("manifest", "must be a JSON object")
        for k, t in _REQUIRED_KEYS.items():
            if type(m.get(k)) is not t:
                raise AdmissionError(f"manifest.{k}", f"must be {t.__name__}")
        extra = sorted(set(m) - set(_REQUIRED_KEYS) - set(_OPTIONAL_KEYS))
        if extra:
            raise AdmissionError(f"manifest.{extra[0]}", "unknown manifest field")
        if m["schema"] != C.MANIFEST_SCHEMA or m["schema_version"] != C.MANIFEST_SCHEMA_VERSION:
            raise AdmissionError("manifest.schema_version", f"{m['schema']} v{m['schema_version']} unsupported")
        norms = m.get("norm_weights", C.NORM_WEIGHTS_DEFAULT_V1)
        if type(norms) is not str or norms not in C.NORM_WEIGHTS:
            raise AdmissionError("manifest.norm_weights", f"{norms!r} is not one of {list(C.NORM_WEIGHTS)}")
        owned = {C.MANIFEST_NAME}
        for i, s in enumerate(m["stores"]):
            field = f"stores[{i}]"
            if type(s) is not dict or type(s.get("path")) is not str or type(s.get("size")) is not int:
                raise AdmissionError(field, "store needs path (str) and size (int)")
            p = s["path"]
            if not p or "/" in p or "\\" in p or p.startswith(".") or p == C.MANIFEST_NAME:
                raise AdmissionError(f"{field}.path", f"{p!r} is not a plain file name in the artifact")
            if p in owned:
                raise AdmissionError(f"{field}.path", f"{p!r} is owned twice")
            full = self.file(p)
            if not os.path.isfile(full) or os.path.islink(full):
                raise AdmissionError(f"{field}.path", f"{p!r} missing or not a regular file")
            if os.path.getsize(full) != s["size"]:
                raise AdmissionError(
                    f"{field}.size", f"file is {os.path.getsize(full)} bytes, manifest says {s['size']}"
                )
            if type(s.get("sha256")) is not str or len(s["sha256"]) != 64:
                raise AdmissionError(f"{field}.sha256", "must be a hex SHA-256")
            owned.add(p)
            table = FC.claim(field, s, owned)
            if table is not None:
                owned.add(table)
        files = m["source"].get("files")
        if type(files) is not dict:
            raise AdmissionError("source.files", "must be an object")
        owned |= set(files)
        for name in sorted(os.listdir(self.dir)):
            if name not in owned:
                raise AdmissionError(f"bounds.{name}", "file not owned by the manifest")
        self.m = m

    # 2 ------------------------------------------------------------------
    def family(self):
        m = self.m
        self.fam = C.family(m["family"], "family")
        try:  # a named profile, or the canonical mixed name of known per-component codecs
            want = C.profile_codecs(m["profile"], "profile")
        except ArtifactError as e:
            raise AdmissionError(e.field, e.message) from None
        for comp in sorted(set(m["codecs"]) | set(want)):
            if m["codecs"].get(comp) != want.get(comp):
                raise AdmissionError(
                    f"codecs.{comp}", f"{m['codecs'].get(comp)!r} != profile {m['profile']} {want.get(comp)!r}"
                )
        if m["support"] != M.support_status(m["profile"]):
            raise AdmissionError("support", f"{m['support']!r}: profile {m['profile']} has not passed its parity gate")

    # 3 ------------------------------------------------------------------
    def _check_digest(self, name, required):
        """Read a source identity file once and check its digest; later stages parse exactly
        these bytes (`self.sources`), never the file again."""
        files = self.m["source"]["files"]
        field = f"source.files.{name}"
        if name not in files:
            if required:
                raise AdmissionError(field, "missing")
            return False
        try:  # regular, inside the directory, bounded (untrusted.LIMITS) before it is read
            data = U.read_bytes(self.dir, name, field=field)
        except FileNotFoundError:
            raise AdmissionError(field, "listed but absent") from None
        if hashlib.sha256(data).hexdigest() != files[name]:
            raise AdmissionError(field, "digest mismatch")
        self.sources[name] = data
        return True

    def source(self):
        src = self.m["source"]
        for k in ("repo", "revision"):
            if src.get(k) is not None and type(src.get(k)) is not str:
                raise AdmissionError(f"source.{k}", "must be a string or null")
        for name in src["files"]:
            if name not in C.SOURCE_FILES:
                raise AdmissionError(f"source.files.{name}", "not a source identity file")
        self._check_digest("config.json", True)
        self._check_digest("generation_config.json", False)

    # 4 ------------------------------------------------------------------
    def constants(self):
        config = self.config = _json(self.sources["config.json"], "config")
        try:
            self.args = M.model_args(config)
            want = M.model_constants(config)
        except ConfigError as e:
            raise AdmissionError(e.field, e.message) from None
        M.check_constants(self.m["model_constants"], want)
        C.match_family(want, self.fam.name)
        self.consts = want

    # 5 ------------------------------------------------------------------
    def tokenizer(self):
        self._check_digest("tokenizer.json", True)
        self._check_digest("tokenizer_config.json", False)
        has_template = self._check_digest("chat_template.jinja", False)
        if not has_template:
            tc = {}
            if "tokenizer_config.json" in self.m["source"]["files"]:
                tc = _json(self.sources["tokenizer_config.json"], "tokenizer_config.json")
            if not isinstance(tc, dict) or not isinstance(tc.get("chat_template"), str):
                raise AdmissionError("source.files.chat_template.jinja", "no chat template in the artifact")
        tok = _json(self.sources["tokenizer.json"], "tokenizer.json")
        if type(tok) is not dict:
            raise AdmissionError("tokenizer.json", "must be a JSON object")
        added_tokens = tok.get("added_tokens", [])
        if type(added_tokens) is not list:
            raise AdmissionError("tokenizer.added_tokens", "must be a list")
        added = {}
        for i, t in enumerate(added_tokens):
            if type(t) is not dict or type(t.get("id")) is not int:
                raise AdmissionError(f"tokenizer.added_tokens[{i}]", "must be an object with an integer id")
            added[t["id"]] = t
        for eos in self.consts["eos_token_ids"]:
            if eos not in added or not added[eos].get("special"):
                raise AdmissionError(
                    "tokenizer.eos_token_ids", f"eos id {eos} is not a special token of tokenizer.json"
                )
        model = tok.get("model", {})
        if type(model) is not dict:
            raise AdmissionError("tokenizer.model", "must be an object")
        vocab = model.get("vocab", {})
        ids = list(vocab.values()) if isinstance(vocab, dict) else []
        if not all(type(i) is int for i in ids):
            raise AdmissionError("tokenizer.vocab", "token ids must be integers")
        top = max(ids + list(added), default=-1)
        if top >= self.consts["vocab_size"]:
            raise AdmissionError("tokenizer.vocab", f"token id {top} >= physical vocab {self.consts['vocab_size']}")
        want = EFFECTIVE_VOCAB.get(self.fam.name)
        if want is not None:
            n = len(set(ids) | set(added))
            if n != want or top != n - 1:
                raise AdmissionError(
                    "tokenizer.effective_vocab_size",
                    f"{n} token IDs up to {top}; family {self.fam.name} has IDs 0..{want - 1} "
                    f"({want} of {self.consts['vocab_size']} physical rows)",
                )

    # 6 ------------------------------------------------------------------
    def tensors(self):
        dense = [(i, s) for i, s in enumerate(self.m["stores"]) if s.get("role") == "dense"]
        if len(dense) != 1:
            raise AdmissionError("stores.dense", f"{len(dense)} dense stores; exactly one required")
        i, s = dense[0]
        if s.get("format") != "safetensors":
            raise AdmissionError(f"stores[{i}].format", f"{s.get('format')!r} != 'safetensors'")
        n, header, _ = read_safetensors_header(self.file(s["path"]))
        self.dense_path, self.dense_header_len, self.dense = s["path"], n, header
        self.excluded_present = {}
        expected = M.stored_tensors(self.args, self.m["profile"])
        for name in sorted(header):
            rule = keys.exclusion_rule(name)
            if rule is not None:  # judged by the policy stage
                self.excluded_present.setdefault(rule, name)
                continue
            cls = _classify(name, self.args)
            if cls in ("expert", "fused_expert"):
                raise AdmissionError(f"tensors.{name}", "routed expert tensor must live in the ExpertMajor store")
            if cls in ("ple_shard", "ple_constant"):
                raise AdmissionError(f"tensors.{name}", "PLE table tensor must live in the PLE page store")
            if name not in expected:
                raise AdmissionError(f"tensors.{name}", "extra tensor")
        for name, (dtype, shape) in sorted(expected.items()):
            if name not in header:
                raise AdmissionError(f"tensors.{name}", "missing tensor")
            e = header[name]
            if tuple(e["shape"]) != shape:
                raise AdmissionError(f"tensors.{name}.shape", f"{e['shape']} != expected {list(shape)}")
            if e["dtype"] != dtype:
                raise AdmissionError(f"tensors.{name}.dtype", f"{e['dtype']} != expected {dtype}")
        inv = self.m["tensors"]
        shapes = M.dense_shapes(self.args)
        for name in sorted(set(inv) | set(expected)):
            rec = inv.get(name)
            if rec is None:
                raise AdmissionError(f"manifest.tensors.{name}", "missing from the manifest inventory")
            if name not in expected:
                raise AdmissionError(f"manifest.tensors.{name}", "not in the expected tensor set")
            if type(rec) is not dict:
                raise AdmissionError(f"manifest.tensors.{name}", "must be an object")
            unknown = sorted(set(rec) - _TENSOR_FIELDS)
            if unknown:
                raise AdmissionError(f"manifest.tensors.{name}.{unknown[0]}", "unknown inventory field")
            digest = rec.get("sha256")
            if ("sha256" in rec) != ("sha256" in inv[min(inv)]):
                raise AdmissionError(f"manifest.tensors.{name}.sha256", "per-tensor digests are all or none")
            if "sha256" in rec and not _is_sha256(digest):
                raise AdmissionError(f"manifest.tensors.{name}.sha256", "must be a lowercase hex SHA-256")
            offs = rec.get("data_offsets")
            if type(offs) is not list or len(offs) != 2:
                raise AdmissionError(f"manifest.tensors.{name}.data_offsets", f"{offs!r} is not a [begin, end] pair")
            e = header[name]
            if rec.get("dtype") != e["dtype"] or rec.get("shape") != e["shape"]:
                raise AdmissionError(f"manifest.tensors.{name}", "dtype/shape disagree with the dense file")
            if type(rec.get("codec")) is not str or rec["codec"] not in C.CODECS:
                raise AdmissionError(f"manifest.tensors.{name}.codec", f"unknown codec {rec.get('codec')!r}")
            # The loader builds quantized layers from this field, so it must be
            # exactly the codec the profile gives the tensor.
            wkey = name if name in shapes else name.rsplit(".", 1)[0] + ".weight"
            want_codec = M.dense_codec(wkey, shapes[wkey], self.m["profile"])
            if rec["codec"] != want_codec:
                raise AdmissionError(
                    f"manifest.tensors.{name}.codec", f"{rec['codec']!r} != profile codec {want_codec!r}"
                )
            if offs[0] != e["data_offsets"][0]:
                raise AdmissionError(f"tensors.{name}.offset", f"{e['data_offsets'][0]} != manifest {offs}")
            if offs != e["data_offsets"]:
                raise AdmissionError(f"tensors.{name}.length", f"{e['data_offsets']} != manifest {offs}")
        self.dense_digests = bool(inv) and "sha256" in inv[min(inv)]
        base = 8 + n
        self.owners[self.dense_path] = [(0, base, "safetensors.header")] + [
            (base + e["data_offsets"][0], base + e["data_offsets"][1], f"tensor:{name}") for name, e in header.items()
        ]

    # 7 ------------------------------------------------------------------
    def experts(self):
        found = [(i, s) for i, s in enumerate(self.m["stores"]) if s.get("role") == "experts"]
        if len(found) != 1:
            where = f"stores[{found[1][0]}]" if len(found) > 1 else "stores.experts"
            raise AdmissionError(where, f"{len(found)} ExpertMajor stores; exactly one required")
        i, s = found[0]
        if s.get("codec") != self.m["codecs"]["experts"]:
            raise AdmissionError(f"stores[{i}].codec", f"{s.get('codec')!r} != profile {self.m['codecs']['experts']!r}")
        per_layer = s["codec"] == C.PER_LAYER
        fmt = "expert_major.v3" if per_layer else "expert_major.v2"
        if s.get("format") != fmt:
            raise AdmissionError(f"stores[{i}].format", f"{s.get('format')!r} != {fmt!r}")
        if per_layer != ("layer_codecs" in s):
            raise AdmissionError(
                f"stores[{i}].layer_codecs",
                "required by a per-layer expert store" if per_layer else f"only a {C.PER_LAYER!r} store has one",
            )
        spec = s["codec"]
        if per_layer:  # one [gate, up, down] of known codec names per layer, not all one codec
            try:
                spec = em.Geometry(self.fam, s["layer_codecs"]).layer_codecs
            except ArtifactError as e:
                raise AdmissionError(e.field.replace("experts.", f"stores[{i}].", 1), e.message) from None
        with ExpertMajorReader(self.file(s["path"]), self.fam, spec) as r:
            self.owners[s["path"]] = r.extents()
            self.expert_records = r.geometry.count
        self._fast(i, s, self.expert_records)

    # 8 ------------------------------------------------------------------
    def ple(self):
        found = [(i, s) for i, s in enumerate(self.m["stores"]) if s.get("role") == "ple"]
        if len(found) != self.fam.ple_tables:
            where = f"stores[{found[-1][0]}]" if len(found) > self.fam.ple_tables else "stores.ple"
            raise AdmissionError(where, f"{len(found)} PLE stores; family has {self.fam.ple_tables} tables")
        seen = set()
        for i, s in found:
            t = s.get("table")
            if type(t) is not int or not 0 <= t < self.fam.ple_tables or t in seen:
                raise AdmissionError(f"stores[{i}].table", f"{t!r} is not a fresh table index")
            seen.add(t)
            if s.get("layer") != self.consts["ple_layer_ids"][t] - 1:
                raise AdmissionError(
                    f"stores[{i}].layer", f"{s.get('layer')!r} != PLE layer {self.consts['ple_layer_ids'][t] - 1}"
                )
            if s.get("format") != "ple_pages.v1":
                raise AdmissionError(f"stores[{i}].format", f"{s.get('format')!r} != 'ple_pages.v1'")
            if s.get("codec") != self.m["codecs"]["ple"]:
                raise AdmissionError(f"stores[{i}].codec", f"{s.get('codec')!r} != profile {self.m['codecs']['ple']!r}")
            with PleReader(self.file(s["path"]), self.fam, s["codec"]) as r:
                h, c = r.header, self.consts
                if h["table_index"] != t:
                    raise AdmissionError("ple.table_index", f"store holds table {h['table_index']}, manifest says {t}")
                if h["total_rows"] != c["ple_rows"][t]:
                    raise AdmissionError("ple.rows", f"{h['total_rows']} != config {c['ple_rows'][t]}")
                if h["width"] != c["ple_width"]:
                    raise AdmissionError("ple.width", f"{h['width']} != config {c['ple_width']}")
                if list(r.geometry.heads) != c["ple_head_vocab_sizes"][t]:
                    raise AdmissionError("ple.primes", "head primes disagree with config")
                if s.get("rows_per_page") != h["rows_per_page"]:
                    raise AdmissionError(
                        f"stores[{i}].rows_per_page", f"{s.get('rows_per_page')!r} != store {h['rows_per_page']}"
                    )
                self.owners[s["path"]] = r.extents()
                self._fast(i, s, r.geometry.num_pages)

    # 9 ------------------------------------------------------------------
    def mtp(self):
        """The optional MTP head store: one safetensors file whose tensors are exactly the head's
        under the profile's codecs, inventoried in its store entry like the dense file."""
        found = [(i, s) for i, s in enumerate(self.m["stores"]) if s.get("role") == "mtp"]
        self.mtp_path = None
        if not found:
            return
        if len(found) > 1:
            raise AdmissionError(f"stores[{found[1][0]}]", f"{len(found)} MTP stores; at most one")
        i, s = found[0]
        field = f"stores[{i}]"
        if s.get("format") != "safetensors":
            raise AdmissionError(f"{field}.format", f"{s.get('format')!r} != 'safetensors'")
        if s.get("codec") != self.m["codecs"]["dense"]:
            raise AdmissionError(f"{field}.codec", f"{s.get('codec')!r} != profile {self.m['codecs']['dense']!r}")
        try:
            mtp_layer_args(self.args)
        except ConfigError as e:
            raise AdmissionError(f"config.{e.field}", str(e)) from None
        try:
            n, header, _ = read_safetensors_header(self.file(s["path"]))
        except AdmissionError as e:
            raise AdmissionError("mtp." + e.field, str(e).split(": ", 1)[-1]) from None
        expected = M.mtp_stored_tensors(self.args, self.m["profile"])
        for name in sorted(header):
            if name not in expected:
                raise AdmissionError(f"mtp.tensors.{name}", "extra tensor")
        for name, (dtype, shape, _) in expected.items():
            if name not in header:
                raise AdmissionError(f"mtp.tensors.{name}", "missing tensor")
            if tuple(header[name]["shape"]) != shape:
                raise AdmissionError(f"mtp.tensors.{name}.shape", f"{header[name]['shape']} != expected {list(shape)}")
            if header[name]["dtype"] != dtype:
                raise AdmissionError(f"mtp.tensors.{name}.dtype", f"{header[name]['dtype']} != expected {dtype}")
        inv = s.get("tensors")
        if type(inv) is not dict:
            raise AdmissionError(f"{field}.tensors", "must be the MTP tensor inventory object")
        for name in sorted(set(inv) | set(expected)):
            rec = inv.get(name)
            if type(rec) is not dict:
                raise AdmissionError(f"{field}.tensors.{name}", "missing from the MTP inventory")
            if name not in expected:
                raise AdmissionError(f"{field}.tensors.{name}", "not in the expected MTP tensor set")
            unknown = sorted(set(rec) - {"dtype", "shape", "data_offsets", "codec"})
            if unknown:
                raise AdmissionError(f"{field}.tensors.{name}.{unknown[0]}", "unknown inventory field")
            e = header[name]
            if rec.get("dtype") != e["dtype"] or rec.get("shape") != e["shape"]:
                raise AdmissionError(f"{field}.tensors.{name}", "dtype/shape disagree with the MTP file")
            if rec.get("codec") != expected[name][2]:
                raise AdmissionError(
                    f"{field}.tensors.{name}.codec", f"{rec.get('codec')!r} != profile codec {expected[name][2]!r}"
                )
            if rec.get("data_offsets") != e["data_offsets"]:
                raise AdmissionError(
                    f"{field}.tensors.{name}.data_offsets", f"{rec.get('data_offsets')} != file {e['data_offsets']}"
                )
        allowed = {len(keys.expected_mtp_keys(self.args, layout)) for layout in ("unfused", "fused")}
        if type(s.get("source_tensors")) is not int or s["source_tensors"] not in allowed:
            raise AdmissionError(
                f"{field}.source_tensors",
                f"{s.get('source_tensors')!r} not in the MTP key-table counts {sorted(allowed)}",
            )
        self._fast(i, s, FC.mtp_units(s["size"]))
        base = 8 + n
        self.mtp_path = s["path"]
        self.owners[s["path"]] = [(0, base, "safetensors.header")] + [
            (base + e["data_offsets"][0], base + e["data_offsets"][1], f"mtp:{name}") for name, e in header.items()
        ]

    def _fast(self, i, s, units):
        if "fast_check" in s:
            self.fast[s["path"]] = FC.admit_table(self.dir, f"stores[{i}]", s, units)

    # 10 -----------------------------------------------------------------
    def policy(self):
        m = self.m
        # Fast checks: every per-unit store or none (an artifact from before the check); never
        # on a store that is not read per unit.
        for i, s in enumerate(m["stores"]):
            if ("fast_check" in s) != (s.get("role") in FC.ROLES and bool(self.fast)):
                why = (
                    "not read per unit"
                    if "fast_check" in s
                    else "missing (other stores carry fast checks: all or none)"
                )
                raise AdmissionError(f"stores[{i}].fast_check", why)
        mode = "included" if self.mtp_path else "excluded"
        if m["policy"] != {"modalities": ["text"], "mtp": mode}:
            field = (
                "policy.mtp" if type(m["policy"]) is dict and m["policy"].get("modalities") == ["text"] else "policy"
            )
            raise AdmissionError(
                field,
                f"{m['policy']} is not the text-only policy with the MTP head {mode}"
                f" ({'an' if self.mtp_path else 'no'} MTP store)",
            )
        if self.mtp_path and m["exclusions"].get("mtp") != 0:
            raise AdmissionError(
                "exclusions.mtp", f"{m['exclusions'].get('mtp')!r}: the MTP head is included, nothing was excluded"
            )
        for rule, name in sorted(self.excluded_present.items()):
            raise AdmissionError(f"policy.{rule}", f"excluded tensor {name!r} present in a text-only artifact")
        rules = [r for r, _ in keys.EXCLUSION_RULES]
        ex = m["exclusions"]
        if sorted(ex) != sorted(rules) or not all(type(v) is int and v >= 0 for v in ex.values()):
            raise AdmissionError("exclusions", f"{ex} must count exactly the rules {rules}")
        if m["conversion"].get("state") != "complete":
            raise AdmissionError("conversion.state", f"{m['conversion'].get('state')!r} != 'complete'")
        consumed = m["conversion"].get("source_tensors_consumed")
        allowed = {len(keys.expected_hf_keys(self.args, layout)) for layout in ("unfused", "fused", "mlx")}
        if type(consumed) is not int or consumed not in allowed:
            raise AdmissionError(
                "conversion.source_tensors_consumed", f"{consumed!r} not in the key-table counts {sorted(allowed)}"
            )

    # 11 -----------------------------------------------------------------
    def ownership(self):
        for path, spans in sorted(self.owners.items()):
            size = os.path.getsize(self.file(path))
            at, prev = 0, "start of file"
            for start, end, owner in sorted(spans):
                if start < at:
                    raise AdmissionError(f"ownership.{path}", f"{owner} [{start}, {end}) overlaps {prev}")
                if start > at and path in (self.dense_path, self.mtp_path):
                    raise AdmissionError(f"ownership.{path}", f"bytes [{at}, {start}) owned by nobody")
                at, prev = end, owner
            if at > size or (path in (self.dense_path, self.mtp_path) and at != size):
                raise AdmissionError(f"ownership.{path}", f"owners end at {at}, file is {size} bytes")

    def manifest(self):
        m = self.m
        return M.Manifest(
            directory=self.dir,
            family=self.fam,
            profile=m["profile"],
            support=m["support"],
            codecs=dict(m["codecs"]),
            stores=tuple(M.store_from_dict(s) for s in m["stores"]),
            tensors=m["tensors"],
            constants=self.consts,
            config=self.config,
            sources=dict(self.sources),
            args=self.args,
            report=self.report(),
            dense_digests={k: r["sha256"] for k, r in m["tensors"].items()} if self.dense_digests else None,
            fast_digests=dict(self.fast) or None,
            norm_weights=m.get("norm_weights", C.NORM_WEIGHTS_DEFAULT_V1),
        )

    def report(self):
        m = self.m
        return Report(
            admitted=True,
            family=self.fam.name,
            profile=m["profile"],
            support=m["support"],
            stores=[{k: s[k] for k in ("role", "path", "size") if k in s} for s in m["stores"]],
            dense_tensors=len(self.dense),
            expert_records=self.expert_records,
            exclusions=m["exclusions"],
            owners={p: [[a, b, o] for a, b, o in sorted(v)] for p, v in sorted(self.owners.items())},
        )


def _json(data, field):
    # Strict: no duplicate keys, bounded nesting (untrusted.loads).
    return U.loads(data, field)


def _is_sha256(x):
    return type(x) is str and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _classify(name, args):
    # Dense stored names may carry .scales/.biases; classify the weight key.
    key = name
    for part in (".scales", ".biases"):
        if name.endswith(part):
            key = name[: -len(part)] + ".weight"
    try:
        return keys.classify(key, args).kind
    except keys.CheckpointKeyError:
        return "unknown"


def admit(path) -> M.Manifest:
    """Run every stage in order; returns the admitted, typed manifest
    (`.report` is the JSON ownership report) or raises the first
    ArtifactError (its `stage` attribute names the boundary)."""
    a = _Admission(path)
    for stage in STAGES:
        try:
            getattr(a, stage)()
        except ArtifactError as e:
            e.stage = stage
            raise
        except OSError as e:
            # The environment, not the bytes (permissions, EIO): still this stage's failure.
            err = AdmissionError(stage, f"{type(e).__name__}: {e}")
            err.stage = stage
            raise err from e
    return a.manifest()


def admit_mirror(m: M.Manifest, directory) -> str:
    """`--expert-mirror DIR`: DIR holds a byte-identical copy of the admitted manifest ``m``'s
    expert store (e.g. on a second disk) under the same file name. Checked like the store itself
    (header and record table, no payload read) and against it: same size as the manifest records,
    same header, so the same payload and per-record SHA-256 digests. The engine verifies every
    record it reads from the mirror against those digests (a bad record is re-read from the
    store). Returns the mirror file's path; AdmissionError names ``expert-mirror`` otherwise."""
    field = "expert-mirror"
    d = os.path.abspath(str(directory))
    if not os.path.isdir(d):
        raise AdmissionError(field, f"{d} is not a directory")
    store = m.experts
    path = os.path.join(d, store.path)
    if not os.path.isfile(path):
        raise AdmissionError(field, f"{path} missing (copy {m.file(store)} there)")
    if os.path.exists(m.file(store)) and os.path.samefile(path, m.file(store)):
        raise AdmissionError(field, f"{path} is the expert store itself, not a copy")
    size = os.path.getsize(path)
    if size != store.size:
        raise AdmissionError(f"{field}.size", f"{path} is {size} bytes, the store is {store.size}")
    try:
        with (
            ExpertMajorReader(path, m.family, store.expert_codec) as mirror,
            ExpertMajorReader(m.file(store), m.family, store.expert_codec) as primary,
        ):
            for k in ("payload_sha256", "table_sha256", "header_sha256"):
                if mirror.header[k] != primary.header[k]:
                    raise AdmissionError(f"{field}.{k}", f"{path} differs from {m.file(store)}")
    except ArtifactError as e:
        if e.field.startswith(field):
            raise
        raise AdmissionError(f"{field}.{e.field}", f"{path}: {e.message}") from None
    return path
