"""adapt/ beyond one plain process: FSDP2 on 2 CPU processes over gloo (the path the 8-GPU recipes
take; gradients reduced in fp32; process 0 reads the checkpoint, process 1 receives its shards),
two localhost "nodes" of one process (the multi-node config), gradient accumulation (with DDP's
no_sync), preemption signals, SIGKILLs of the launcher and of a checkpoint save, a stalled rank
(the two timeouts), and the refusal to reuse a run made under another recipe.

Each multi-process run is a real `accelerate launch` of `ladder adapt` on a tiny checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from adapt_runs import losses, metrics, prose, run_adapt, write_recipe
from checkpoints import private_mount_namespace
from ladder.adapt.data import prepare_data
from ladder.adapt.losses import block_losses
from ladder.adapt.recipe import load_recipe
from ladder.adapt.train import train
from ladder.cli import main as ladder_main
from ladder.launch import free_port, multi_process_launcher
from tiny import save_tiny_checkpoint, two_processes

REPO = Path(__file__).resolve().parents[1]
FSDP_CONFIG = REPO / "recipes" / "accelerate" / "fsdp-cpu-2proc.yaml"
MULTINODE_CONFIG = REPO / "recipes" / "accelerate" / "fsdp-multinode.yaml"
STEPS = 8  # 256 tokens each; checkpoints at steps 3 and 6


def fsdp_launcher() -> list[str]:
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(FSDP_CONFIG),
        "--main_process_port",
        str(free_port()),
    ]


def launch(recipe: Path, launcher: list[str], *overrides: str) -> str:
    assert ladder_main(["adapt", str(recipe), *overrides, "--prepare-data"]) == 0  # several processes need it first
    process = run_adapt([str(recipe), *overrides], launcher=launcher)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    return output


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model" / "model.safetensors")


def assert_same_curve(reference: list[dict], other: list[dict], tolerance: float, grad_tolerance: float) -> None:
    assert [r["step"] for r in reference] == [r["step"] for r in other]
    for a, b in zip(reference, other):
        for key in ("loss", "eval_loss", "grad_norm"):
            if key in a:
                rel = grad_tolerance if key == "grad_norm" else tolerance
                assert b[key] == pytest.approx(a[key], rel=rel), (key, a, b)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, tiny_checkpoint, corpus) -> Path:
    """The reference: one process, micro_batch 4."""
    directory = tmp_path_factory.mktemp("one")
    train(load_recipe(write_recipe(directory, tiny_checkpoint, corpus, budget=STEPS * 256)))
    return directory / "run"


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, tiny_checkpoint, corpus) -> Path:
    """The same recipe on 2 FSDP2 processes of micro_batch 2: the same blocks per step."""
    directory = tmp_path_factory.mktemp("fsdp")
    recipe = write_recipe(directory, tiny_checkpoint, corpus, budget=STEPS * 256, **{"batch.micro_batch": 2})
    output = launch(recipe, fsdp_launcher())
    assert "2 process(es)" in output
    assert len(host_memory(output)) == 2  # process 0 read the checkpoint, process 1 received its shards
    # The mixed-precision policy, as the run read it back from its FSDP units: gradients reduce in fp32.
    assert "FSDP2: parameters in float32, gradients reduced in float32" in output.splitlines()
    return directory / "run"


def host_memory(output: str) -> list[float]:
    """The peak RSS (MiB) of each process from the models' loading to the first step, as the run said."""
    (line,) = [line for line in output.splitlines() if line.startswith("host memory from the models' loading")]
    return [float(part.split(" MiB")[0]) for part in line.split(": ", 1)[1].split(", ")]


# --- FSDP -------------------------------------------------------------------------------------------


@two_processes
def test_fsdp_on_two_processes_gives_the_loss_curve_of_one(one_process_run, fsdp_run):
    # Parameters are sharded DTensors and gradients reduce-scattered: only the summation order
    # differs from one process, so the curves agree to float32 rounding, which grows over the steps
    # (measured: losses within 1e-6 relative, gradient norms within 1.1e-4 by step 4).
    assert_same_curve(metrics(one_process_run), metrics(fsdp_run), tolerance=1e-5, grad_tolerance=1e-3)
    # The checkpoints are FSDP's sharded form (one DCP folder, a shard per rank), not DDP's.
    checkpoint = fsdp_run / "checkpoints" / "step-000006"
    assert (checkpoint / "pytorch_model_fsdp_0").is_dir() and not (checkpoint / "model.safetensors").exists()
    assert sorted(p.name for p in checkpoint.glob("random_states_*.pkl")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]


