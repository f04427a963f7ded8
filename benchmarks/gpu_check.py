"""`make gpu-check`: everything one lent GPU can verify, in one prepared call of at most 8 minutes
(docs/gpu.md). The checks are the suite's GPU tests (`pytest -m gpu`: the CUDA forms of tests whose CPU
forms `make test` runs) and vllm_speed's timer; this script only prepares and runs them there:

1. No CUDA device: one line, exit 0 (`--cpu` runs the same course on the CPU: make gpu-image-env).
2. Versions, before anything else: what the checks import against this package's ranges (setup.cfg;
   torch against GPU_TORCH), counting the carried wheels (.gpu-wheels, `make gpu-wheels`) as installed:
   one line naming what is missing or wrong, exit 1.
3. The carried wheels and this checkout installed into a temporary folder (pip, no index, no network):
   the machine's own packages stay as they are.
4. Each check in a process group of its own under its time limit (a check past it is killed with
   every process it started, torchrun's workers too, so none keeps GPU memory from the next).
5. One JSON report outside the checkout: $OUT/gpu-check.json where OUT is set (the device tool brings
   it back), else in a new temporary folder; its path is printed. Exit 1 if a check failed.

    make gpu-check                          # python -m benchmarks.gpu_check
    python -m benchmarks.gpu_check --list   # each check and what it verifies
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".gpu-wheels"
# The torch the GPU checks accept: from the lent image's 2.11 (CUDA 13) to setup.cfg's ceiling.
# setup.cfg's floor, 2.13, is the oldest the whole suite ran with; 2.11 has not run the checks (no CPU
# build of it installs here: make gpu-image-env stands 2.13's CPU build in for it).
GPU_TORCH = ">=2.11,<2.15"
# Requirements no GPU check imports: lm-eval and datasets (eval, Hub datasets), gguf (GGUF input),
# scipy and matplotlib (eval's report), pooch (`ladder data`), the suite's lint and tracker tools.
NOT_IMPORTED = {"lm-eval", "datasets", "gguf", "scipy", "matplotlib", "pooch", "ruff", "tensorboard", "wandb"}


@dataclass(frozen=True)
class Check:
    claim: str
    tests: str | None  # a test file (its gpu tests; all of it with --cpu), or None: the timer check
    limit: int  # seconds on the GPU
    cpu_limit: int  # seconds with --cpu


CHECKS = {
    "serving_ops": Check(
        "ladder/serving/ops.py: the vLLM model's ladder loop and all-reduce ops, with both reductions on a "
        "real side stream behind a slow stand-in, give the synchronous result eager, under inductor and "
        "replayed from CUDA graphs",
        "tests/test_serving_ops.py",
        limit=70,
        cpu_limit=240,
    ),
    "adapt": Check(
        "adapt on CUDA: the bf16 head loss against fp64 at the 8B vocabulary; compiled layers, bf16, "
        "selective and full recompute under FSDP2 over NCCL (the 8-GPU config at one process); a SIGTERM "
        "to the launcher leaves a whole checkpoint that resumes",
        "tests/test_gpu_adapt.py",
        limit=260,
        cpu_limit=480,
    ),
    "plan_memory_8b": Check(
        "the adapt plan's peak memory for 2 layers of the Llama-3.1-8B shape (full vocabulary, 4,096 tokens, "
        "bf16) against torch.cuda.max_memory_reserved of real adapt steps (goal: within 15%)",
        "tests/test_gpu_plan.py",
        limit=90,
        cpu_limit=120,
    ),
    "tp_runtime": Check(
        "ladder/tp's runtime at world size 1 over NCCL (prefill, then decoding through the KV cache) gives "
        "transformers' logits, standard and ladder",
        "tests/test_gpu_tp.py",
        limit=40,
        cpu_limit=120,
    ),
    "vllm_speed_timing": Check(
        "benchmarks/vllm_speed.py's ReductionTimer times with CUDA events what holds up the compute stream, "
        "and nothing of a reduction on the hidden side stream",
        None,
        limit=20,
        cpu_limit=60,
    ),
}


def requirements() -> list:
    """What the checks import, with the ranges setup.cfg gives (torch: GPU_TORCH), and pytest."""
    from packaging.requirements import Requirement

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = config["options"]["install_requires"].splitlines() + config["options.extras_require"]["test"].splitlines()
    found = [Requirement(line) for line in (line.split("#")[0].strip() for line in lines) if line]
    return [Requirement(f"torch{GPU_TORCH}") if r.name == "torch" else r for r in found if r.name not in NOT_IMPORTED]


def carried(folder: Path) -> dict[str, tuple[str, list]]:
    """The wheels in `folder`: normalised name -> (version, its requirements without extras)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    wheels = {}
    for path in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        with zipfile.ZipFile(path) as archive:
            (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
            lines = archive.read(metadata).decode().splitlines()
        needs = [Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")]
        wheels[canonicalize_name(name)] = (str(version), [r for r in needs if not r.marker])
    return wheels


def version_problems(wheels: dict[str, tuple[str, list]], cuda: bool) -> list[str]:
    """Each requirement of the checks (and of the carried wheels) that what is installed, with the
    wheels counted as installed over it, does not meet: 'NAME VERSION (needs SPEC)' or 'NAME missing'."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.utils import canonicalize_name

    def installed(name: str) -> str | None:
        key = canonicalize_name(name)
        if key in wheels:
            return wheels[key][0]
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    problems = []
    for requirement in [*requirements(), *(r for _, needs in wheels.values() for r in needs)]:
        found = installed(requirement.name)
        if found is None:
            problems.append(f"{requirement.name} missing")
        elif not requirement.specifier.contains(found.split("+")[0], prereleases=True):
            problems.append(f"{requirement.name} {found} (needs {requirement.specifier})")
    if cuda:
        import torch

        if torch.version.cuda is None:
            problems.append(f"torch {torch.__version__} is not a CUDA build")
    return list(dict.fromkeys(problems))


def install(site: Path, wheels: Path) -> None:
    """The carried wheels and this checkout (its stages as `ladder.*`) into `site`, from nothing but
    local files; the checkout's build folders are git-ignored."""
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-build-isolation"]
    command += ["--no-compile", "--disable-pip-version-check", "--target", str(site), *map(str, wheels.glob("*.whl"))]
    installed = subprocess.run([*command, str(REPO)], cwd=REPO, capture_output=True, text=True)
    if installed.returncode != 0:  # e.g. wheels made for another Python (make gpu-wheels: 3.12, the image's)
        raise SystemExit(
            f"gpu_check: cannot install {wheels} and the checkout: {installed.stderr.strip().splitlines()[-1]}"
        )


def run_check(name: str, cpu: bool, environment: dict, scratch: Path) -> dict:
    """One check in its own process group under its limit: what passed, failed and was skipped."""
    check = CHECKS[name]
    limit = check.cpu_limit if cpu else check.limit
    junit = scratch / f"{name}.xml"
    if check.tests:
        # -P: the checkout's folder off sys.path, so that `ladder` is the installed package, with its stages.
        command = [sys.executable, "-P", "-m", "pytest", check.tests, "-q", "-p", "no:cacheprovider"]
        command += [f"--junitxml={junit}"]
        command += [] if cpu else ["-m", "gpu"]
    else:
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--timer", "cpu" if cpu else "cuda"]
    started = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=limit)
        error = None if process.returncode == 0 else f"exit status {process.returncode}"
    except subprocess.TimeoutExpired:
        import psutil  # accelerate's dependency

        # torchrun starts its workers in sessions of their own: each descendant, then the group.
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        error = f"over its {limit} s limit"
    result = {"claim": check.claim, "limit": limit, "seconds": round(time.perf_counter() - started, 1)}
    if check.tests and junit.is_file():
        result["tests"] = {}
        for case in ElementTree.parse(junit).iter("testcase"):
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            properties = {item.get("name"): item.get("value") for item in case.iter("property")}
            result["tests"][case.get("name")] = {"outcome": outcome, **properties}
        outcomes = [test["outcome"] for test in result["tests"].values()]
        if error is None and not cpu and (not outcomes or "skipped" in outcomes):  # a GPU test skipped on a GPU
            error = "a GPU test was skipped or none ran"
    elif not check.tests and error is None:
        result["measured"] = json.loads(output.strip().splitlines()[-1])
    return {**result, "passed": error is None, "error": error, "output_tail": output[-3000:]}


def check_reduction_timer(device_type: str) -> dict:
    """vllm_speed's ReductionTimer: a reduction that holds up the compute stream counts its duration
    (within 2x), one issued on the hidden side stream counts nothing."""
    import torch

    from benchmarks.vllm_speed import ReductionTimer

    side = torch.cuda.Stream() if device_type == "cuda" else None
    timer = ReductionTimer(lambda: side)
    tensor = torch.ones(1024, device=device_type)

    def slow_copy(t):
        torch.cuda._sleep(2_000_000) if t.is_cuda else time.sleep(0.01)  # about a millisecond on a GPU
        return t.clone()

    def alone() -> float:  # the stand-in on the compute stream, timed without the timer
        if side is None:
            started = time.perf_counter()
            slow_copy(tensor)
            return time.perf_counter() - started
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        slow_copy(tensor)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000

    expected = alone()
    timer.call(slow_copy, tensor)
    on_compute = timer.total()
    hidden = None
    if side is not None:
        with torch.cuda.stream(side):
            timer.call(slow_copy, tensor)
        hidden = timer.total() - on_compute
    if not (0.5 * expected < on_compute < 2 * expected and not hidden):
        raise SystemExit(f"ReductionTimer: {on_compute} s on the compute stream for {expected} s; {hidden} s hidden")
    return {"stand_in_seconds": expected, "timed_on_compute_stream": on_compute, "timed_on_side_stream": hidden}


def report_path() -> Path:
    """$OUT/gpu-check.json where OUT is set, else a new temporary folder's: never inside the checkout."""
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    path = folder.resolve() / "gpu-check.json"
    if path.is_relative_to(REPO):
        raise SystemExit(f"gpu_check: OUT={folder} is inside the checkout; give a folder outside it")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="name each check and what it verifies")
    parser.add_argument("--only", action="append", choices=tuple(CHECKS), help="run this check (repeatable)")
    parser.add_argument("--cpu", action="store_true", help="the same course on the CPU (make gpu-image-env)")
    parser.add_argument("--wheels", type=Path, default=WHEELS, help=f"the carried wheels (default {WHEELS})")
    parser.add_argument("--timer", choices=("cpu", "cuda"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(f"{name}: {check.claim}" for name, check in CHECKS.items()))
        return 0
    if args.timer:
        print(json.dumps(check_reduction_timer(args.timer)))
        return 0
    try:
        import torch
    except ImportError:
        print("gpu_check: no GPU check here: torch is not installed")
        return 0
    if not args.cpu and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU here (torch {torch.__version__}): nothing checked; see docs/gpu.md")
        return 0
    out = report_path()
    wheels = carried(args.wheels)
    problems = version_problems(wheels, cuda=not args.cpu)
    if problems:
        print(f"gpu_check: cannot run: {', '.join(problems)} (make gpu-wheels fills .gpu-wheels: carry it)")
        return 1
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        install(Path(scratch) / "site", args.wheels)
        environment = dict(os.environ, PYTHONPATH=str(Path(scratch) / "site"), PYTHONUNBUFFERED="1")
        environment |= {"LADDER_ADAPT_STEPS_ON_CPU": "1"} if args.cpu else {}
        for name in args.only or CHECKS:
            results[name] = run_check(name, args.cpu, environment, Path(scratch))
            print(f"{name}: {'passed' if results[name]['passed'] else 'FAILED'} in {results[name]['seconds']} s")
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": "cpu" if args.cpu else "cuda",
        "machine": (platform.processor() or platform.machine()) if args.cpu else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "carried_wheels": {name: version for name, (version, _) in wheels.items()},
        "seconds": round(time.perf_counter() - started, 1),
        "checks": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(partial, out)
    failed = [name for name, result in results.items() if not result["passed"]]
    print(f"gpu_check: {len(results) - len(failed)} of {len(results)} passed in {report['seconds']} s; report: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
