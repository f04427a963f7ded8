"""`ladder data [--dest DIR] [--manifest FILE]`: fill the data folder from the files' public sources,
each file's SHA-256 checked (`make data`)."""

from __future__ import annotations

from pathlib import Path

from ladder.errors import ArgumentParser, UsageError
from ladder.io.data_fetch import MANIFEST, fetch_data
from ladder.io.files import ladder_data_dir
from ladder.log import log


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="ladder data",
        description="Fetch the data folder (evaluation sets, training books) from the files' public sources "
        "and verify each file's SHA-256; files already present and correct are kept.",
    )
    parser.add_argument(
        "--dest",
        type=Path,
        default=None,
        help="the data folder to fill (default: $LADDER_DATA, else ../shared/data beside the repository)",
    )
    parser.add_argument("--manifest", type=Path, default=MANIFEST, help="the list of files (default: %(default)s)")
    args = parser.parse_args(argv)
    destination = args.dest if args.dest is not None else ladder_data_dir()
    report = fetch_data(destination, manifest=args.manifest, progress=True)
    log.info(report.summary(Path(destination).absolute()))
    if report.refused:
        raise UsageError(
            f"{len(report.refused)} file(s) failed their SHA-256 check and were not kept; "
            "the source may have changed: see the data folder's README for where each file comes from"
        )
    return 0
