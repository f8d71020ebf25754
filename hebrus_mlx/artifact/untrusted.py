"""Bounded, symlink-safe reading of untrusted files: the one place every cap lives (issue 22).

Every file read from an artifact or a checkpoint directory (manifest, config, tokenizer files,
chat templates, safetensors headers) comes through here:

- the name is a plain file name; the path must resolve to a regular file inside the directory
  (an artifact may hold no symlink at all; a checkpoint's symlinks must stay inside it, or inside
  the Hugging Face cache's `blobs/` of the same repo), checked before the file is opened;
- its size is checked against the cap of its kind (`LIMITS`) before a byte is read, and at most
  cap + 1 bytes are ever read (a file growing under us is still bounded);
- JSON is parsed with duplicate keys refused (naming the key), nesting bounded (`JSON_MAX_DEPTH`)
  and lone surrogates refused, so no caller meets a RecursionError or an unencodable string.

Each refusal is an `UntrustedFileError` naming the file (or JSON path) and the cap by its name.
Format layer: no MLX, no numpy.
"""

import json
import os
import stat

from .errors import AdmissionError

MiB = 1 << 20

# Bytes a file of each kind may have. Real Qwen-family files are far below: tokenizer.json ~11 MB,
# tokenizer_config.json (with its template) < 0.1 MB, config.json < 10 KB, manifest.json of a real
# artifact ~2 MB, a safetensors header of a 5 GB shard < 1 MB.
LIMITS = {
    "manifest": 16 * MiB,
    "config": 4 * MiB,
    "generation_config": 1 * MiB,
    "tokenizer": 64 * MiB,
    "tokenizer_config": 16 * MiB,
    "template": 1 * MiB,
    "index": 64 * MiB,  # model.safetensors.index.json
    "safetensors_header": 32 * MiB,
    "json": 16 * MiB,  # any other small JSON file of a directory
    "api_key": 4096,  # server --api-key-file: one line
    "prompt_cache_index": 64 * MiB,  # --prompt-cache-dir's KEY.json: the token IDs of one entry
}
SAFETENSORS_MAX_ENTRIES = 1 << 18  # tensors in one safetensors header
JSON_MAX_DEPTH = 64  # nesting of objects and arrays; real files use < 10

# The kind of each file name we read.
KINDS = {
    "manifest.json": "manifest",
    "config.json": "config",
    "generation_config.json": "generation_config",
    "tokenizer.json": "tokenizer",
    "tokenizer_config.json": "tokenizer_config",
    "chat_template.jinja": "template",
    "chat_template.json": "template",  # HF's processor form {"chat_template": ...}: the template's cap
    "model.safetensors.index.json": "index",
}


class UntrustedFileError(AdmissionError):
    """An untrusted file (or JSON document) refused before or while it is read."""


def check_template(text, field):
    """A chat template from any source (chat_template.jinja, chat_template.json, the string inside
    tokenizer_config.json, an override) is held to the template cap, not its container's."""
    cap = _cap("template")
    n = len(text.encode("utf-8", "surrogatepass"))
    if n > cap:
        raise UntrustedFileError(
            field,
            f"chat template of {n} bytes exceeds the template cap of {_describe(cap)} (untrusted.LIMITS['template'])",
        )
    return text


def kind_of(name):
    return KINDS.get(name, "json" if name.endswith(".json") else None)


def _cap(kind):
    if kind not in LIMITS:
        raise KeyError(f"no size cap for file kind {kind!r}")
    return LIMITS[kind]


def _describe(n):
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n} bytes"


def _inside(path, root):
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def allowed_roots(directory):
    """Where a checkpoint directory's files may resolve: the directory itself, and for a Hugging
    Face cache snapshot (`models--ORG--NAME/snapshots/REV`) the repo's `blobs/` it links into."""
    real = os.path.realpath(directory)
    roots = [real]
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots" and os.path.basename(os.path.dirname(parent)).startswith(
        ("models--", "datasets--")
    ):
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def check_name(name, field):
    if type(name) is not str or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise UntrustedFileError(field, f"{name!r} is not a plain file name")


def resolve(directory, name, field=None, links=False):
    """The path to open for `name` in `directory`, after checking it names a regular file that
    resolves inside the directory. links=False (artifacts): a symlink is refused outright;
    links=True (checkpoints): a symlink must resolve inside `allowed_roots(directory)`.
    FileNotFoundError propagates (callers decide whether the file is optional)."""
    field = field or name
    check_name(name, field)
    path = os.path.join(directory, name)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        if not links:
            raise UntrustedFileError(field, f"{path} is a symlink; an artifact holds regular files only")
        real = os.path.realpath(path)
        if not any(_inside(real, r) for r in allowed_roots(directory)):
            raise UntrustedFileError(field, f"{path} is a symlink to {real}, outside {os.path.realpath(directory)}")
        path = real
        st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedFileError(field, f"{path} is not a regular file")
    return path


