"""`ladder data` (`make data`): fill a data folder from the files' public sources (each a file of a
public GitHub repository at a fixed commit, listed in `data_manifest.tsv` with its SHA-256), through
pooch, which renames a download into place only once its checksum is verified.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pooch
import requests  # pooch's HTTP client: its errors are what a failed download raises

from ladder.errors import UsageError, excerpt, first_line
from ladder.io.files import path_inside, sha256_file
from ladder.io.outputs import check_output
from ladder.log import log

MANIFEST = Path(__file__).with_name("data_manifest.tsv")
TIMEOUT_SECONDS = 60


@dataclass(frozen=True)
class DataFile:
    path: str  # relative to the data folder
    size: int
    sha256: str
    url: str


def read_manifest(manifest: str | Path = MANIFEST) -> list[DataFile]:
    try:
        with open(manifest, newline="") as handle:
            rows = csv.DictReader((line for line in handle if not line.startswith("#")), delimiter="\t")
            return [DataFile(row["path"], int(row["size"]), row["sha256"], row["url"]) for row in rows]
    except (OSError, KeyError, TypeError, ValueError) as error:
        raise UsageError(
            f"cannot read the manifest {manifest}: {first_line(error)} "
            "(expected tab-separated columns path, size, sha256, url)"
        ) from None


@dataclass
class FetchReport:
    fetched: list[str]  # downloaded (or replaced) and verified
    present: list[str]  # already there with the right checksum
    refused: list[str]  # downloaded but failed the checksum: deleted

    def summary(self, destination: Path) -> str:
        parts = [f"{len(self.fetched)} fetched", f"{len(self.present)} already present"]
        if self.refused:
            parts.append(f"{len(self.refused)} refused (wrong checksum, not kept): {', '.join(self.refused)}")
        return f"data folder {destination}: " + ", ".join(parts)


def fetch_data(
    destination: str | Path,
    files: list[DataFile] | None = None,
    manifest: str | Path = MANIFEST,
    progress: bool = False,
) -> FetchReport:
    """Fetch every file of `files` (default: the manifest's) missing or wrong in `destination`. A
    download that fails its checksum is deleted and reported in `refused`; the first network failure
    is one UsageError line saying what to fetch and where."""
    destination = check_output(destination, "data", [manifest], existing="add", what="--dest")
    files = read_manifest(manifest) if files is None else files
    downloader = pooch.HTTPDownloader(timeout=TIMEOUT_SECONDS, progressbar=False)
    pooch.get_logger().setLevel(logging.WARNING)  # pooch logs every file; the caller prints a summary
    report = FetchReport([], [], [])
    # Every place is checked before anything is deleted or downloaded: a manifest is untrusted input.
    targets = [path_inside(destination, item.path, f"manifest {manifest}") for item in files]
    for item in files:  # only HTTP(S): a `file://` URL would copy any file of this machine into the data folder
        if urlsplit(item.url).scheme not in ("https", "http"):
            raise UsageError(
                f"manifest {manifest}: {item.path} has the URL {excerpt(item.url)}; only https:// and http:// are fetched"
            )
    for item, target in zip(files, targets, strict=True):
        try:
            if target.is_file() and sha256_file(target) == item.sha256:
                report.present.append(item.path)
                continue
            pooch.retrieve(
                item.url,
                known_hash=f"sha256:{item.sha256}",
                fname=target.name,
                path=target.parent,
                downloader=downloader,
            )
        except ValueError as error:
            if "hash" not in str(error).lower():
                raise
            report.refused.append(item.path)  # pooch deleted the download before raising
            continue
        except requests.exceptions.HTTPError as error:
            raise UsageError(
                f"cannot fetch {item.path}: {item.url} answered {first_line(error)}; the source may "
                "have moved (the data folder's README names each file's repository)"
            ) from None
        except requests.exceptions.RequestException as error:
            hosts = ", ".join(sorted({urlsplit(file.url).netloc for file in files}))
            raise UsageError(
                f"cannot download from {hosts} ({type(error).__name__}): fetch the {len(files)} files listed "
                f"in {manifest} (URL and SHA-256 each) into {destination}, each at its `path`, or set LADDER_DATA "
                "to a folder that has them"
            ) from None
        except OSError as error:
            raise UsageError(f"cannot write {target}: {first_line(error)}") from None
        report.fetched.append(item.path)
        if progress:
            log.info(f"  fetched {item.path}")
    return report
