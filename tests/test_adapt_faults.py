"""adapt/'s faults: a stalled rank (the two timeouts), SIGTERM finishing the step and resuming exactly,
a SIGKILL while a checkpoint is written, a full disk during one, and the refusal to reuse a run made
under another recipe. Multi-process runs are real `accelerate launch`es of `ladder adapt`."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from adapt_runs import (
    STEPS,
    assert_preempted,
    fsdp_launcher,
    losses,
    ranks,
    run_adapt,
    wait_for_losses,
    weights,
    write_recipe,
)
from checkpoints import private_mount_namespace
from ladder.adapt.recipe import load_recipe
from ladder.adapt.train import train
from ladder.cli import main as ladder_main
from tiny import two_processes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, tiny_checkpoint, corpus) -> Path:
    """The reference: one process, micro_batch 4."""
    directory = tmp_path_factory.mktemp("one")
    train(load_recipe(write_recipe(directory, tiny_checkpoint, corpus, budget=STEPS * 256)))
    return directory / "run"


def started_ranks(launcher: subprocess.Popen, count: int = 2) -> list[psutil.Process]:
    """The launcher's ranks by rank, once all have started."""
    deadline = time.monotonic() + 60
    while len(found := ranks(launcher)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(found) == count, "the ranks did not start"
    return sorted(found, key=lambda rank: int(rank.environ()["RANK"]))


def wait_until_waiting(process: psutil.Process, timeout: float = 120) -> None:
    """Until `process` uses no CPU for a second: it waits (here: for a stopped peer)."""
    deadline, used = time.monotonic() + timeout, -1.0
    while time.monotonic() < deadline:
        now = sum(process.cpu_times()[:2])
        if now == used:
            return
        used = now
        time.sleep(1)


@two_processes
def test_a_stalled_rank_ends_the_run_fast_naming_the_step(tmp_path, tiny_checkpoint, corpus):
    collective = 3  # seconds (timeout.collective; 900 by default)
    overrides = {"batch.micro_batch": 2, "timeout.collective": collective, "precision": "bf16"}
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus, budget=STEPS * 256, **overrides)
    run_dir = tmp_path / "run"
    assert ladder_main(["adapt", str(recipe), "--prepare-data"]) == 0  # several processes need it first
    process = run_adapt([str(recipe)], launcher=fsdp_launcher(), start_new_session=True)
    main, other = started_ranks(process)
    # The main process stalls while the run starts, for longer than timeout.collective: the other
    # waits for it under the long timeout.setup, and the run goes on once it continues.
    main.suspend()
    wait_until_waiting(other)
    time.sleep(2 * collective)
    main.resume()
    wait_for_losses(process, run_dir, 2)
    # Training: a process that stops answering ends the run within timeout.collective.
    other.suspend()
    stalled = time.monotonic()
    main.wait(timeout=120)
    waited = time.monotonic() - stalled
    other.resume()  # so that torchrun's SIGTERM reaches it (a stopped process would wait for SIGKILL)
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0 and not (run_dir / "model").exists()
    said = [line for line in output.splitlines() if line.startswith("ladder adapt: process 0:")]
    step = len(losses(run_dir)) + 1
    assert len(said) == 1 and said[0].startswith(
        f"ladder adapt: process 0: step {step}: the processes lost touch (timeout.collective={collective}s): "
    ), output
    assert said[0].endswith(f"the last checkpoint is kept: {run_dir / 'checkpoints' / 'step-000003'}") == (step > 3)
    assert collective <= waited < collective + 20
    # bf16 under FSDP2: parameters gathered in bf16, gradients still reduced in fp32.
    assert "FSDP2: parameters in bfloat16, gradients reduced in float32" in output.splitlines()


def test_sigterm_finishes_the_step_saves_and_resumes_exactly(tmp_path, tiny_checkpoint, corpus, one_process_run):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus, budget=STEPS * 256)
    run_dir = tmp_path / "run"
    process = run_adapt([str(recipe)])
    wait_for_losses(process, run_dir, 4)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert 4 <= assert_preempted(output, run_dir, recipe, "SIGTERM") < STEPS

    assert ladder_main(["adapt", str(recipe), "resume=true"]) == 0
    assert losses(run_dir) == losses(one_process_run)
    resumed, straight = weights(run_dir), weights(one_process_run)
    assert all(torch.equal(resumed[name], straight[name]) for name in straight)


# --- a kill while a checkpoint is written -----------------------------------------------------------


