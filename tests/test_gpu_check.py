"""benchmarks/gpu_check.py (`make gpu-check`), the one prepared call for a lent GPU machine, on this
machine: its one line without a GPU, its time limits, its version check and where its report goes.
The checks it runs are the suite's GPU tests (`-m gpu`); make gpu-image-env runs its whole course."""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def gpu_check(*arguments: str, **environment: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *arguments],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, **environment),
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make gpu-check runs the checks")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    completed = gpu_check(OUT=str(tmp_path))
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == [
        f"gpu_check: no CUDA GPU here (torch {torch.__version__}): nothing checked; see docs/gpu.md"
    ]
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def listed_checks() -> tuple[list[str], str]:
    """The checks `--list` names, and the script's source (their time limits and test files)."""
    listed = gpu_check("--list")
    assert listed.returncode == 0, listed.stderr
    source = (REPO / "benchmarks" / "gpu_check.py").read_text()
    return [line.split(":")[0] for line in listed.stdout.splitlines()], source


def test_every_check_is_documented_and_the_gpu_limits_add_up_to_eight_minutes_at_most(listed_checks):
    names, source = listed_checks
    documented = (REPO / "docs" / "gpu.md").read_text()
    assert names and all(f"`{name}`" in documented for name in names)
    limits = [int(line.split("=")[1].rstrip(",")) for line in source.splitlines() if line.strip().startswith("limit=")]
    assert len(limits) == len(names) and sum(limits) <= 8 * 60


def test_every_test_file_with_gpu_tests_is_a_check(listed_checks):
    """A test marked gpu that no check runs would never run on the lent machine."""
    _, source = listed_checks
    tests = sorted((REPO / "tests").glob("test_*.py"))
    marked = [path for path in tests if re.search(r"mark\.gpu|\bDEVICES\b", path.read_text())]
    assert marked and all(f'"tests/{path.name}"' in source for path in marked)


def test_a_version_below_the_ranges_is_named_in_one_line_before_any_work(tmp_path):
    """A carried wheel counts as installed: transformers 5.17 (the lent image's) is below setup.cfg's range."""
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "transformers-5.17.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("transformers-5.17.0.dist-info/METADATA", "Name: transformers\nVersion: 5.17.0\n")
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    (needed,) = [line for line in config["options"]["install_requires"].splitlines() if "transformers" in line]
    completed = gpu_check("--cpu", "--wheels", str(wheels), OUT=str(out))
    assert completed.returncode == 1 and not out.exists()
    assert completed.stdout.splitlines() == [
        f"gpu_check: cannot run: transformers 5.17.0 (needs {Requirement(needed).specifier}) "
        "(make gpu-wheels fills .gpu-wheels: carry it)"
    ]


@pytest.mark.slow
def test_cpu_course_writes_its_report_outside_the_checkout(tmp_path):
    """The course's installation (pip, into a temporary folder) and one check, in about 30 s."""
    (tmp_path / "wheels").mkdir()  # none: .venv has every range (.gpu-wheels holds the GPU machine's Python's)
    completed = gpu_check(
        "--cpu", "--only", "vllm_speed_timing", "--wheels", str(tmp_path / "wheels"), OUT=str(tmp_path)
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = tmp_path / "gpu-check.json"
    assert completed.stdout.splitlines()[-1].endswith(f"report: {report}")
    checked = json.loads(report.read_text())["checks"]
    assert list(checked) == ["vllm_speed_timing"] and checked["vllm_speed_timing"]["passed"]


def test_out_inside_the_checkout_is_refused_in_one_line():
    completed = gpu_check("--cpu", "--only", "vllm_speed_timing", OUT=str(REPO / "runs"))
    assert completed.returncode != 0
    assert completed.stderr.strip().splitlines() == [
        f"gpu_check: OUT={REPO / 'runs'} is inside the checkout; give a folder outside it"
    ]