def _opener(path, flags):
    # O_NOFOLLOW: the last component is not swapped for a symlink after resolve(); O_NONBLOCK: a
    # FIFO planted there does not block open (fstat refuses it next).
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))


def open_regular(path, field):
    """Open `path` (already `resolve`d) for reading, refusing anything but a regular file."""
    f = open(path, "rb", buffering=0, opener=_opener)
    try:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFileError(field, f"{path} is not a regular file")
        os.set_blocking(f.fileno(), True)
    except BaseException:
        f.close()
        raise
    return f, st.st_size


def read_exact(f, n):
    """Up to `n` bytes of raw file `f`, looping over short reads; fewer only at end of file."""
    chunks, got = [], 0
    while got < n:
        b = f.read(min(8 * MiB, n - got))
        if not b:
            break
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def read_path(path, kind, field=None):
    """The bytes of the regular file `path`, at most the cap of `kind` (checked before reading)."""
    field = field or os.path.basename(path)
    cap = _cap(kind)
    f, size = open_regular(path, field)
    with f:
        if size > cap:
            raise UntrustedFileError(
                field, f"{size} bytes exceeds the {kind} cap of {_describe(cap)} (untrusted.LIMITS[{kind!r}])"
            )
        data = read_exact(f, cap + 1)
    if len(data) > cap:
        raise UntrustedFileError(field, f"grew past the {kind} cap of {_describe(cap)} while being read")
    return data


def read_bytes(directory, name, kind=None, field=None, links=False):
    """`resolve` then `read_path`: the bounded bytes of one file of a directory."""
    kind = kind or kind_of(name)
    return read_path(resolve(directory, name, field, links), kind, field or name)


def read_json(directory, name, kind=None, field=None, links=False):
    field = field or name
    return loads(read_bytes(directory, name, kind, field, links), field)


def read_json_path(path, kind=None, field=None):
    """A JSON file given by path (e.g. one the Hub client resolved): regular, bounded, strict."""
    name = os.path.basename(path)
    field = field or name
    return loads(read_path(os.path.realpath(path), kind or kind_of(name) or "json", field), field)


# -- JSON --------------------------------------------------------------------------------------


class _Duplicate(Exception):
    def __init__(self, key):
        self.key = key


def _pairs(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _join(path, key):
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def check_tree(obj, field, max_depth=JSON_MAX_DEPTH, root=None):
    """Walk a parsed JSON value without recursion: nesting at most `max_depth`, every string (and
    key) encodable as UTF-8 (no lone surrogates). Errors name the JSON path under `root` (default
    `field`, e.g. ``tokenizer.json.model.vocab``; "" for a request body: ``messages[0].content``)."""
    stack = [(obj, field if root is None else root, 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            _check_str(v, path, field)
        elif isinstance(v, (dict, list)):
            if depth >= max_depth:
                raise UntrustedFileError(
                    field, f"JSON nested deeper than {max_depth} levels (untrusted.JSON_MAX_DEPTH)"
                )
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    _check_str(k, path, field)
                stack.append((x, _join(path, k), depth + 1))
    return obj


def _check_str(s, path, field):
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise UntrustedFileError(
                path or field, "a string holds a lone UTF-16 surrogate (not valid Unicode)"
            ) from None


def loads(data, field, max_depth=JSON_MAX_DEPTH, root=None):
    """Strict JSON of untrusted bytes or text: UTF-8, no duplicate keys, bounded nesting, no lone
    surrogates. UntrustedFileError names `field` (or the JSON path under `root`)."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
        obj = json.loads(text, object_pairs_hook=_pairs)
    except _Duplicate as e:
        raise UntrustedFileError(field, f"duplicate JSON key {e.key!r}") from None
    except RecursionError:
        # The C decoder guards its own recursion; anything that deep is far past the cap anyway.
        raise UntrustedFileError(
            field, f"JSON nested deeper than {max_depth} levels (untrusted.JSON_MAX_DEPTH)"
        ) from None
    except (UnicodeDecodeError, ValueError) as e:
        raise UntrustedFileError(field, f"not JSON: {e}") from None
    return check_tree(obj, field, max_depth, root)
