"""`ladder plan MODEL --tp T ...`: before converting, what ladder wiring would buy under tensor
parallelism on the given hardware with the given engine (vLLM or the TP runtime), predicted by
ladder/plan/speed.py from the model's config alone (no weights are read, nothing is downloaded).
`ladder plan --calibrate` measures this machine's profile instead.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from ladder.cli_types import comma_list, int_in, positive_int
from ladder.errors import ArgumentParser, UsageError
from ladder.io.loading import EMBEDDED, model_name
from ladder.layers import AutoLayers, format_layers, parse_layer_choice
from ladder.plan.costs import ModelShape, forward_cost
from ladder.plan.models import ModelConfig, model_config, own_ladder_layers
from ladder.plan.speed import (
    DEFAULT_HARDWARE,
    TRAIN_DEVICES,
    Device,
    Prediction,
    Setting,
    device_names,
    device_profile,
    link_names,
    link_profile,
    overlapped_reductions,
    predict,
)
from ladder.serving.engine import VLLM_GPU_MEMORY_UTILIZATION
from ladder.tp.degrees import ENGINES

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
RECIPE_SUFFIXES = (".yaml", ".yml")
LISTED_DEGREES = (1, 2, 4, 8, 16)
# The decode setting's bounds: past any model's context and any server's batch a number is a typo.
TOKENS, BATCH = int_in(1, 1 << 24), int_in(1, 1 << 20)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = ArgumentParser(prog="ladder plan", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "model", nargs="?",
        help="a checkpoint folder, its config.json, a .gguf file, 'embedded', a Hub ID (its config.json in the "
        "local cache, or a published shape: ladder/plan/models.tsv), or a recipe (its model.path)",
    )  # fmt: skip
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value",
        help="recipe overrides, as `ladder adapt RECIPE key=value` takes them (e.g. trainable.mode=ladder)",
    )  # fmt: skip
    parser.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel degree (default 8)")
    parser.add_argument(
        "--engine", choices=tuple(ENGINES), default="vllm",
        help="what runs the model: vllm (`ladder serve`: hides a ladder layer's attention all-reduce, and its "
        "MLP's in full-CUDA-graph decode steps; on a CPU neither) or tp-runtime (ladder/tp: both) (default vllm)",
    )  # fmt: skip
    parser.add_argument(
        "--interconnect",
        help=f"{', '.join(link_names())}, BANDWIDTH,LATENCY_US (bus bytes/s, us), or a --calibrate .json "
        "(default: the --hardware calibration's link, else nvlink; --hardware cpu needs one)",
    )  # fmt: skip
    parser.add_argument(
        "--hardware", default=DEFAULT_HARDWARE,
        help=f"{', '.join(device_names())}, FLOPS,BANDWIDTH[,MEMORY] (per second; a size such as 80GB), or a "
        f"--calibrate .json (default {DEFAULT_HARDWARE}, as `ladder adapt --plan`)",
    )  # fmt: skip
    parser.add_argument(
        "--batch-size",
        type=comma_list(BATCH),
        default=[1, 16, 64],
        help="batch sizes, comma-separated (default 1,16,64)",
    )
    parser.add_argument("--prompt", type=TOKENS, default=1024, help="prompt tokens (default 1024)")
    parser.add_argument("--new", type=TOKENS, default=512, help="new tokens (default 512)")
    parser.add_argument(
        "--layers", action="append",
        help="ladder layers, as `ladder convert --layers` takes them: N (the upper N), a range 16-31, a list 3,5,7 "
        "or auto:N (a contiguous window of N); repeated for several choices (default: a quarter, half and all)",
    )  # fmt: skip
    parser.add_argument("--dtype", choices=tuple(DTYPE_BYTES), help="default bfloat16 (float32 on --hardware cpu)")
    parser.add_argument("--eager", action="store_true", help="kernels launched one by one (no CUDA graphs)")
    parser.add_argument(
        "--piecewise", action="store_true",
        help="vLLM's CUDA graphs are piecewise only (cudagraph_mode PIECEWISE, or an attention backend without "
        "full graphs): a ladder layer's MLP all-reduce then blocks in decode too",
    )  # fmt: skip
    parser.add_argument(
        "--recipe",
        help="a retraining recipe (recipes/*.yaml): each choice's retraining cost on --hardware (default: MODEL "
        "when it is a recipe, or the recipe.yaml in MODEL's folder, where `ladder adapt` left one)",
    )
    parser.add_argument(
        "--train-devices",
        type=TRAIN_DEVICES,
        help="devices the retraining runs on (default 1, as `ladder adapt --plan`)",
    )
    parser.add_argument("--json", action="store_true", help="print the predictions as JSON")
    parser.add_argument("--calibrate", action="store_true", help="measure this machine's profile (no MODEL)")
    parser.add_argument(
        "--link", default="loopback",
        help="with --calibrate: loopback, or a rate such as 100mbit (loopback shaped by tc; needs root)",
    )  # fmt: skip
    parser.add_argument("--out", help="where --calibrate writes (default runs/plan/calibration-LINK.json)")
    args = parser.parse_intermixed_args(argv)
    if not args.calibrate and args.model is None:
        raise UsageError(
            "name a MODEL (a checkpoint folder, a config.json, a .gguf file, 'embedded', a Hub ID or a recipe), "
            "or pass --calibrate"
        )
    if (args.link != "loopback" or args.out is not None) and not args.calibrate:
        raise UsageError("--link and --out go with --calibrate")
    if args.piecewise and (args.engine != "vllm" or args.eager):
        raise UsageError("--piecewise is a mode of vLLM's CUDA graphs: it goes with --engine vllm, without --eager")
    return args


def read_model(args: argparse.Namespace) -> tuple[ModelConfig, list[int]]:
    """The model MODEL names and its ladder layers: a checkpoint's own, or a recipe's. Unless --recipe
    names another, MODEL's recipe, or the recipe.yaml `ladder adapt` left in its folder, prices the retraining."""
    from ladder.adapt.recipe import RECIPE_FILE, load_recipe, model_path

    if Path(args.model).suffix not in RECIPE_SUFFIXES:
        model = model_config(args.model)
        found = model.folder / RECIPE_FILE if model.folder is not None else None
        if found is not None and found.is_file() and not found.is_symlink():
            args.recipe = args.recipe or str(found)
        return model, own_ladder_layers(model.config)
    recipe = load_recipe(args.model, args.overrides)
    args.recipe = args.recipe or args.model
    model = model_config(model_path(recipe.model.path) or EMBEDDED)
    layers, chosen = own_ladder_layers(model.config), recipe.model.ladder_layers
    num_layers = ModelShape.from_config(model.config).num_layers
    if not layers and chosen is not None:
        choice = parse_layer_choice(chosen, num_layers, "model.ladder_layers")
        layers = [] if isinstance(choice, AutoLayers) else choice
    return model, layers


