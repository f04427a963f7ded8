"""`ladder plan`: the overlap rule against the TP runtime's own waits, the latency-bandwidth fit, the cost
arithmetic against transformers, and the command line (bad input, --json)."""

import json
import random
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaForCausalLM

from ladder.cli import main
from ladder.layers import overlapped_all_reduces
from ladder.model.config_rules import LADDER_MODEL_TYPES
from ladder.plan.calibrate import fit_latency_bandwidth
from ladder.plan.costs import ModelShape, forward_cost, parameter_counts
from ladder.plan.models import published_config
from ladder.plan.speed import KERNELS, Link, replay
from ladder.tp.shard import ModelShard, ShardShape
from tiny import NUM_LAYERS, random_ids, tiny_config

LLAMA_8B = published_config("meta-llama/Llama-3.1-8B")


def runtime_hidden_all_reduces(ladder_layers: list[int]) -> list[int]:
    """The TP runtime's own record: which all-reduces (2 per layer: attention, MLP) it waits on only after
    another branch has computed since their launch. Its `reduce` hook and its branches are observed."""
    config = tiny_config()
    shard = ModelShard(config).eval()
    shard.set_ladder_layers(ladder_layers)
    events = []

    class Observed:
        def __init__(self, index, pending):
            self.index, self.pending = index, pending

        def wait(self):
            events.append(("wait", self.index))
            return self.pending.wait()

    def observed_reduce(partial, async_op):
        index = sum(event[0] == "launch" for event in events)
        events.append(("launch", index))
        pending = Observed(index, runtime_reduce(partial, async_op))
        if not async_op:  # blocking: the runtime's call returns only once the sum is complete
            pending.wait()
        return pending

    runtime_reduce, shard.reduce = shard.reduce, observed_reduce
    for block in shard.layers:
        for branch in (block.attention, block.mlp):
            branch.register_forward_pre_hook(lambda *_: events.append(("compute", None)))
    shard.setup_cache(1, 8)
    with torch.inference_mode():
        shard(random_ids(1, 1, vocab_size=config.vocab_size), torch.tensor([0]))
    hidden, launched_at, waited = [], {}, set()
    for position, (kind, index) in enumerate(events):
        if kind == "launch":
            launched_at[index] = position
        elif kind == "wait" and index not in waited:  # the first wait is the one that blocks
            waited.add(index)
            if ("compute", None) in events[launched_at[index] : position]:
                hidden.append(index)
    return sorted(hidden)


@pytest.mark.parametrize(
    "ladder_layers", [[], list(range(NUM_LAYERS)), [3, 4, 5], [0], [2], [5], [0, 2, 3], [1, 2, 4, 5], [0, 1, 3, 5]]
)
def test_overlap_rule_matches_the_runtimes_waited_all_reduces(ladder_layers):
    flags = [layer in ladder_layers for layer in range(NUM_LAYERS)]
    timeline = replay(flags, attention_s=1.0, mlp_s=2.0, head_s=0.5, wire_s=0.5, host_s=0.0)
    assert sorted(timeline.hidden) == runtime_hidden_all_reduces(ladder_layers)
    assert len(timeline.hidden) == overlapped_all_reduces(ladder_layers)
    assert len(timeline.launched_at) == 2 * NUM_LAYERS


def test_replay_times_standard_ladder_and_bound():
    # Standard pays every all-reduce; all-ladder hides each behind the next branch (shorter here) but the
    # last; the bound pays none.
    flags = [True] * 4
    standard = replay([False] * 4, 1.0, 2.0, 0.5, wire_s=0.25, host_s=0.0)
    assert standard.seconds == pytest.approx(4 * 3.0 + 0.5 + 8 * 0.25)
    assert replay(flags, 1.0, 2.0, 0.5, wire_s=0.25, host_s=0.0).seconds == pytest.approx(4 * 3.0 + 0.5 + 0.25)
    assert replay(flags, 1.0, 2.0, 0.5, wire_s=-1, host_s=0.0).seconds == pytest.approx(4 * 3.0 + 0.5)
    # A link slower than the compute: ladder is bound by the link, which carries one all-reduce at a time.
    slow = replay(flags, 1.0, 2.0, 0.5, wire_s=5.0, host_s=0.0)
    assert slow.seconds >= 1.0 + 8 * 5.0 + 0.5


