"""`ladder plan MODEL --tp T ...`: before converting, what ladder wiring would buy under tensor
parallelism on the given hardware, predicted by ladder/plan/speed.py from the model's config.json alone
(no weights are read). `ladder plan --calibrate` measures this machine's profile instead.

Per layer choice it prints the decode time per token of standard and ladder wiring, the speed-up, the
all-reduces ladder hides and the no-communication bound; when MODEL is a conversion's folder, the
damage it measured (conversion.json, layer_search.json) is printed beside the matching choice; with
`--recipe` (or when MODEL is a folder `ladder adapt` wrote, with its recipe.yaml), what retraining that
choice costs (device-hours, from `ladder adapt --plan`'s model).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict
from pathlib import Path

from ladder.errors import ArgumentParser, UsageError
from ladder.io.loading import EMBEDDED, HUB_MODEL_ID, embedded_model_path, model_name
from ladder.layers import check_llama_model_type, format_layers, parse_auto_layers, parse_ladder_layers
from ladder.plan.costs import ModelShape
from ladder.plan.speed import (
    Device,
    Prediction,
    Setting,
    device_names,
    device_profile,
    link_names,
    link_profile,
    predict,
)

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = ArgumentParser(prog="ladder plan", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "model", nargs="?", help="a checkpoint folder, a .gguf file, 'embedded', or a Hub ID in the local cache"
    )
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (default 8)")
    parser.add_argument(
        "--interconnect",
        help=f"{', '.join(link_names())}, BANDWIDTH,LATENCY_US (bus bytes/s, us), or a --calibrate .json "
        "(default: the --device calibration's link, else nvlink; --device cpu needs one)",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="h100",
        help=f"{', '.join(device_names())}, FLOPS,BANDWIDTH[,MEMORY] (per second; bytes), or a --calibrate .json "
        "(default h100)",
    )  # fmt: skip
    parser.add_argument("--batch", default="1,16,64", help="batch sizes, comma-separated (default 1,16,64)")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
    parser.add_argument("--new", type=int, default=512, help="new tokens (default 512)")
    parser.add_argument(
        "--layers",
        help="layer choices, comma-separated: N (the upper N), all, auto:N (a contiguous window of N), or a "
        "set of ranges joined by + (0-3+8-11); default: a quarter, half and all of the layers",
    )
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), help="default bfloat16 (float32 on --device cpu)")
    parser.add_argument("--eager", action="store_true", help="kernels launched one by one (no CUDA graphs)")
    parser.add_argument(
        "--recipe",
        help="a retraining recipe (recipes/*.yaml): each choice's retraining cost on --device (default: the "
        "recipe.yaml in MODEL's folder, where `ladder adapt` left one)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a recipe override, as `ladder adapt RECIPE KEY=VALUE` takes it (repeatable; e.g. trainable.mode=ladder)",
    )  # fmt: skip
    parser.add_argument(
        "--train-devices", type=int, help="devices the retraining runs on (default: --tp); needs --recipe"
    )
    parser.add_argument("--json", action="store_true", help="print the predictions as JSON")
    parser.add_argument("--calibrate", action="store_true", help="measure this machine's profile (no MODEL)")
    parser.add_argument(
        "--link", default="loopback",
        help="with --calibrate: loopback, or a rate such as 100mbit (loopback shaped by tc; needs root)",
    )  # fmt: skip
    parser.add_argument("--out", help="where --calibrate writes (default runs/plan/calibration-LINK.json)")
    args = parser.parse_args(argv)
    if not args.calibrate and args.model is None:
        raise UsageError(
            "name a MODEL (a checkpoint folder, a .gguf file, 'embedded' or a Hub ID), or pass --calibrate"
        )
    for name in ("tp", "prompt", "new", "train_devices"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if (args.link != "loopback" or args.out is not None) and not args.calibrate:
        raise UsageError("--link and --out go with --calibrate")
    args.batches = _positive_ints(args.batch, "--batch")
    return args


def _positive_ints(text: str, flag: str) -> list[int]:
    parts = text.split(",")
    if not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise UsageError(f"{flag} {text!r} must be positive integers, comma-separated")
    return [int(part) for part in parts]


# --- Reading the model's config and its measured damage --------------------------------------------


def read_model_config(model: str) -> tuple[dict, Path | None]:
    """config.json as a dict, and the folder it came from (None for a GGUF file): a local folder, a .gguf
    file or `embedded` (the config embedded in the GGUF), or a Hub ID whose config.json is already in the
    local Hugging Face cache (nothing is downloaded)."""
    path = Path(model).expanduser()
    if model == EMBEDDED or path.suffix == ".gguf":
        return _gguf_config(embedded_model_path() if model == EMBEDDED else path), None
    if not path.exists() and HUB_MODEL_ID.fullmatch(model):
        path = _cached_hub_folder(model)
    if not (path / "config.json").is_file():
        raise UsageError(f"{model} is not a folder with config.json, a .gguf file, 'embedded' or a cached Hub ID")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot read {path / 'config.json'}: {error}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path / 'config.json'} is not a JSON object")
    check_llama_model_type(config.get("model_type"), str(path / "config.json"))
    return config, path


def _cached_hub_folder(model_id: str) -> Path:
    from huggingface_hub import try_to_load_from_cache

    match = HUB_MODEL_ID.fullmatch(model_id)
    found = try_to_load_from_cache(match["repo"], "config.json", revision=match["revision"])
    if not isinstance(found, str):
        raise UsageError(
            f"{model_id}: its config.json is not in the local Hugging Face cache (`hf download {match['repo']} "
            "config.json` fetches just that file), and `ladder plan` downloads nothing"
        )
    return Path(found).parent


def _gguf_config(path: Path) -> dict:
    if not path.is_file():
        raise UsageError(f"GGUF file {path} does not exist")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"cannot read the config embedded in {path}: {str(error).splitlines()[0]}") from None
    check_llama_model_type(config.get("model_type"), str(path))
    return config


def recorded_damage(folder: Path | None) -> dict[tuple[int, ...], str]:
    """Layer set -> the damage measured for it: a conversion's own (conversion.json `damage`), and every
    candidate of a layer search (conversion.json or adapt's layer_search.json)."""
    found: dict[tuple[int, ...], str] = {}
    if folder is None:
        return found
    records = [_json_or_empty(folder / "conversion.json"), _json_or_empty(folder / "layer_search.json")]
    for record in records:
        search = record.get("layer_search") or (record if "candidates" in record else {})
        for candidate in search.get("candidates") or []:
            if isinstance(candidate, dict) and isinstance(candidate.get("layers"), list):
                found[tuple(candidate["layers"])] = f"KL {candidate.get('kl', float('nan')):.4f}"
    conversion = records[0]
    if isinstance(conversion.get("damage"), dict) and isinstance(conversion.get("ladder_layers"), list):
        damage = conversion["damage"]
        found[tuple(conversion["ladder_layers"])] = (
            f"KL {damage.get('mean_kl', float('nan')):.4f}, top-1 {damage.get('top1_agreement', float('nan')):.1%}"
        )
    return found


def _json_or_empty(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


# --- Layer choices -----------------------------------------------------------------------------------


def layer_choices(spec: str | None, num_layers: int) -> dict[str, list[int]]:
    """Label -> layers for each comma-separated choice; default: a quarter, half and all of the layers."""
    if spec is None:
        counts = sorted({max(1, num_layers // 4), max(1, num_layers // 2), num_layers})
        spec = ",".join(map(str, counts))
    choices = {}
    for part in (part.strip() for part in spec.split(",")):
        if part == "all":
            part = str(num_layers)
        auto = parse_auto_layers(part, num_layers, "--layers")
        if auto is not None:
            # Any contiguous window of N has the same speed; its damage differs (a layer search measures it).
            choices[str(auto)] = list(range(num_layers - auto.count, num_layers))
        elif re.fullmatch(r"\d+", part):
            layers = parse_ladder_layers(int(part), num_layers, "--layers")
            choices[f"upper {len(layers)}" if len(layers) < num_layers else f"all {num_layers}"] = layers
        else:
            layers = parse_ladder_layers(part.replace("+", ","), num_layers, "--layers")
            choices[format_layers(layers)] = layers
    return choices


# --- Output ------------------------------------------------------------------------------------------


def plan(args: argparse.Namespace, config: dict, folder: Path | None) -> dict:
    shape = ModelShape.from_config(config)
    if args.interconnect is None and args.device == "cpu":  # nvlink, the default, joins GPUs, not CPUs
        raise UsageError(
            "--device cpu needs --interconnect (BANDWIDTH,LATENCY_US), or plan from this machine's calibration: "
            "`ladder plan --calibrate`, then --device runs/plan/calibration-LINK.json"
        )
    # A calibration measured a device and a link together: one file names both.
    interconnect = args.interconnect or (args.device if args.device.endswith(".json") else "nvlink")
    device, link = device_profile(args.device), link_profile(interconnect)
    dtype = args.dtype or ("float32" if device.on_cpu else "bfloat16")
    graphs = not (args.eager or device.on_cpu)
    choices, damage = layer_choices(args.layers, shape.num_layers), recorded_damage(folder)
    recipe = args.recipe or adapted_recipe(folder)
    if (args.train_devices is not None or args.set) and recipe is None:
        raise UsageError("--train-devices and --set go with --recipe (or a MODEL folder with its recipe.yaml)")
    retraining = retraining_costs(args, recipe, shape, device, choices) if recipe else {}
    rows = []
    for batch in args.batches:
        setting = Setting(device, link, args.tp, batch, args.prompt, args.new, DTYPE_BYTES[dtype], graphs)
        for label, layers in choices.items():
            row = _row(label, batch, predict(shape, setting, layers), damage.get(tuple(layers)))
            rows.append(row | {"retraining": retraining.get(label)})
    return dict(
        model=args.model, shape=asdict(shape), tp=args.tp, device=asdict(device), interconnect=asdict(link),
        dtype=dtype, cuda_graphs=graphs, prompt=args.prompt, new_tokens=args.new, rows=rows, recipe=recipe,
    )  # fmt: skip


def adapted_recipe(folder: Path | None) -> str | None:
    """The recipe `ladder adapt` saved beside the model it wrote (adapt/train.py), if MODEL is one."""
    from ladder.adapt.recipe import RECIPE_FILE

    found = folder / RECIPE_FILE if folder is not None else None
    return str(found) if found is not None and found.is_file() and not found.is_symlink() else None


def retraining_costs(
    args: argparse.Namespace, recipe_path: str, shape: ModelShape, device: Device, choices: dict
) -> dict[str, dict]:
    """Choice -> the recipe's retraining plan for it (adapt/plan.py, what `ladder adapt RECIPE --plan`
    prints) on --train-devices devices of --device: under trainable.mode ladder only the chosen layers
    train, so fewer ladder layers cost less; under `all` every choice costs the same."""
    from ladder.adapt.plan import shape_plan
    from ladder.adapt.recipe import load_recipe

    recipe = load_recipe(recipe_path, args.set)
    devices = args.train_devices or args.tp
    if not (device.memory or device.on_cpu):
        raise UsageError(
            "--recipe needs the device's memory: --device FLOPS,BANDWIDTH,MEMORY (e.g. 989e12,3.35e12,80e9)"
        )
    # A CPU trains with every core: its measured matmul peak (shape_plan's default), not the one-core
    # decode rate a profile holds; its memory is this machine's RAM unless a calibration recorded it.
    flops = None if device.on_cpu else device.flops
    costs = {}
    for label, layers in choices.items():
        plan = shape_plan(recipe, shape, devices, device.memory or None, flops, not device.on_cpu, ladder_layers=layers)
        costs[label] = dict(
            recipe=recipe.name, tokens=recipe.budget, trainable=recipe.trainable.mode, devices=devices,
            device_hours=plan.device_hours, hours=plan.device_hours / devices,
            activation_checkpointing=plan.activation_checkpointing, peak_bytes_per_device=plan.peak_bytes_per_device,
            tokens_per_second=plan.tokens_per_second, utilisation=plan.utilisation,
            utilisation_source=plan.utilisation_source,
        )  # fmt: skip
    return costs


def _row(label: str, batch: int, prediction: Prediction, damage: str | None) -> dict:
    return dict(
        choice=label, layers=format_layers(prediction.layers), batch=batch,
        standard_ms_per_token=prediction.standard_ms, ladder_ms_per_token=prediction.ladder_ms,
        speedup=prediction.speedup, hidden_all_reduces=prediction.hidden, all_reduces=prediction.all_reduces,
        bound_ms_per_token=prediction.bound_ms, bound_speedup=prediction.bound_speedup,
        standard_prefill_ms=prediction.standard_prefill_ms, ladder_prefill_ms=prediction.ladder_prefill_ms,
        damage=damage,
    )  # fmt: skip


def render(result: dict) -> str:
    shape = result["shape"]
    lines = [
        f"{result['model']}: {shape['num_layers']} layers, hidden {shape['hidden_size']}, "
        f"{shape['num_heads']} heads / {shape['num_kv_heads']} KV; TP={result['tp']} on {result['device']['name']} "
        f"over {result['interconnect']['name']}, {result['dtype']}, prompt {result['prompt']} + {result['new_tokens']} "
        f"new tokens, {'CUDA graphs' if result['cuda_graphs'] else 'eager launches'} (predicted, not measured)",
        "",
        f"{'batch':>5}  {'ladder layers':<22} {'hidden':>9} {'standard':>10} {'ladder':>10} {'speed-up':>8} "
        f"{'bound':>6}  {'retraining   ' if result['recipe'] else ''}damage (measured)",
    ]
    unit = "CPU" if result["device"]["name"].startswith("cpu") else "GPU"
    for row in result["rows"]:
        name = row["choice"] if row["choice"] == row["layers"] else f"{row['choice']} ({row['layers']})"
        cost = row["retraining"]
        retraining = f"{cost['device_hours']:>7,.1f} {unit}-h  " if cost else ""
        lines.append(
            f"{row['batch']:>5}  {name:<22} {row['hidden_all_reduces']:>4}/{row['all_reduces']:<4} "
            f"{row['standard_ms_per_token']:>7.2f} ms {row['ladder_ms_per_token']:>7.2f} ms {row['speedup']:>7.2f}x "
            f"{row['bound_speedup']:>5.2f}x  {retraining}{row['damage'] or '-'}"
        )
    lines += [
        "",
        "standard / ladder: decode time per token (one step of the whole batch); hidden: all-reduces that run "
        "behind the next branch's compute; bound: speed-up with no communication at all. Profiles: "
        "ladder/plan/devices.tsv and links.tsv (sources cited there); model: docs/plan.md.",
    ]
    if result["recipe"]:
        lines.append(retraining_note([row["retraining"] for row in result["rows"]], result["device"]["name"]))
    return "\n".join(lines)


def retraining_note(costs: list[dict], device: str) -> str:
    cost, recompute = costs[0], sorted({cost["activation_checkpointing"] for cost in costs})
    return (
        f"retraining: device-hours of {cost['recipe']} ({cost['tokens']:.3g} tokens, trainable {cost['trainable']}) "
        f"on {cost['devices']} x {device} at {cost['utilisation']:.0%} utilisation ({cost['utilisation_source']}), "
        f"recompute {' or '.join(recompute)}; predicted, as `ladder adapt RECIPE --plan` prints it."
    )


def run_calibration(out: str, link_rate: str) -> None:
    from ladder.io.files import atomic_write
    from ladder.plan.calibrate import calibrate
    from ladder.plan.emulated_link import check_rate

    profile = calibrate(check_rate(link_rate))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(profile, indent=2) + "\n")
    device, link = profile["device"], profile["links"][0]
    print(
        f"this machine (2 ranks at once, 1 thread each, float32): memory {device['bandwidth'] / 1e9:.1f} GB/s, "
        f"matmul {device['flops'] / 1e9:.0f} GFLOP/s, {device['eager_kernel_us']:.1f} us per operator; gloo "
        f"all-reduce on {link['name']}: {link['base_us']:.0f} us + bytes / {link['bus_bandwidth'] / 1e9:.3g} GB/s "
        f"(of which {link['host_us']:.0f} us + {link['host_ns_per_byte']:.1f} ns/byte on the CPU); "
        f"load average {profile['machine']['load_average']:.2f}\n"
        f"written to {out}: use it as --device {out} (its link comes with it)"
    )


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.calibrate:
        run_calibration(args.out or f"runs/plan/calibration-{args.link}.json", args.link)
        return 0
    config, folder = read_model_config(args.model)
    result = plan(args, config, folder)
    result["model"] = model_name(folder) if folder is not None else Path(args.model).stem
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0
