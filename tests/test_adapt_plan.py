"""The training plan (adapt/plan.py): saved activations per layer as autograd keeps them, the recompute
policy `auto` chooses, `ladder adapt --plan`, and `model.compile: auto`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import ladder
from benchmarks.common import PUBLISHED_SHAPES
from ladder.adapt.memory import keep_fewer_activations
from ladder.adapt.plan import (
    MEMORY_MARGIN,
    layer_saved_bytes,
    make_plan,
    measured_saved_bytes,
    model_shape,
    setting_of,
    shape_plan,
    stop_seconds,
)
from ladder.adapt.preemption import STOP_SIGNALS
from ladder.adapt.recipe import ModelSpec, load_recipe
from ladder.errors import UsageError
from ladder.plan.costs import ModelShape
from tiny import random_ids, tiny_llama

CPU_RECIPE = "recipes/smollm2-135m-ladder-cpu.yaml"


def test_saved_activations_per_layer_are_what_autograd_keeps():
    model = ladder.to_ladder(tiny_llama(), [4, 5]).train()
    model.set_attn_implementation("sdpa")
    keep_fewer_activations(model)
    model.requires_grad_(False)
    model.model.layers[4].requires_grad_(True)
    ids = random_ids(batch=2, length=40)
    counted = measured_saved_bytes(model, ids, 4)
    planned = layer_saved_bytes(model_shape(model.config), ids.numel(), "none", 4, 4)
    assert counted > 0
    assert abs(planned / counted - 1) < 0.10, (planned, counted)


def test_auto_recomputes_the_least_that_fits_the_device():
    recipe = load_recipe(CPU_RECIPE, ["trainable.mode=all", "model.activation_checkpointing=auto"])
    shape = model_shape(tiny_llama().config)
    setting = setting_of(recipe, shape, devices=1, accelerator=False)
    roomy = make_plan(shape, setting, device_memory=1e12, device_flops=1e12)
    peaks = roomy.peak_by_policy
    assert peaks["none"] > peaks["selective"] > peaks["full"]
    assert roomy.activation_checkpointing == "none"
    between = make_plan(
        shape, setting, device_memory=(peaks["selective"] + peaks["none"]) / 2 / MEMORY_MARGIN, device_flops=1e12
    )
    assert between.activation_checkpointing == "selective"
    # Recompute costs FLOPs: the same device, forced to recompute everything, is slower.
    full = make_plan(shape, setting, device_memory=1e12, device_flops=1e12, policy="full")
    assert full.flops_per_token > roomy.flops_per_token == roomy.model_flops_per_token
    assert full.tokens_per_second < roomy.tokens_per_second


def test_training_only_upper_layers_plans_fewer_flops_and_bytes():
    shape = model_shape(tiny_llama().config)
    plans = {
        mode: make_plan(
            shape,
            setting_of(load_recipe(CPU_RECIPE, [f"trainable.mode={mode}", "model.ladder_layers=2"]), shape, 4, True),
            device_memory=1e12,
            device_flops=1e12,
        )
        for mode in ("all", "ladder")
    }
    assert plans["ladder"].model_flops_per_token < plans["all"].model_flops_per_token
    assert plans["ladder"].peak_bytes_per_device < plans["all"].peak_bytes_per_device


@pytest.mark.parametrize("config, devices", [("fsdp-8gpu.yaml", 8), ("fsdp-multinode.yaml", 16)])
def test_launch_configs_give_a_preempted_run_time_to_write_its_checkpoint(config, devices, monkeypatch):
    """The launch line of each multi-GPU accelerate config has torchrun pass on both stop signals and
    wait, before it kills the processes, twice what the plan gives an 8B run to end its step and write
    its checkpoint (torchrun's default, 30 s, killed them mid-write, and SIGUSR1 was not passed on)."""
    header = (Path("recipes/accelerate") / config).read_text()
    timeout = int(re.search(r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+)", header)[1])
    signals = re.search(r"PET_SIGNALS_TO_HANDLE=(\S+)", header)[1]
    shape = ModelShape.from_config(PUBLISHED_SHAPES["llama-3.1-8b"])
    for recipe_file in ("llama31-8b-instruct-ladder16.yaml", "llama31-8b-instruct-ladder20.yaml"):
        recipe = load_recipe(Path("recipes") / recipe_file)
        needed = stop_seconds(shape_plan(recipe, shape, devices, 80e9, 989e12, accelerator=True), recipe)
        assert needed["checkpoint_write"] > 30  # what torchrun's default leaves
        assert timeout >= 2 * sum(needed.values()), (recipe_file, needed)
    assert {signal.name for signal in STOP_SIGNALS} <= set(signals.split(","))
    # torchrun (accelerate launch runs it in the launcher's process) reads both variables.
    from torch.distributed.run import config_from_args, get_args_parser

    monkeypatch.setenv("PET_SIGNALS_TO_HANDLE", signals)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(timeout))
    launch, _, _ = config_from_args(get_args_parser().parse_args(["--nproc-per-node", "1", "train.py"]))
    assert (launch.signals_to_handle, launch.shutdown_timeout) == (signals, timeout)


def test_plan_command_prints_one_json_object(capsys):
    from ladder.adapt.cli import main

    assert main([CPU_RECIPE, "--plan", "--json", "--gpus", "2", "--gpu-memory", "8e9", "--gpu-flops", "1e14"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("peak_bytes_per_device", "activation_checkpointing", "flops_per_token", "tokens_per_second"):
        assert plan[key]
    assert plan["device_hours"] > 0 and plan["devices"] == 2
    with pytest.raises(UsageError, match="go with --plan"):
        main([CPU_RECIPE, "--gpus", "2"])


def test_checkpointing_and_compile_keys():
    assert ModelSpec(compile="auto").compiles(accelerator=True)
    assert not ModelSpec(compile="auto").compiles(accelerator=False)
    assert ModelSpec(gradient_checkpointing=True).checkpointing() == "full"  # the earlier key still works
    with pytest.raises(UsageError, match="contradicts"):
        load_recipe(CPU_RECIPE, ["model.gradient_checkpointing=true", "model.activation_checkpointing=selective"])


def test_selective_recompute_checkpoints_every_other_layer():
    from ladder.adapt.models import configure_student

    model = ladder.to_ladder(tiny_llama(), [4, 5]).train()
    configure_student(model, ModelSpec(), "selective")
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False] * 3


@pytest.mark.parametrize("kd_weight", [0.0, 0.5])
def test_head_loss_in_bf16_runs_no_float32_gemm_and_matches_full_logits(kd_weight):
    from torch.utils._python_dispatch import TorchDispatchMode

    from ladder.adapt.losses import chunk_positions, head_losses, next_token_labels

    assert chunk_positions(128256, "cuda") >= 1024  # few reads of the head's weight per micro-batch
    generator = torch.Generator().manual_seed(0)
    batch, seq, width, vocab = 2, 37, 32, 64
    hidden = torch.randn(batch, seq, width, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, width, generator=generator, requires_grad=True)
    teacher_hidden = torch.randn(batch, seq, width, generator=generator)
    teacher_weight = torch.randn(vocab, width, generator=generator)
    labels = next_token_labels(torch.randint(0, vocab, (batch, seq), generator=generator))

    def full(h, w, th, tw):
        logits = h.bfloat16().float() @ w.bfloat16().float().T
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        teacher = (th.bfloat16().float() @ tw.bfloat16().float().T).log_softmax(-1).flatten(0, 1)
        kd = torch.nn.functional.kl_div(
            logits.log_softmax(-1).flatten(0, 1), teacher, log_target=True, reduction="batchmean"
        )
        return (1 - kd_weight) * ce + kd_weight * kd

    expected = full(hidden, weight, teacher_hidden, teacher_weight)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))

    class MatmulDtypes(TorchDispatchMode):
        seen: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.seen.add(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    with MatmulDtypes() as matmuls, torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = head_losses(hidden, weight, labels, teacher_hidden, teacher_weight, kd_weight, chunk_tokens=10)
        grads = torch.autograd.grad(loss, (hidden, weight))
    assert matmuls.seen == {torch.bfloat16}
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2 * want.abs().max().item())