@two_processes
def test_fsdp_final_model_is_the_gathered_trained_model(one_process_run, fsdp_run, tiny_checkpoint):
    # The final model is gathered from the shards (get_state_dict) into one plain checkpoint that
    # transformers loads; its held-out loss is the one the sharded model logged last, and its
    # weights are the one-process run's (to float32 rounding through 8 AdamW steps).
    final = fsdp_run / "model"
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    gathered, reference = weights(fsdp_run), weights(one_process_run)
    original = load_file(tiny_checkpoint / "model.safetensors")
    assert gathered.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.allclose(gathered[name], tensor, rtol=0, atol=1e-4), name
        assert not torch.equal(gathered[name], original[name]), f"{name} did not train"
    loaded = model.state_dict()
    assert all(torch.equal(loaded[name], gathered[name]) for name in gathered)

    heldout = prepare_data(load_recipe(final / "recipe.yaml").data, AutoTokenizer.from_pretrained(final)).eval.ids
    with torch.no_grad():
        logged = block_losses(model, torch.from_numpy(heldout.astype(np.int64))).mean()
    assert float(logged) == pytest.approx([r["eval_loss"] for r in metrics(fsdp_run) if "eval_loss" in r][-1], rel=1e-5)


# --- several nodes ----------------------------------------------------------------------------------


def machine_launcher(machine_rank: int, port: int) -> list[str]:
    """`accelerate launch` as one node of fsdp-multinode.yaml runs it, here 2 "nodes" of one process."""
    return [
        *[sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(MULTINODE_CONFIG)],
        *["--num_machines", "2", "--num_processes", "2", "--machine_rank", str(machine_rank)],
        *["--main_process_ip", "127.0.0.1", "--main_process_port", str(port)],
    ]


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """A tiny checkpoint whose decoder layers, not its (tied) embedding, hold most of its 88 MB: what a
    process that receives its shards saves shows in its memory, as for an 8B model."""
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("wide-llama"),
        smollm2_tokenizer_dir,
        num_hidden_layers=8,
        intermediate_size=8192,
        tie_word_embeddings=True,
    )