def recorded_damage(folder: Path) -> dict[tuple[int, ...], str]:
    """Layer set -> its measured damage: a conversion's own, and each layer-search candidate's."""
    found: dict[tuple[int, ...], str] = {}
    records = []
    for name in ("conversion.json", "layer_search.json"):
        try:
            record = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            record = {}
        records.append(record if isinstance(record, dict) else {})
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


def layer_choices(specs: list[str] | None, num_layers: int, own: list[int] | None = None) -> dict[str, list[int]]:
    """Label -> layers for each --layers spec; default: `own` (when there are some), then a quarter,
    half and all of the layers."""
    default = specs is None
    if default:
        specs = [str(count) for count in sorted({max(1, num_layers // 4), max(1, num_layers // 2), num_layers})]
    choices = {}
    for spec in specs:
        choice = parse_layer_choice(spec, num_layers, "--layers")
        if isinstance(choice, AutoLayers):
            # Any contiguous window of N has the same speed; its damage differs (a layer search measures it).
            choices[str(choice)] = list(range(num_layers - choice.count, num_layers))
        else:
            choices[_label(choice, num_layers)] = choice
    if not (default and own):
        return choices
    label = next((label for label, layers in choices.items() if layers == own), _label(own, num_layers))
    return {f"{label} (its own)": own} | {label: layers for label, layers in choices.items() if layers != own}


def _label(layers: list[int], num_layers: int) -> str:
    """`upper 8`, `all 32`, or the layers themselves (`3-5,9`)."""
    if layers != list(range(num_layers - len(layers), num_layers)):
        return format_layers(layers)
    return f"all {num_layers}" if len(layers) == num_layers else f"upper {len(layers)}"


def plan(args: argparse.Namespace, model: ModelConfig, own_layers: list[int]) -> dict:
    shape = ModelShape.from_config(model.config)
    degrees = tp_degrees(shape, args.tp)
    if problem := degrees[args.tp][args.engine]:
        runs = [engine for engine, refused in degrees[args.tp].items() if refused is None]
        other = f"; {ENGINES[runs[0]][0]} runs it (--engine {runs[0]})" if runs else ""
        fits = ", ".join(str(tp) for tp, refused in degrees.items() if refused[args.engine] is None)
        raise UsageError(
            f"--tp {args.tp}: {ENGINES[args.engine][0]} refuses this model: {problem}{other}; "
            f"{ENGINES[args.engine][0]} runs it at TP={fits}"
        )
    device = device_profile(args.hardware)
    if args.interconnect is None and device.on_cpu and not args.hardware.endswith(".json"):
        raise UsageError(  # nvlink, the default, joins GPUs, not CPUs
            "--hardware cpu needs --interconnect (BANDWIDTH,LATENCY_US), or plan from this machine's calibration: "
            "`ladder plan --calibrate`, then --hardware runs/plan/calibration-LINK.json"
        )
    # A calibration measured a device and a link together: one file names both.
    link = link_profile(args.interconnect or (args.hardware if args.hardware.endswith(".json") else "nvlink"))
    dtype = args.dtype or ("float32" if device.on_cpu else "bfloat16")
    graphs = not (args.eager or device.on_cpu)
    full_graph = graphs and not args.piecewise  # how a decode step runs (vLLM: a uniform batch, one graph)
    choices = layer_choices(args.layers, shape.num_layers, own_layers)
    damage = recorded_damage(model.folder) if model.folder is not None else {}
    if (args.train_devices is not None or args.overrides) and args.recipe is None:
        raise UsageError(
            "--train-devices and key=value overrides go with --recipe (or a MODEL folder with its recipe.yaml)"
        )
    retraining = retraining_costs(args, shape, device, choices) if args.recipe else {}
    memory = memory_fit(shape, args, DTYPE_BYTES[dtype], device, degrees)
    rows = []
    for batch in args.batch_size:
        setting = Setting(
            device, link, args.tp, batch, args.prompt, args.new, DTYPE_BYTES[dtype], graphs, args.engine, args.piecewise
        )
        for label, layers in choices.items():
            row = _row(label, batch, predict(shape, setting, layers), damage.get(tuple(layers)))
            rows.append(row | {"retraining": retraining.get(label)})
    return dict(
        model=args.model, shape=asdict(shape), tp=args.tp, engine=args.engine,
        overlapped={engine: list(overlapped_reductions(engine, device, full_graph)) for engine in ENGINES},
        piecewise=args.piecewise, device=asdict(device),
        interconnect=asdict(link), dtype=dtype, cuda_graphs=graphs, prompt=args.prompt, new_tokens=args.new,
        memory=memory, fits=memory["fits"], rows=rows, recipe=args.recipe,
        tp_degrees=[dict(tp=tp, refused=refused) for tp, refused in degrees.items()],
    )  # fmt: skip


def memory_fit(shape: ModelShape, args: argparse.Namespace, dtype_bytes: int, device: Device, degrees: dict) -> dict:
    """Whether weights and KV cache fit each device at every batch; when not, the smallest TP degree
    and the largest batch that do."""
    from ladder.plan.calibrate import machine_memory

    usable = VLLM_GPU_MEMORY_UTILIZATION * (device.memory or machine_memory())
    embedding = 0 if shape.tied_embeddings else dtype_bytes * shape.vocab_size * shape.hidden_size

    def per_device(tp: int, batch: int) -> float:
        return forward_cost(shape, batch, 1, args.prompt + args.new, tp, dtype_bytes).bytes + embedding

    needed = {batch: per_device(args.tp, batch) for batch in args.batch_size}
    fits, fits_with = max(needed.values()) <= usable, {}
    if not fits:
        runs = [tp for tp, refused in degrees.items() if refused[args.engine] is None and tp > args.tp]
        fits_with["tp"] = next((tp for tp in runs if per_device(tp, max(args.batch_size)) <= usable), None)
        weights, sequence = per_device(args.tp, 0), per_device(args.tp, 1) - per_device(args.tp, 0)
        fits_with["batch_size"] = int((usable - weights) // sequence) if usable > weights + sequence else None
    return dict(bytes_per_device=needed, usable_bytes=usable, fits=fits, fits_with=fits_with or None)


def tp_degrees(shape: ModelShape, tp: int) -> dict[int, dict[str, str | None]]:
    """TP degree -> engine -> why it refuses the model (None: it runs it), for --tp, LISTED_DEGREES
    and the divisors of the head counts up to 16."""
    heads, kv_heads = shape.num_heads, shape.num_kv_heads
    divisors = {d for d in range(1, 17) if heads % d == 0 or kv_heads % d == 0}
    return {
        degree: {engine: refusal(heads, kv_heads, degree) for engine, (_, refusal) in ENGINES.items()}
        for degree in sorted({tp, *LISTED_DEGREES, *divisors})
    }


def retraining_costs(args: argparse.Namespace, shape: ModelShape, device: Device, choices: dict) -> dict[str, dict]:
    """Choice -> the recipe's retraining cost with its layers, as `ladder adapt RECIPE --plan` prices it."""
    from ladder.adapt.recipe import load_recipe
    from ladder.adapt.training_cost import recipe_cost

    recipe = load_recipe(args.recipe, args.overrides)
    devices = args.train_devices or 1
    costs = {}
    for label, layers in choices.items():
        cost = recipe_cost(recipe, device, devices, shape=shape, ladder_layers=layers)
        costs[label] = asdict(cost) | dict(
            recipe=recipe.name, tokens=recipe.budget, trainable=recipe.trainable.mode, hours=cost.device_hours / devices
        )
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
    shape, engine = result["shape"], result["engine"]
    lines = [
        f"{result['model']}: {shape['num_layers']} layers, hidden {shape['hidden_size']}, "
        f"{shape['num_heads']} heads / {shape['num_kv_heads']} KV; TP={result['tp']} on {result['device']['name']} "
        f"over {result['interconnect']['name']}, {result['dtype']}, prompt {result['prompt']} + {result['new_tokens']} "
        f"new tokens, {'CUDA graphs' if result['cuda_graphs'] else 'eager launches'} (predicted, not measured)",
        memory_note(result["memory"], result["tp"]),
        f"engine: {ENGINES[engine][0]} (--engine {engine}): {_overlap(result['overlapped'][engine], engine)}; "
        + "; ".join(f"{ENGINES[e][0]}: {_overlap(o, e)}" for e, o in result["overlapped"].items() if e != engine),
        "TP degrees each engine runs (ladder/tp/degrees.py):",
        *(_degree(entry) for entry in result["tp_degrees"]),
        "",
        f"{'batch':>5}  {'ladder layers':<30} {'hidden':>9} {'standard':>10} {'ladder':>10} {'speed-up':>8} "
        f"{'bound':>6}  {'retraining   ' if result['recipe'] else ''}damage (measured)",
    ]
    unit = "CPU" if result["device"]["name"].startswith("cpu") else "GPU"
    for row in result["rows"]:
        name = row["choice"] if row["choice"] == row["layers"] else f"{row['choice']} ({row['layers']})"
        cost = row["retraining"]
        retraining = f"{cost['device_hours']:>7,.1f} {unit}-h{' ' if cost['fits'] else '*'} " if cost else ""
        lines.append(
            f"{row['batch']:>5}  {name:<30} {row['hidden_all_reduces']:>4}/{row['all_reduces']:<4} "
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


def memory_note(memory: dict, tp: int) -> str:
    needed, gib = memory["bytes_per_device"], 2**30
    line = f"memory per device (weights + KV cache): {_span([value / gib for value in needed.values()])} GiB of {memory['usable_bytes'] / gib:.1f} GiB usable ({VLLM_GPU_MEMORY_UTILIZATION:.0%}, vLLM's gpu_memory_utilization): "
    if memory["fits"]:
        return line + "fits"
    options = [f"--{key.replace('_', '-')} {value}" for key, value in memory["fits_with"].items() if value]
    return line + f"does NOT fit at TP={tp}; the smallest setting that fits: {' or '.join(options) or 'none listed'}"


def _span(values: list[float]) -> str:
    return f"{min(values):,.1f}" + (f" to {max(values):,.1f}" if max(values) > min(values) else "")


def _overlap(overlapped: list[str], engine: str) -> str:
    text = {
        2: "a ladder layer's attention and MLP all-reduces both run behind compute",
        1: "a ladder layer's attention all-reduce runs behind its MLP, its MLP all-reduce blocks",
        0: "every all-reduce blocks (nothing overlaps)",
    }[len(overlapped)]
    if len(overlapped) == 2 and engine == "vllm":
        text += " in decode, one full CUDA graph per step (prefill: the attention's only)"
    return text


def _degree(entry: dict) -> str:
    verdicts = [f"{engine} {'refuses: ' + why if why else 'runs it'}" for engine, why in entry["refused"].items()]
    return f"  TP={entry['tp']:<3} " + "; ".join(verdicts)


def retraining_note(costs: list[dict], device: str) -> str:
    from ladder.adapt.training_cost import ANCHOR_SOURCE, smallest_setting

    cost, recompute = costs[0], sorted({cost["activation_checkpointing"] for cost in costs})
    anchor = [cost["anchor_device_hours"] for cost in costs]
    unfit = [cost["fits_with"] for cost in costs if not cost["fits"]]
    note = (
        f"retraining: device-hours of {cost['recipe']} ({cost['tokens']:.3g} tokens, trainable {cost['trainable']}) "
        f"on {cost['devices']} x {device} at {cost['utilisation']:.0%} utilisation ({cost['utilisation_source']}): "
        f"MFU {cost['mfu']:.1%}; at the measured anchor's MFU {cost['anchor_mfu']:.1%} ({ANCHOR_SOURCE}): "
        f"{_span(anchor)} device-hours; recompute {' or '.join(recompute)}; predicted, as `ladder adapt "
        "RECIPE --plan` prints it."
    )
    if unfit:
        worst = None if None in unfit else max(unfit, key=lambda found: found["train_devices"])
        note += f" *: does not fit; the smallest setting that fits every choice: {smallest_setting(worst)}"
    return note


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.calibrate:
        from ladder.io.files import atomic_write
        from ladder.io.outputs import check_output
        from ladder.plan.calibrate import calibrate
        from ladder.plan.emulated_link import check_rate

        # The output rule before minutes of measuring; a profile there is replaced, as a new measurement should.
        out = check_output(args.out or f"runs/plan/calibration-{args.link}.json", "plan", kind="file", force=True)
        profile = calibrate(check_rate(args.link))
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, json.dumps(profile, indent=2) + "\n")
        device, link = profile["device"], profile["links"][0]
        print(
            f"this machine (2 ranks at once, 1 thread each, float32): memory {device['bandwidth'] / 1e9:.1f} GB/s, "
            f"matmul {device['flops'] / 1e9:.0f} GFLOP/s, {device['eager_kernel_us']:.1f} us per operator; gloo "
            f"all-reduce on {link['name']}: {link['base_us']:.0f} us + bytes / {link['bus_bandwidth'] / 1e9:.3g} GB/s "
            f"(of which {link['host_us']:.0f} us + {link['host_ns_per_byte']:.1f} ns/byte on the CPU); "
            f"load average {profile['machine']['load_average']:.2f}\n"
            f"written to {out}: use it as --hardware {out} (its link comes with it)"
        )
        return 0
    model, own_layers = read_model(args)
    result = plan(args, model, own_layers)
    if model.folder is not None:
        result["model"] = model_name(model.folder)
    else:  # a GGUF file, or a published shape
        result["model"] = Path(model.source).stem if model.source.endswith(".gguf") else model.source.split()[0]
    try:
        print(json.dumps(result, indent=2) if args.json else render(result), flush=True)
    except BrokenPipeError:  # `ladder plan ... | head -1`: the reader has gone, as `yes | head` ends
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return 128 + signal.SIGPIPE
    return 0