# --- Devices: the device table `ladder plan` uses, sizes with units, no partial description -------


def _plan(capsys, *arguments: str) -> dict:
    """`ladder adapt CPU_RECIPE --plan --json` for Llama-3.2-1B's published shape (the embedded GGUF takes
    seconds to parse)."""
    from ladder.adapt.cli import main

    model = "model.path=meta-llama/Llama-3.2-1B-Instruct"
    assert main([CPU_RECIPE, model, "--plan", "--json", *arguments]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_prices_devices_by_name_from_ladder_plan_s_table_and_takes_sizes_with_units(capsys):
    """Issue 38 item 2: `--gpu-memory 80GB` was "invalid float value", and nothing named a device."""
    from ladder.plan.speed import device_profile

    h100 = device_profile("h100")
    named = _plan(capsys, "--hardware", "h100", "--devices", "8")
    assert (named["device_flops"], named["device_memory"], named["devices"]) == (h100.flops, h100.memory, 8)
    given = [_plan(capsys, "--gpus", "8", "--gpu-memory", size, "--gpu-flops", "989e12") for size in ("80GB", "8e10")]
    assert given[0] == given[1] == named
    assert _plan(capsys, "--hardware", "h100", "--gpu-memory", "80GiB")["device_memory"] == 80 * 2**30
    assert _plan(capsys, "--hardware", "989e12,3.35e12,80GB")["device_memory"] == 80e9


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--gpus", "8", "--gpu-memory", "80e9"], "--devices and --gpu-memory describe the devices only in part"),
        (["--gpus", "8"], "--devices describe the devices only in part"),
        (["--gpu-flops", "989e12"], "--gpu-flops describe the devices only in part"),
        (["--gpu-memory", "80GX", "--gpu-flops", "1e15"], "--gpu-memory '80GX' is not a size like"),
        (["--hardware", "tpu9"], "--hardware 'tpu9' is not one of h100"),
        (["--hardware", "989e12,3.35e12"], "the memory of device 989e12,3.35e12 is not known"),
    ],
)
def test_plan_refuses_a_partial_device_description_in_one_line(arguments, message):
    """Issue 38 item 2: `--gpus 8 --gpu-memory 80e9` priced the GPUs at this CPU's rate (0.0669 TFLOP/s)."""
    from ladder.adapt.cli import main

    with pytest.raises(UsageError, match=re.escape(message)):
        main([CPU_RECIPE, "--plan", *arguments])