@two_processes
def test_two_nodes_read_the_checkpoint_once_and_give_the_loss_curve_of_one_process(
    tmp_path,
    wide_checkpoint,
    corpus,
):
    # Two "nodes" of one process each on localhost (two launchers, static rendezvous, gloo) train the
    # recipe that one process trains, with a teacher (kd mixed with lm, plus the hidden-stream term).
    # Process 1 builds the student and the teacher on the meta device, rewires there, and receives
    # the student's shards and the whole teacher from process 0: its peak memory stays below process
    # 0's by much of the checkpoint, and the losses are one process's (today's tolerance).
    # The two runs sum their gradients in another order (one batch of 4 against two of 2 and an
    # all-reduce), so they differ by fp32 rounding, ~1e-7 relative. At the shared recipe's lr (3e-3)
    # this wide model diverges (loss 5.4 -> 14 in 4 steps, or 41 on another CPU's kernels), which
    # amplifies that rounding to 1e-5 and past; at 3e-4 the curve is stable and the runs agree to
    # ~2e-7, so the 1e-5 tolerance below has a 50x margin on any machine.
    steps = 4
    overrides = {
        **{"budget": steps * 256, "objective.name": "mix", "objective.hidden_weight": 0.5, "eval_every": 2},
        "optimizer.lr": 3e-4,
    }
    one = write_recipe(tmp_path / "one", wide_checkpoint, corpus, **overrides)
    train(load_recipe(one))
    two = write_recipe(tmp_path / "two", wide_checkpoint, corpus, **overrides, **{"batch.micro_batch": 2})
    assert ladder_main(["adapt", str(two), "--prepare-data"]) == 0
    port = free_port()
    # On a machine with GPUs each "node" takes its own (both are local rank 0).
    gpus = [
        {**os.environ, "CUDA_VISIBLE_DEVICES": str(rank)} if torch.cuda.device_count() > 1 else None for rank in (0, 1)
    ]
    nodes = [run_adapt([str(two)], launcher=machine_launcher(rank, port), env=gpus[rank]) for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "2 process(es)" in outputs[0]
    assert_same_curve(metrics(tmp_path / "one" / "run"), metrics(tmp_path / "two" / "run"), 1e-5, 1e-3)
    checkpoint_mib = (wide_checkpoint / "model.safetensors").stat().st_size / 2**20
    main, other = host_memory(outputs[0])
    print(f"peak RSS from loading to the first step: process 0 {main:.0f} MiB, process 1 {other:.0f} MiB")
    assert other < main - checkpoint_mib / 2, (main, other, checkpoint_mib)


def wait_for_losses(process: subprocess.Popen, run_dir: Path, count: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) >= count:
            return
        time.sleep(0.05)


def ranks(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The training processes `accelerate launch` started (torchrun's workers)."""
    return [child for child in psutil.Process(launcher.pid).children() if "LOCAL_RANK" in child.environ()]


def assert_preempted(output: str, run_dir: Path, recipe: Path, signal_name: str) -> int:
    """The run said where it stopped and how to resume, and left complete checkpoints only; returns the step."""
    said = [line for line in output.splitlines() if "resume with:" in line]
    assert len(said) == 1, output
    step = len(losses(run_dir))
    checkpoint = run_dir / "checkpoints" / f"step-{step:06d}"
    assert said[0].startswith(f"ladder adapt: {signal_name}: stopped after step {step} with a checkpoint there, ")
    assert said[0].split(", ")[-1].startswith(f"{checkpoint}; resume with: ladder adapt {recipe} resume=true")
    assert (checkpoint / "trainer_state.json").is_file() and not (run_dir / "model").exists()
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")], "a temporary was left"
    return step


@two_processes
def test_fsdp_preempted_then_killed_resumes_exactly(tmp_path, tiny_checkpoint, corpus, fsdp_run):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus, budget=STEPS * 256, **{"batch.micro_batch": 2})
    run_dir = tmp_path / "run"
    assert ladder_main(["adapt", str(recipe), "--prepare-data"]) == 0
    # SIGUSR1 (a scheduler's warning) reaches the ranks at once, as Slurm signals every task: each
    # finishes the step in progress, all agree to stop after the same one, save it and exit 0.
    process = run_adapt([str(recipe)], launcher=fsdp_launcher(), start_new_session=True)
    wait_for_losses(process, run_dir, 2)
    for rank in ranks(process):
        rank.send_signal(signal.SIGUSR1)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    preempted_at = assert_preempted(output, run_dir, recipe, "SIGUSR1")
    assert 2 <= preempted_at < STEPS

    # The resumed run is killed (its own session, so the SIGKILL takes the launcher and both ranks at
    # once, as a lost node would) after the next periodic checkpoint; the second resume finishes.
    process = run_adapt([str(recipe), "resume=true"], launcher=fsdp_launcher(), start_new_session=True)
    wait_for_losses(process, run_dir, max(preempted_at, 3) + 1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (run_dir / "model").exists(), "the run finished before it could be killed"

    launch(recipe, fsdp_launcher(), "resume=true")
    # Each resumed run loads the sharded checkpoint (model, optimizer, scheduler, both ranks' RNG)
    # and computes exactly what the uninterrupted run computed.
    assert losses(run_dir) == losses(fsdp_run)
    resumed, straight = weights(run_dir), weights(fsdp_run)
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[name], straight[name]) for name in straight)


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


# --- gradient accumulation --------------------------------------------------------------------------


@two_processes
def test_gradient_accumulation_makes_the_update_of_one_large_batch(tmp_path, tiny_checkpoint):
    # micro_batch 4 x grad_accum 1 against 2 x 2 in one process and 1 x 2 on two DDP processes,
    # whose first micro-step runs under no_sync: the same blocks per step, so the same loss and
    # gradient norm (a missing 1/grad_accum doubles the norm; a skipped sync changes it). The data
    # are chats trained on the assistant turns, with isolated documents: the blocks hold unevenly
    # many labelled positions, and the loss is their mean over the whole step (a mean of each
    # micro-batch's mean would differ), over micro-batches and processes alike. The objective mixes
    # in distillation, whose term covers every position: only the next-token term is reweighted.
    records = [
        {
            "messages": [
                {"role": "user", "content": prose(i, 1)},
                {"role": "assistant", "content": prose(i + 50, i % 3 + 1)},
            ]
        }
        for i in range(40)
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    chats = {"data.train": [str(tmp_path / "chat.jsonl")], "data.eval": [], "data.heldout_fraction": 0.1}
    chats |= {"data.isolate_documents": True, "data.cache_dir": str(tmp_path / "cache"), "objective.name": "mix"}

    def recipe(name: str, **batch) -> Path:
        return write_recipe(tmp_path / name, tiny_checkpoint, tmp_path, budget=3 * 256, **chats, **batch)

    large = recipe("large")
    accumulated = recipe("accumulated", **{"batch.micro_batch": 2, "batch.grad_accum": 2})
    shared = recipe("shared", **{"batch.micro_batch": 1, "batch.grad_accum": 2})
    train(load_recipe(large))
    train(load_recipe(accumulated))
    launch(shared, multi_process_launcher(2))
    reference = metrics(tmp_path / "large" / "run")
    for other in ("accumulated", "shared"):
        assert_same_curve(reference, metrics(tmp_path / other / "run"), tolerance=1e-5, grad_tolerance=1e-4)
    # (The two-process weights are not compared element-wise: AdamW's first steps move a weight
    # whose gradient is near zero by about lr either way, so rounding-level gradient differences
    # can show there; the loss and gradient-norm curves above are the sensitive check.)
    # One process: equal to well under one step's lr (3e-3); measured 2.5e-5 at most (2 of 6.4M weights).
    final, expected = weights(tmp_path / "accumulated" / "run"), weights(tmp_path / "large" / "run")
    assert all(torch.allclose(final[name], expected[name], rtol=0, atol=1e-4) for name in expected)


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
