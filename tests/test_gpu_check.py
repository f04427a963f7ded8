"""benchmarks/gpu_check.py, the prepared GPU check, on a machine without a GPU: its one line and
exit 0, its list of checks, and each check's CPU variant (the same code, with no side stream, over
gloo instead of NCCL, timed with perf_counter instead of CUDA events)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

REPO = Path(__file__).resolve().parents[1]


def gpu_check_command(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *arguments], cwd=REPO, capture_output=True, text=True
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make gpu-check runs the checks")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    completed = gpu_check_command("--out", str(tmp_path / "report.json"))
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == [
        f"gpu_check: no CUDA GPU here (torch {torch.__version__}): nothing checked; see docs/gpu.md"
    ]
    assert not (tmp_path / "report.json").exists()


def test_list_names_every_check_with_what_it_verifies():
    completed = gpu_check_command("--list")
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert [line.split(":")[0].removesuffix(" (GPU only)") for line in lines] == list(gpu_check.CHECKS)
    assert all(len(line.split(": ", 1)[1]) > 60 for line in lines)  # a claim, not a name
    documented = (REPO / "docs" / "gpu.md").read_text()
    assert all(f"`{name}`" in documented for name in gpu_check.CHECKS)


def test_the_checks_time_limits_add_up_to_eight_minutes_at_most():
    assert sum(check.timeout for check in gpu_check.CHECKS.values()) <= 8 * 60


@pytest.mark.parametrize("name", [name for name, check in gpu_check.CHECKS.items() if check.on_cpu])
def test_cpu_variant_passes(name):
    result = gpu_check.run_one(name, "cpu")
    assert result["passed"], json.dumps({key: value for key, value in result.items() if key != "claim"}, indent=1)


def test_side_stream_check_runs_the_serving_models_op_bodies():
    """The bodies come from ladder/serving/model.py's source (it imports vLLM, which the GPU machine
    lacks): every op it registers, each the function it names there."""
    ops, fake = gpu_check.ladder_op_bodies(lambda: None)
    source = gpu_check.SERVING_MODEL.read_text()
    assert {"all_reduce", "all_reduce_start", "all_reduce_wait"} <= set(ops)
    assert all(f"def {body.__name__}(" in source for body in [*ops.values(), fake])


def test_cpu_report_is_one_json_file(tmp_path):
    out = tmp_path / "report.json"
    completed = gpu_check_command("--cpu", "--only", "vllm_speed_timing", "--out", str(out))
    assert completed.returncode == 0, completed.stderr
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and list(report["checks"]) == ["vllm_speed_timing"]
    assert report["checks"]["vllm_speed_timing"]["passed"]