def test_a_kill_while_a_checkpoint_is_written_keeps_the_previous_one(
    tmp_path,
    tiny_checkpoint,
    corpus,
    one_process_run,
):
    # The script dies inside the second checkpoint's save, after accelerate wrote the model,
    # optimizer and RNG states and before the step file and the rename: the checkpoint at step 3
    # must stay the latest, and resuming from it must give the uninterrupted run's losses and weights.
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus, budget=STEPS * 256)
    script = textwrap.dedent(f"""
        import os, signal, sys
        from accelerate import Accelerator
        from ladder.cli import main
        real_save_state = Accelerator.save_state
        def save_state_then_die(self, output_dir=None, **kwargs):
            result = real_save_state(self, output_dir, **kwargs)
            if "step-000006" in str(output_dir):
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        Accelerator.save_state = save_state_then_die
        sys.exit(main(["adapt", {str(recipe)!r}]))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir() if p.name.startswith("step-")] == ["step-000003"]
    half_written = [p for p in checkpoints.iterdir() if p.name.startswith(".step-000006")]
    assert len(half_written) == 1 and (half_written[0] / "optimizer.bin").is_file()

    assert ladder_main(["adapt", str(recipe), "resume=true"]) == 0
    assert losses(tmp_path / "run") == losses(one_process_run)
    resumed, straight = weights(tmp_path / "run"), weights(one_process_run)
    assert all(torch.equal(resumed[name], straight[name]) for name in straight)
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".")], "the half-written save was cleared"


def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_previous_one(
    tmp_path,
    tiny_checkpoint,
    corpus,
    one_process_run,
):
    # A real ENOSPC: the run folder is on a 110 MB tmpfs, where the checkpoint at step 3 (77 MB:
    # weights and AdamW's two moments in fp32) fits and the one at step 6 does not.
    prefix = private_mount_namespace()
    disk, copied = tmp_path / "disk", tmp_path / "copied"
    disk.mkdir()
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus, budget=STEPS * 256, output_dir=str(disk / "run"))
    script = (
        f"mount -t tmpfs -o size=110m tmpfs {disk} && {sys.executable} -m ladder.cli adapt {recipe}; "
        f"echo exit=$?; cp -a {disk / 'run'} {copied}"
    )
    result = subprocess.run([*prefix, "sh", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().splitlines()[-1] == "exit=2", result.stdout + result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error == (
        f"ladder adapt: error: no space left on the device while writing the checkpoint at step 6 "
        f"({disk / 'run' / 'checkpoints' / 'step-000006'}); the checkpoint at step 3 is kept: "
        "free some space and resume with resume=true"
    ), result.stderr
    assert "Traceback" not in result.stderr
    # The previous checkpoint is whole (the uninterrupted run's, tensor for tensor) and nothing else is left.
    assert [p.name for p in (copied / "checkpoints").iterdir()] == ["step-000003"]
    kept, straight = copied / "checkpoints" / "step-000003", one_process_run / "checkpoints" / "step-000003"
    for name in ("model.safetensors",):
        ours, theirs = load_file(kept / name), load_file(straight / name)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    ours, theirs = (torch.load(d / "optimizer.bin", weights_only=True) for d in (kept, straight))
    assert all(
        torch.equal(ours["state"][i][k], theirs["state"][i][k])
        for i in theirs["state"]
        for k in ("exp_avg", "exp_avg_sq")
    )
    assert {p.name for p in kept.iterdir()} == {p.name for p in straight.iterdir()}


# --- no silent reuse --------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["finished", "partial"])
def test_resume_refuses_a_run_made_with_other_settings(tmp_path, tiny_checkpoint, corpus, capsys, state):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus, budget=2 * 256, checkpoint_every=1)
    train(load_recipe(recipe))
    run_dir = tmp_path / "run"
    if state == "partial":  # as if killed after the checkpoint at step 1
        (run_dir / "model").rename(tmp_path / "done")
    kept = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    changes = {
        "model.ladder_layers": "model.ladder_layers=1",
        "model.path": "model.path=embedded",
        "data.train": f"data.train=[{corpus / 'heldout.txt'}]",
        "objective.name": "objective.name=kd",
        "optimizer.lr": "optimizer.lr=0.1",
        "budget": "budget=1024",
        "seed": "seed=7",
    }
    for key, override in changes.items():
        assert ladder_main(["adapt", str(recipe), "resume=true", override]) == 2, key
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "the recipe differs" in lines[0] and f" at {key};" in lines[0], (key, lines)
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == kept
    # The same recipe is still accepted: a finished run returns its model, a partial one continues.
    assert ladder_main(["adapt", str(recipe), "resume=true"]) == 0
    assert (run_dir / "model" / "model.safetensors").is_file()
