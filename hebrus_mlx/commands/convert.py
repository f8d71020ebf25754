"""`hebrus-mlx convert` (like mlx_lm.convert): the verb's command line over hebrus_mlx/convert/build.py
(a whole checkpoint at once) and hebrus_mlx/convert/hub_shards.py (`--stream-shards`: a Hub repo shard
by shard)."""

import json
import os
import sys

from .. import flags
from ..artifact import constants as C
from ..convert import convert, hub_shards
from ..errors import UsageError
from ..loading import hub
from .cli_args import ArgumentParser, add_overwrite_argument


def build_parser():
    p = ArgumentParser(prog="hebrus-mlx convert", description="Convert a Qwen4Exp HF checkpoint")
    p.add_argument("--hf-path", "--model", required=True, help="local directory or Hugging Face repo id")
    p.add_argument("--out", "--mlx-path", required=True, help="artifact directory to publish")
    p.add_argument(
        "-q",
        "--quantize",
        action="store_true",
        help="mlx_lm.convert's flag: quantizing is the default here (--dtype stores unquantized)",
    )
    p.add_argument("--q-bits", type=flags.integer(1, 16), help="default 4 (an MLX-quantized source keeps its own)")
    p.add_argument(
        "--q-group-size", type=flags.integer(1, 1 << 16), help="default 64 (an MLX-quantized source keeps its own)"
    )
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="store the dense weights unquantized instead")
    p.add_argument(
        "--expert-bits",
        type=flags.integer(1, 16),
        help=f"routed experts' affine width, one of {list(C.AFFINE_BITS)} (default: the dense width)",
    )
    p.add_argument(
        "--expert-group-size",
        type=flags.integer(1, 1 << 16),
        help=f"routed experts' group size, one of {list(C.AFFINE_GROUPS)} (default: the dense one)",
    )
    p.add_argument(
        "--ple-dtype",
        choices=tuple(C.PLE_DTYPES),
        help="the PLE table's rows: bfloat16, float32, or affine 8-/4-bit rows q8/q4 (group 32, bf16 scales and "
        "biases; default bfloat16, float32 under --dtype float32)",
    )
    p.add_argument("--revision", help="source revision (recorded; used for repo downloads)")
    p.add_argument(
        "--stream-shards",
        action="store_true",
        help="with a Hub repo id: fetch, convert and delete one shard at a time (the next fetched ahead), so the "
        "disk holds the artifact plus about two shards instead of the whole download too; an interrupted run "
        "resumes. Off by default: the whole-snapshot path keeps the download in the HF cache for reuse",
    )
    p.add_argument("--no-mtp", action="store_true", help="leave out the checkpoint's MTP head (mtp.*)")
    add_overwrite_argument(p, help="replace --out when it is an earlier hebrus-mlx artifact (never anything else)")
    return p


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    if a.quantize and a.dtype is not None:
        raise UsageError("--quantize", f"contradicts --dtype {a.dtype} (which stores the weights unquantized)")
    # The stored widths, the same for both paths (convert_streamed takes convert's names).
    widths = dict(q_bits=a.q_bits, q_group_size=a.q_group_size, dtype=a.dtype, expert_bits=a.expert_bits)
    widths.update(expert_group_size=a.expert_group_size, ple_dtype=a.ple_dtype)
    if a.stream_shards:
        if os.path.exists(a.hf_path) or not hub.is_repo_id(a.hf_path):
            raise UsageError("--stream-shards", f"takes a Hub repo id (ORG/NAME), not {a.hf_path!r}")
        run = hub_shards.convert_streamed
    else:
        run = convert
    report = run(a.hf_path, a.out, revision=a.revision, mtp=not a.no_mtp, overwrite=a.overwrite, **widths).report
    print(json.dumps({k: report[k] for k in ("family", "profile", "support", "stores", "exclusions")}, indent=1))
    return 0  # errors: cli.run


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("convert", main))
