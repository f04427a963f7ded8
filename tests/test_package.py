"""The installed package: one namespace (no top-level `convert`, `adapt`, `eval`), light commands."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from ladder.files import ladder_data_dir

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_installs_everything_under_ladder(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(REPO)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("ladder_llama-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == {"ladder"}
    for module in ("ladder/convert/convert.py", "ladder/adapt/train.py", "ladder/eval/harness.py",
                   "ladder/eval/tasks/ladder_wikitext.yaml", "ladder/eval/suites/smoke.yaml", "ladder/demo.py"):
        assert module in names


def _imports_after(code: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                          check=True, capture_output=True, text=True, cwd=REPO)
    return set(done.stdout.split())


def test_ladder_help_and_the_light_modules_do_not_import_torch():
    assert "torch" not in _imports_after("from ladder.cli import main; main(['--help'])")
    assert "torch" not in _imports_after("import ladder, ladder.errors, ladder.layers, ladder.files")
    assert "transformers" not in _imports_after("import ladder.layers")
    # Touching a model class loads the model and registers it with the Auto classes.
    assert "ladder.auto" in _imports_after("import ladder; ladder.LadderLlamaForCausalLM")


def test_data_folder_needs_ladder_data_outside_a_checkout(monkeypatch, tmp_path):
    monkeypatch.setenv("LADDER_DATA", str(tmp_path))
    assert ladder_data_dir() == tmp_path
    monkeypatch.delenv("LADDER_DATA")
    # In a checkout with ../shared/data beside it (as CI has it), that folder; else a clear error.
    beside = REPO.parent / "shared" / "data"
    if beside.is_dir():
        assert ladder_data_dir() == beside
    # The package as pip installs it: no setup.cfg above it, no ../shared beside it.
    site = tmp_path / "site-packages"
    shutil.copytree(REPO / "ladder", site / "ladder", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("from ladder.files import ladder_data_dir\n"
            "try:\n    ladder_data_dir()\nexcept Exception as error:\n    print(type(error).__name__, error)")
    done = subprocess.run([sys.executable, "-S", "-c", code], check=True, capture_output=True, text=True,
                          env={"PYTHONPATH": str(site)}, cwd=tmp_path)
    assert done.stdout.startswith("UsageError no data folder: set LADDER_DATA")