def test_a_shared_link_delays_the_first_of_two_all_reduces_in_flight():
    # All-ladder with a short attention branch: the MLP's all-reduce is still on the wire when the
    # next attention's is launched. Queued (NCCL), the one needed first finishes first; shared (gloo),
    # both progress at half speed, so the compute stream waits longer. Standard layers block on each
    # all-reduce, so two are never in flight and the disciplines agree.
    flags = [True] * 4
    serial = replay(flags, 0.5, 2.0, 0.0, wire_s=1.5, host_s=0.0)
    shared = replay(flags, 0.5, 2.0, 0.0, wire_s=1.5, host_s=0.0, shared_link=True)
    assert shared.seconds > serial.seconds > 4 * 2.5
    standard = [replay([False] * 4, 0.5, 2.0, 0.0, 1.5, 0.0, shared_link=shared) for shared in (False, True)]
    assert standard[0].seconds == standard[1].seconds == 4 * 2.5 + 8 * 1.5


def test_latency_bandwidth_fit_recovers_known_parameters():
    latency, bandwidth = 180e-6, 3.0e6  # a gloo all-reduce on a ~25 Mbit/s link
    sizes = [2048, 8192, 32768, 65536] * 5
    exact = [latency + size / bandwidth for size in sizes]
    assert fit_latency_bandwidth(sizes, exact) == pytest.approx((latency, bandwidth), rel=1e-9)
    noise = random.Random(0)
    noisy = [t * (1 + noise.gauss(0, 0.02)) for t in exact]
    fitted_latency, fitted_bandwidth = fit_latency_bandwidth(sizes, noisy)
    assert fitted_bandwidth == pytest.approx(bandwidth, rel=0.05)
    assert fitted_latency == pytest.approx(latency, abs=100e-6)
    link = Link("fitted", 1e6 * fitted_latency, 0.0, fitted_bandwidth, 0.0, 0.0)
    assert link.all_reduce_seconds(8192, ranks=2) == pytest.approx(latency + 8192 / bandwidth, rel=0.05)
    with pytest.raises(ValueError):
        fit_latency_bandwidth([4096, 4096], [1e-3, 1e-3])
    # The compute stream's part: fixed + per byte, never more than the whole all-reduce.
    slow = Link("100mbit", 70.0, 0.0, 6e6, host_us=200.0, host_ns_per_byte=30.0)
    assert slow.host_seconds(8192, ranks=2) == pytest.approx(200e-6 + 30e-9 * 8192)
    loopback = Link("loopback", 100.0, 0.0, 3e9, host_us=200.0, host_ns_per_byte=30.0)
    assert loopback.host_seconds(32768, ranks=2) == loopback.all_reduce_seconds(32768, ranks=2)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_counts_and_flops_match_transformers(tied):
    config = tiny_config(tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    shape = ModelShape.from_config(config.to_dict())
    assert parameter_counts(shape).total(shape.num_layers) == sum(p.numel() for p in model.parameters())
    # Every weight is read once per forward, and a matmul costs 2 FLOPs per weight per token.
    cost = forward_cost(shape, batch=1, query_tokens=1, context=1, tp=1, dtype_bytes=4)
    layer_weights = sum(p.numel() for p in model.model.layers.parameters())
    assert cost.num_layers * (cost.attention.weight_bytes + cost.mlp.weight_bytes) == 4 * layer_weights


def test_eager_operator_counts_are_the_runtimes():
    """speed.KERNELS['eager'] prices each CPU operator the runtime dispatches: count them for real."""

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    config = tiny_config()
    shard = ModelShard(config).eval()
    shard.setup_cache(1, 8)
    ids, position = random_ids(1, 1, vocab_size=config.vocab_size), torch.tensor([2])
    with torch.inference_mode(), Count():
        shard(ids, position)
    kernels = KERNELS["eager"]
    expected = NUM_LAYERS * (kernels["attention"] + kernels["mlp"]) + kernels["head"]
    assert Count.calls == pytest.approx(expected, rel=0.05)


# --- The command line ------------------------------------------------------------------------------


def conversion_folder(folder: Path, config: dict, layers: list[int], kl: float, top1: float) -> Path:
    """A folder holding `config` as config.json alone (no weights: the planner reads none), and a
    conversion's record of the damage of `layers`."""
    (folder / "config.json").write_text(json.dumps(config))
    damage = dict(mean_kl=kl, top1_agreement=top1)
    (folder / "conversion.json").write_text(json.dumps(dict(ladder_layers=layers, damage=damage)))
    return folder


@pytest.fixture
def llama_8b_folder(tmp_path):
    """Llama-3.1-8B's config.json, and the damage of its upper 16 layers."""
    return conversion_folder(tmp_path, LLAMA_8B, list(range(16, 32)), kl=0.1234, top1=0.8)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--tp", "0"], "argument --tp: '0' is not a positive integer"),
        (["--batch-size", "1,x"], "argument --batch-size: 'x' is not an integer"),
        (["--layers", "40"], "the model has 32 layers"),
        (["--layers", "auto:0"], "needs 1 <= N <= 32"),
        (["--hardware", "tpu9"], "--hardware 'tpu9' is not one of"),
        (["--hardware", "cpu"], "--hardware cpu needs --interconnect"),
        (["--hardware", "989e12,3.35e12,80GX"], "--hardware MEMORY '80GX' is not a size like"),
        (["--engine", "trt"], "argument --engine: invalid choice"),
        (["--interconnect", "carrier-pigeon"], "--interconnect 'carrier-pigeon' is not one of"),
        (["--interconnect", "/no/such.json"], "is not a calibration"),
        (["--tp", "two"], "'two' is not a positive integer"),
        (["--link", "100mbit"], "--link and --out go with --calibrate"),
    ],
)
def test_plan_refuses_bad_input_in_one_line(llama_8b_folder, capsys, arguments, message):
    assert main(["plan", str(llama_8b_folder), *arguments]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1
    assert captured.out == ""


@pytest.mark.parametrize(
    "model, message",
    [
        ("/no/such/folder", "is not a folder with config.json"),
        ("nobody/no-such-model", "not in the local Hugging Face cache"),
    ],
)
def test_plan_refuses_a_model_it_cannot_read(capsys, model, message):
    assert main(["plan", model]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1


def test_plan_json_shape_and_damage_beside_its_layers(llama_8b_folder, capsys):
    layers = [item for spec in ("8", "16", "32", "auto:4", "0-3,8-11") for item in ("--layers", spec)]
    arguments = ["plan", str(llama_8b_folder), "--tp", "8", "--batch-size", "1,64", *layers]
    arguments += ["--engine", "tp-runtime"]
    assert main([*arguments, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"model", "shape", "tp", "device", "interconnect", "dtype", "cuda_graphs", "rows"} <= set(result)
    assert result["shape"]["num_layers"] == 32 and result["device"]["name"] == "h100"
    rows = result["rows"]
    assert [(row["batch"], row["choice"]) for row in rows] == [
        (batch, choice) for batch in (1, 64) for choice in ("upper 8", "upper 16", "all 32", "auto:4", "0-3,8-11")
    ]
    for row in rows:
        assert row["all_reduces"] == 64
        assert row["speedup"] == pytest.approx(row["standard_ms_per_token"] / row["ladder_ms_per_token"])
        assert row["ladder_ms_per_token"] >= row["bound_ms_per_token"] > 0
    assert [row["hidden_all_reduces"] for row in rows[:5]] == [15, 31, 63, 7, 14]
    assert [row["damage"] for row in rows[:5]] == [None, "KL 0.1234, top-1 80.0%", None, None, None]
    # More ladder layers never slow decoding down.
    assert rows[0]["speedup"] <= rows[1]["speedup"] <= rows[2]["speedup"]


def test_plan_prints_a_table(llama_8b_folder, capsys):
    assert main(["plan", str(llama_8b_folder), "--interconnect", "pcie", "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "TP=8 on h100 over pcie" in out and "upper 8" in out and "all 32" in out and "predicted" in out


def test_plan_prices_each_choice_s_retraining_as_adapt_plan_does(llama_8b_folder, capsys):
    """--recipe: each choice's retraining is the recipe's `ladder adapt --plan` with that choice's layers
    (the CPU recipe trains only its ladder layers, so more of them cost more)."""
    recipe = "recipes/smollm2-135m-ladder-cpu.yaml"
    plan = ["plan", str(llama_8b_folder), "--tp", "2", "--batch-size", "1", "--layers", "8", "--layers", "32"]
    plan += ["--recipe", recipe, "--train-devices", "2"]
    assert main([*plan, "--json"]) == 0
    upper, every = (row["retraining"] for row in json.loads(capsys.readouterr().out)["rows"])
    adapt = ["adapt", recipe, f"model.path={llama_8b_folder}", "--plan", "--json", "--train-devices", "2"]
    assert main(adapt) == 0  # the recipe's own ladder_layers: the upper 8; both on h100 by default
    assert upper["device_hours"] == pytest.approx(json.loads(capsys.readouterr().out)["device_hours"], rel=1e-9)
    assert every["device_hours"] > upper["device_hours"] and every["devices"] == upper["devices"] == 2
    assert main(plan) == 0
    assert "GPU-h" in capsys.readouterr().out
    # A folder `ladder adapt` wrote carries its recipe.yaml: its cost shows without --recipe.
    (llama_8b_folder / "recipe.yaml").write_text(Path(recipe).read_text())
    assert main([*plan[: plan.index("--recipe")], "--train-devices", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["retraining"] == upper


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--train-devices", "4"], "--train-devices and key=value overrides go with --recipe"),
        (["--recipe", "recipes/smollm2-135m-ladder-cpu.yaml", "trainable.mode=most"], "trainable.mode"),
        (["--recipe", "recipes/nope.yaml"], "does not exist"),
        (["--recipe", "recipes/smollm2-135m-ladder-cpu.yaml", "--hardware", "1e12,1e12"], "memory of device 1e12"),
    ],
)
def test_plan_refuses_a_retraining_it_cannot_price(llama_8b_folder, capsys, arguments, message):
    assert main(["plan", str(llama_8b_folder), *arguments]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1


def test_calibration_measures_this_machine_and_plans_from_it(tmp_path, capsys):
    """`ladder plan --calibrate`: two gloo ranks (torchrun) measure the device and the loopback link; the
    file it writes is a --hardware and an --interconnect."""
    out = tmp_path / "calibration.json"
    assert main(["plan", "--calibrate", "--out", str(out)]) == 0
    assert f"written to {out}" in capsys.readouterr().out
    profile = json.loads(out.read_text())
    device, link = profile["device"], profile["links"][0]
    assert device["bandwidth"] > 1e8 and device["flops"] > 1e8 and device["memory"] > 1e9
    assert link["name"] == "loopback" and link["bus_bandwidth"] > 0 and link["host_us"] >= 0
    assert main(["plan", "embedded", "--tp", "2", "--engine", "tp-runtime", "--hardware", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"]["name"] == "cpu (measured)" and result["dtype"] == "float32"
    assert result["interconnect"]["name"] == "loopback"  # the calibration's own link
    assert all(row["standard_ms_per_token"] > 0 for row in result["rows"])


# --- Engines, TP degrees, the model's own layers, models named without a download -----------------

SMOLLM2 = published_config("HuggingFaceTB/SmolLM2-135M")


@pytest.fixture
def smollm2_ladder8_folder(tmp_path):
    """SmolLM2-135M's shape (9 heads, 3 KV heads) as a conversion with its upper 8 layers ladder wrote it:
    config.json with ladder_layers, and the damage it measured."""
    config = SMOLLM2 | dict(model_type=LADDER_MODEL_TYPES["llama"], ladder_layers=list(range(22, 30)))
    return conversion_folder(tmp_path, config, list(range(22, 30)), kl=0.4321, top1=0.7)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--tp", "16"], "--tp 16: vLLM refuses this model: its 9 attention heads are not divisible by TP=16"),
        (["--tp", "16", "--engine", "tp-runtime"], "the TP runtime refuses this model: TP=16 needs at least one KV"),
        (["--tp", "1000000000"], "vLLM refuses this model"),
        (
            [],
            "--tp 8: vLLM refuses this model: its 9 attention heads are not divisible by TP=8; vLLM runs it at TP=1, 3, 9",
        ),
        (["--tp", "2"], "not divisible by TP=2; the TP runtime runs it (--engine tp-runtime)"),
        (["--tp", "9", "--engine", "tp-runtime"], "the model has 3; vLLM runs it (--engine vllm)"),
    ],
)
def test_plan_refuses_the_tp_degrees_its_engine_refuses(smollm2_ladder8_folder, capsys, arguments, message):
    """Issue 37 item 7: --tp 16 on 3 KV heads printed 1.20-1.40x, and --tp 1000000000 absurd times."""
    assert main(["plan", str(smollm2_ladder8_folder), *arguments]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1
    assert captured.out == ""


def test_plan_marks_each_tp_degree_an_engine_refuses_with_the_engines_own_rule(smollm2_ladder8_folder, capsys):
    """Issue 38 item 4: TP=2 for 9 heads and TP=4 for 3 KV heads are marked, with the engine and why; the
    TP runtime's verdicts are its own shard's (ShardShape.of raises exactly where the plan says it refuses)."""
    assert main(["plan", str(smollm2_ladder8_folder), "--tp", "3", "--batch-size", "1", "--json"]) == 0
    degrees = {entry["tp"]: entry["refused"] for entry in json.loads(capsys.readouterr().out)["tp_degrees"]}
    assert {1, 2, 3, 4, 8, 9, 16} <= set(degrees)
    assert "9 attention heads are not divisible by TP=2" in degrees[2]["vllm"] and degrees[2]["tp-runtime"] is None
    assert degrees[3] == {"vllm": None, "tp-runtime": None}
    assert "needs at least one KV head per rank" in degrees[4]["tp-runtime"] and degrees[4]["vllm"]
    assert degrees[9]["vllm"] is None and degrees[9]["tp-runtime"]  # vLLM replicates a KV head over 3 ranks
    config = tiny_config(num_attention_heads=SMOLLM2["num_attention_heads"], num_key_value_heads=3, hidden_size=72)
    for tp, refused in degrees.items():
        if refused["tp-runtime"] is None:
            ShardShape.of(config, 0, tp)
        else:
            with pytest.raises(ValueError, match="needs at least one KV head per rank"):
                ShardShape.of(config, 0, tp)
    assert main(["plan", str(smollm2_ladder8_folder), "--tp", "3", "--batch-size", "1"]) == 0
    table = capsys.readouterr().out
    assert "TP=2   vllm refuses: its 9 attention heads are not divisible by TP=2; tp-runtime runs it" in table


def test_plan_prices_what_each_engine_overlaps(llama_8b_folder, capsys):
    """Issue 36 item 3: the TP runtime hides both of a ladder layer's all-reduces; vLLM
    (ladder/serving/model.py) the attention output's, and the MLP output's only in a decode step that
    runs as one full CUDA graph (not in prefill, nor with piecewise graphs or none); on a CPU none. The
    plan says which engine it predicts for."""
    plan = [
        "plan",
        str(llama_8b_folder),
        "--tp",
        "8",
        "--batch-size",
        "1",
        "--layers",
        "16",
        "--layers",
        "32",
        "--json",
    ]

    def rows(*arguments: str) -> list[dict]:
        assert main([*plan, *arguments]) == 0
        return json.loads(capsys.readouterr().out)["rows"]

    runtime, vllm, piecewise = rows("--engine", "tp-runtime"), rows("--engine", "vllm"), rows("--piecewise")
    for each in (runtime, vllm):
        assert [row["hidden_all_reduces"] for row in each] == [31, 63]
    assert [row["hidden_all_reduces"] for row in piecewise] == [16, 32]
    assert [row["hidden_all_reduces"] for row in rows("--eager")] == [16, 32]
    for ours, full, theirs in zip(piecewise, vllm, runtime):
        assert ours["standard_ms_per_token"] == pytest.approx(theirs["standard_ms_per_token"])
        assert 1 < ours["speedup"] < full["speedup"] == pytest.approx(theirs["speedup"])
        # vLLM's prefill is never one full graph: only the attention output's all-reduce is hidden there.
        assert full["ladder_prefill_ms"] > theirs["ladder_prefill_ms"]
    assert main(plan) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["engine"] == "vllm" and result["overlapped"] == {
        "vllm": ["attention", "mlp"],
        "tp-runtime": ["attention", "mlp"],
    }
    cpu = rows("--hardware", "cpu", "--interconnect", "1e9,50")
    assert all(row["hidden_all_reduces"] == 0 for row in cpu)
    assert main([*plan[:-1], "--engine", "tp-runtime"]) == 0
    assert "engine: the TP runtime (--engine tp-runtime)" in capsys.readouterr().out
    assert main([*plan, "--piecewise", "--engine", "tp-runtime"]) == 2
    assert "--piecewise is a mode of vLLM's CUDA graphs" in capsys.readouterr().err


def test_plan_default_rows_include_the_checkpoint_s_own_layers_with_their_damage(smollm2_ladder8_folder, capsys):
    """Issue 38 item 4: a conversion with its upper 8 layers showed upper 7, 15 and all 30, damage empty."""
    arguments = ["plan", str(smollm2_ladder8_folder), "--tp", "3", "--batch-size", "1", "--json"]
    assert main(arguments) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [row["choice"] for row in rows] == ["upper 8 (its own)", "upper 7", "upper 15", "all 30"]
    assert rows[0]["layers"] == "22-29" and rows[0]["damage"] == "KL 0.4321, top-1 70.0%"
    assert main([*arguments, "--layers", "15"]) == 0  # chosen layers are what was asked for
    assert [row["choice"] for row in json.loads(capsys.readouterr().out)["rows"]] == ["upper 15"]


def test_plan_reads_a_config_json_and_a_recipe(llama_8b_folder, tmp_path, capsys):
    """Issue 38 item 3: a config.json path and a recipe (its model.path, a Hub ID not downloaded) plan too; a
    recipe also prices each choice's retraining."""
    assert main(["plan", str(llama_8b_folder / "config.json"), "--batch-size", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shape"]["num_layers"] == 32
    recipe = tmp_path / "recipe.yaml"
    text = Path("recipes/smollm2-135m-ladder-cpu.yaml").read_text()
    recipe.write_text(text.replace("path: embedded", "path: meta-llama/Llama-3.2-1B-Instruct", 1))
    assert main(["plan", str(recipe), "--batch-size", "1", "--hardware", "h100", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["shape"]["num_layers"] == 16 and result["recipe"] == str(recipe)
    assert all(row["retraining"]["device_hours"] > 0 for row in result["rows"])
