"""The `snapshard` command: look at, check, compare and convert checkpoints.

    snapshard ls DIR                 checkpoints (steps) under a directory
    snapshard info PATH              leaves: shape, dtype, bytes, saved sharding, chunks
    snapshard verify PATH            read every chunk and check every checksum
    snapshard diff A B [--values]    leaves added, removed, changed
    snapshard convert SRC DST        snapshard / Orbax / safetensors to snapshard or safetensors
    snapshard clean DIR [--yes]      remove what killed saves left (a dry run unless --yes)

Exit codes: 0 success; 1 verify found damage, diff found differences or clean could not
remove everything; 2 bad input (a one-line error, no traceback); 3 an unexpected internal
error.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from ..errors import SnapshardError
from ..gc_pause import collection_paused
from . import clean, convert, diff, info, ls, verify
from .output import Output

EXIT_OK, EXIT_FOUND, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
COMMANDS = (ls, info, verify, diff, convert, clean)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    common.add_argument("--traceback", action="store_true", help="show the traceback of an error")
    parser = argparse.ArgumentParser(
        prog="snapshard",
        description="Look at, check, compare, convert and clean up checkpoints.",
        epilog="exit codes: 0 ok, 1 damage or differences found (clean: not all removed), "
        "2 bad input, 3 internal error",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # usage errors (argparse prints them) and --help
        return int(e.code) if isinstance(e.code, int) else EXIT_BAD_INPUT
    out = Output(json_mode=args.json, progress=not args.quiet)
    try:
        # A command's objects are a checkpoint's metadata, alive until it ends: the cyclic
        # collector would only traverse them again and again (half a 100,000-leaf `info`).
        with collection_paused():
            return int(args.run(args, out))
    except KeyboardInterrupt:
        out.error("interrupted")
        return 130
    except BrokenPipeError:  # `snapshard ls DIR | head`: the reader left, nothing to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except (SnapshardError, OSError, ValueError, ImportError) as e:
        # TensorStore and the storage layer report bad paths as OSError / ValueError.
        if args.traceback:
            traceback.print_exc()
        out.error(str(e) or type(e).__name__)
        return EXIT_BAD_INPUT
    except Exception as e:
        if args.traceback:
            traceback.print_exc()
        out.error(f"internal error: {type(e).__name__}: {e} (rerun with --traceback for details)")
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
