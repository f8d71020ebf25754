"""`hebrus-mlx VERB ...`: one verb per module, each with its own main()."""

import importlib
import sys

VERBS = {
    "generate": "hebrus_mlx.generate",
    "convert": "hebrus_mlx.convert",
    "admit": "hebrus_mlx.admission",
    "verify": "hebrus_mlx.verify",
    "qualify": "hebrus_mlx.qualify",
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hebrus-mlx {" + ",".join(VERBS) + "} [args...]")
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"hebrus-mlx: unknown command {verb!r}; choose from {', '.join(VERBS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[verb])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