def test_plan_of_a_recipe_naming_a_published_llama_downloads_nothing(hub_cache, capsys):
    """Issue 38 item 3: a recipe's model.path that is a Hub ID plans from the shipped Llama 3.x shapes."""
    plan = _plan(capsys, "model.path=meta-llama/Llama-3.1-8B-Instruct", "model.ladder_layers=16", "--hardware", "h100")
    per_layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert plan["memory"]["parameters"] == pytest.approx((32 * per_layer + 2 * 128256 * 4096 + 4096) * 4)
    assert not any(hub_cache.rglob("*"))


# --- Memory: the plan against torchtitan's published 8B peaks; the 8B recipes' recompute and margin ---


def test_plan_lands_within_15_percent_of_torchtitan_s_published_8b_memory():
    """Issue 36 item 8: set to torchtitan's published Llama-3.1-8B runs (FSDP on 8 and 128 H100s of
    96 GB, 2 x 8192 tokens, selective op recompute), the plan said 58.3 GiB where torchtitan measured
    82.4 (eager) and 77.0 (compiled): it left out the unchunked fp32 loss, the allocator's reserve
    and the root FSDP unit."""
    from benchmarks.plan_check import check_memory_published

    rows = check_memory_published()
    assert {row.observed for row in rows} == {82.4, 77.0, 67.0, 62.0}
    assert all(row.passed for row in rows), [(row.setting, round(row.error, 3)) for row in rows]


@pytest.mark.parametrize("name", ["llama31-8b-instruct-ladder16.yaml", "llama31-8b-instruct-ladder20.yaml"])
def test_8b_recipes_state_the_plan_s_recompute_and_its_margin(name):
    from ladder.adapt.plan import shape_plan
    from ladder.plan.costs import ModelShape
    from ladder.plan.models import published_config

    recipe = load_recipe(f"recipes/{name}")
    shape = ModelShape.from_config(published_config("meta-llama/Llama-3.1-8B-Instruct"))
    plan = shape_plan(recipe, shape, 8, 80e9, 989e12, accelerator=True)
    header = " ".join(
        line.lstrip("#").strip() for line in open(f"recipes/{name}").read().split("\nname:")[0].splitlines()
    )
    gib, limit = 2**30, MEMORY_MARGIN * 80e9
    assert f"model.activation_checkpointing: auto -> {plan.activation_checkpointing}." in header
    assert f"peak per 80 GB GPU is about {plan.peak_bytes_per_device / gib:.0f} GiB" in header
    assert f"Margin: {(limit - plan.peak_bytes_per_device) / gib:.0f} GiB below the {MEMORY_MARGIN:.0%}" in header
