"""`hebrus-mlx qualify [--report FILE]`: the verb's command line over hebrus_mlx/qualify.py (measure
what this machine can be trusted with and write the machine profile) and hebrus_mlx/qualify_report.py
(the self-contained report a user attaches to an issue)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from .. import flags
from ..errors import UsageError
from ..machine_profile import write_profile
from ..qualify import TOLERANCE, check_kernels_metal, qualify
from ..qualify import __doc__ as QUALIFY_DOC
from ..qualify_report import CACHE_FRACTIONS, build_report, parse_caches, summary_path, write_report
from .cli_args import ArgumentParser, add_overwrite_argument


def build_parser():
    p = ArgumentParser(prog="hebrus-mlx qualify", description=QUALIFY_DOC.splitlines()[0])
    p.add_argument(
        "--out", default=None, help="profile path (default $HEBRUS_PROFILE or ~/.cache/hebrus-mlx/profile.json)"
    )
    add_overwrite_argument(p, "--out/--report")
    p.add_argument("--probe-dir", default=None, help="directory on the SSD the model lives on (probe file)")
    p.add_argument("--store", default=None, help="read an existing file (e.g. an artifact's experts.hbem) instead")
    p.add_argument(
        "--record-kib", type=flags.integer(1, 1 << 20), default=2704, help="read size (default: one real expert record)"
    )
    p.add_argument("--probe-mib", type=flags.integer(1, 1 << 20), default=128)
    p.add_argument("--no-emulate", action="store_true")
    p.add_argument(
        "--artifact",
        default="demo",
        help="artifact whose expert store the MTLIO and GPU-event A/Bs stream and the prefill sweep's "
        "crossover is measured on (default: demo; the loader uses that crossover only for stores "
        "of the same record size on the same file system)",
    )
    p.add_argument(
        "--rounds", type=flags.integer(1, 1000), default=2, help="A/B/B/A rounds of each device A/B (default 2)"
    )
    p.add_argument(
        "--tokens", type=flags.integer(1, 1 << 20), default=32, help="greedy tokens per GPU-event A/B run (default 32)"
    )
    p.add_argument("--kernels-child", choices=sorted(TOLERANCE), default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--report",
        default=None,
        metavar="FILE",
        help="also write the qualify report (JSON, and a .md summary beside it) to attach to an issue",
    )
    p.add_argument(
        "--report-cache-gb",
        default=None,
        metavar="A,B",
        help="with --report: the two expert-cache sizes (GiB) of the streamed decodes "
        f"(default {' and '.join(f'{f:.0%}%' for f in CACHE_FRACTIONS)} of the expert store)",
    )
    return p


def check_report_arguments(a) -> None:
    """--report's typed refusals, before anything is measured."""
    if a.report is None:
        if a.report_cache_gb is not None:
            raise UsageError("--report-cache-gb", "needs --report")
        return
    if not a.report.strip() or Path(a.report).is_dir():
        raise UsageError("--report", f"{a.report!r} is a directory or empty: give a file name")
    if not Path(a.report).expanduser().resolve().parent.is_dir():
        raise UsageError("--report", f"the directory of {a.report!r} does not exist")
    if a.report_cache_gb is not None:
        parse_caches(a.report_cache_gb)
    from ..artifact.atomic import check_output_file

    for out in (Path(a.report).expanduser(), summary_path(Path(a.report).expanduser())):  # before the runs
        check_output_file(out, overwrite=a.overwrite, field="--report")
    _check_writable(Path(a.report).expanduser(), a.report)


def _check_writable(path: Path, given: str) -> None:
    """Create and remove a hidden file beside the report: a directory the report cannot be
    published into (read-only, /proc, no permission) is refused now, naming the user's path, not
    after minutes of measuring with the publisher's temp name."""
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.probe-", dir=path.resolve().parent)
    except OSError as e:
        raise UsageError("--report", f"cannot write {given}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)


def write_qualify_report(a, profile: dict) -> None:
    """--report: assemble from the profile just measured plus the report's own runs."""
    caches = parse_caches(a.report_cache_gb) if a.report_cache_gb else None
    extra = [a.probe_dir or "", a.store or "", str(Path(a.report).expanduser().resolve().parent)]
    report = build_report(
        profile, a.artifact, gen_tokens=max(a.tokens, 2), repeats=2 * a.rounds, cache_gb=caches, extra_secrets=extra
    )
    p, md = write_report(report, a.report, overwrite=a.overwrite)
    print(f"qualify report written to {p} (summary {md.name}): attach both to an issue", file=sys.stderr)


def main(argv=None):
    """`hebrus-mlx qualify`; typed errors propagate to `cli.run` (one line, exit 2)."""
    a = build_parser().parse_args(argv)
    if a.kernels_child:
        print(json.dumps(check_kernels_metal([a.kernels_child])))
        return 0
    for field in ("record_kib", "probe_mib", "rounds", "tokens"):
        if getattr(a, field) < 1:
            raise UsageError("--" + field.replace("_", "-"), f"must be >= 1, got {getattr(a, field)}")
    if a.probe_dir and not Path(a.probe_dir).is_dir():
        raise UsageError("--probe-dir", f"{a.probe_dir!r} is not a directory")
    if a.store and not Path(a.store).is_file():
        raise UsageError("--store", f"{a.store!r} is not a file")
    if not a.store and a.probe_mib * 1024 < a.record_kib:
        raise UsageError("--probe-mib", f"{a.probe_mib} MiB is smaller than one --record-kib {a.record_kib} read")
    if a.artifact != "demo" and not (Path(a.artifact) / "manifest.json").is_file():
        raise UsageError("--artifact", f"{a.artifact!r} is not an artifact directory (no manifest.json)")
    from ..artifact.atomic import check_output_file
    from ..machine_profile import profile_path

    check_output_file(a.out or profile_path(), overwrite=a.overwrite, field="--out")  # before the probes
    check_report_arguments(a)
    profile = qualify(
        a.probe_dir, a.record_kib * 1024, a.probe_mib, a.store, not a.no_emulate, a.artifact, a.rounds, a.tokens
    )
    path = write_profile(profile, a.out, overwrite=a.overwrite)
    print(json.dumps(profile, indent=1))
    print(f"profile written to {path}", file=sys.stderr)
    if a.report:
        write_qualify_report(a, profile)
    return 0


if __name__ == "__main__":
    from ..cli import run

    sys.exit(run("qualify", main))
