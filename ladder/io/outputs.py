"""Where a command may write: the one rule every command that writes checks before any work, each
refusal one line. An output is never an input, inside one or above one (symlinks followed); never
`/`, a home folder or a folder holding one; writable; of the kind the command writes. One already
there is `replace`d only with `--force` and this command's output marker (a folder), or `add`ed to
unless another command's marker claims it. A folder is deleted only through `remove_output`.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from ladder.errors import UsageError
from ladder.io.files import OUTPUT_MARKER, check_force_target, output_command

Kind = Literal["folder", "file"]
Existing = Literal["replace", "add"]


def check_output(
    out: str | Path,
    command: str,
    inputs: Iterable[str | Path | None] = (),
    *,
    kind: Kind = "folder",
    existing: Existing = "replace",
    force: bool = False,
    what: str = "--out",
) -> Path:
    """`out` as an absolute path, once it passes the rule; `inputs`: what the command reads (None
    skipped); `what` names the option in the message."""
    path = Path(out).expanduser().absolute()
    _refuse_too_long(path, what)
    resolved = path.resolve()
    _refuse_system_folder(resolved, what)
    _refuse_overlap(resolved, inputs, what)
    _refuse_wrong_kind(path, kind, what)
    if os.path.lexists(path):
        if existing == "replace":
            check_force_target(path, command if kind == "folder" else None, force)
        elif (owner := output_command(path)) not in (None, command):
            raise UsageError(
                f"{what} {path} is an output of `ladder {owner}` (its {OUTPUT_MARKER} says so): choose another folder"
            )
    _refuse_unwritable(path, what)
    return path


def check_removable(folder: str | Path, command: str) -> None:
    folder = Path(folder).absolute()
    if os.path.lexists(folder) and (folder.is_symlink() or output_command(folder) != command):
        raise UsageError(
            f"{folder} is not an output of `ladder {command}` (no {OUTPUT_MARKER} naming it), so it is not "
            "deleted: delete it yourself or choose another folder"
        )


def remove_output(folder: str | Path, command: str) -> None:
    check_removable(folder, command)
    if os.path.lexists(folder):
        shutil.rmtree(folder)


def make_output_folder(folder: str | Path, command: str) -> Path:
    """`folder`, created with `command`'s output marker unless it is there (`remove_output` may delete it)."""
    folder = Path(folder).absolute()
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        return folder
    (folder / OUTPUT_MARKER).write_text(json.dumps({"command": command}) + "\n")
    return folder


def _refuse_too_long(path: Path, what: str) -> None:
    place = _nearest_existing(path.parent)
    name_max, path_max = os.pathconf(place, "PC_NAME_MAX"), os.pathconf(place, "PC_PATH_MAX")
    shown = f"{str(path)[:60]}...{str(path)[-20:]}" if len(str(path)) > 80 else str(path)
    if len(os.fsencode(path)) >= path_max:
        raise UsageError(
            f"{what} {shown} is too long for the file system ({len(os.fsencode(path))} bytes, at most {path_max - 1})"
        )
    if long := [part for part in path.parts if len(os.fsencode(part)) > name_max]:
        raise UsageError(
            f"{what} {shown} is too long for the file system (a name of {len(os.fsencode(long[0]))} bytes, at most {name_max})"
        )


def _refuse_system_folder(resolved: Path, what: str) -> None:
    if resolved == Path(resolved.anchor):
        raise UsageError(f"{what} {resolved} is the root folder: choose a folder of its own")
    homes = {Path.home(), *(Path(entry.pw_dir) for entry in pwd.getpwall() if entry.pw_dir)}
    for home in {home.resolve() for home in homes}:
        if home.is_relative_to(resolved):
            holds = "is" if home == resolved else "holds"
            raise UsageError(f"{what} {resolved} {holds} the home folder {home}: choose a folder of its own")


def _refuse_overlap(resolved: Path, inputs: Iterable[str | Path | None], what: str) -> None:
    for source in (Path(given).expanduser().resolve() for given in inputs if given is not None):
        if resolved == source:
            relation = "it is that input"
        elif resolved.is_relative_to(source):
            relation = "it lies inside it"
        elif source.is_relative_to(resolved):
            relation = "it holds it"
        else:
            continue
        raise UsageError(f"{what} {resolved} overlaps the input {source} ({relation}): choose a place outside it")


def _nearest_existing(path: Path) -> Path:
    return next(p for p in (path, *path.parents) if os.path.lexists(p))


def _refuse_wrong_kind(path: Path, kind: Kind, what: str) -> None:
    if os.path.lexists(path):
        if kind == "folder" and not path.is_dir():
            raise UsageError(f"{what} {path} is a file, not a folder")
        if kind == "file" and path.is_dir():
            raise UsageError(f"{what} {path} is a folder: name the file to write")
    above = _nearest_existing(path.parent)
    if not above.is_dir():
        raise UsageError(f"{what} {path}: {above} is a file, not a folder")


def _refuse_unwritable(path: Path, what: str) -> None:
    places = [_nearest_existing(path.parent)]
    if path.is_dir():
        places.append(path)
    for place in places:
        if os.statvfs(place).f_flag & os.ST_RDONLY:
            raise UsageError(f"{what} {path}: {place} is on a read-only file system")
        if not os.access(place, os.W_OK | os.X_OK):
            raise UsageError(f"{what} {path}: {place} is not writable by this user")
