"""The tensor-parallel runtime against single-process transformers: TP=2 over a real gloo process group
on CPU (two spawned ranks), TP=1 in process, and the speed benchmark's command line."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from ladder import to_ladder
from ladder.errors import UsageError
from ladder.plan.emulated_link import check_rate
from ladder.tp.runtime import generate, init_distributed, install_communication, load_shard, read_config
from ladder.tp.shard import ModelShard
from tiny import random_ids, tiny_llama

REPO = Path(__file__).resolve().parents[1]
BATCH, PROMPT, NEW = 2, 10, 6
SPLIT = 7  # prefill 7 prompt tokens, then feed the other 3 one at a time through the KV cache
LADDER_LAYERS = [0, 2, 3]  # ladder first, ladder -> standard, standard -> ladder, ladder -> ladder


def sharded_outputs(shard, ids):
    """Logits at every prompt position (prefill, then incremental decoding) and greedy tokens."""
    shard.setup_cache(BATCH, PROMPT + NEW)
    with torch.inference_mode():
        logits = [shard(ids[:, :SPLIT], torch.arange(SPLIT))]
        logits += [shard(ids[:, i : i + 1], torch.tensor([i])) for i in range(SPLIT, PROMPT)]
    return torch.cat(logits, dim=1), generate(shard, ids, NEW)


def reference_outputs(path, ids):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)[:, PROMPT:]
    assert tokens.shape == (BATCH, NEW)
    layer_weights = sum(p.numel() for n, p in model.model.layers.named_parameters() if "norm" not in n)
    return logits, tokens, layer_weights


def _rank(rank, world_size, port, checkpoints, ids, out_dir):
    """One TP rank, set up exactly as torchrun would set it up (environment variables, gloo)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    rank, tp_size, _ = init_distributed(cuda=False)
    results = {}
    for name, path in checkpoints.items():
        shard = load_shard(path, rank, tp_size)
        install_communication(shard)
        logits, tokens = sharded_outputs(shard, ids)
        install_communication(shard, "none")
        bound_logits, _ = sharded_outputs(shard, ids)
        layer_weights = sum(p.numel() for n, p in shard.layers.named_parameters() if "norm" not in n)
        results[name] = dict(logits=logits, tokens=tokens, bound_logits=bound_logits, layer_weights=layer_weights)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def tp2_ranks(checkpoints: dict, ids: torch.Tensor, out_dir: Path) -> list[dict]:
    """`_rank`'s results for every checkpoint from one launch of 2 spawned ranks over gloo."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_rank, args=(2, port, checkpoints, ids, out_dir), nprocs=2, join=True)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(2)]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    """A standard checkpoint, its ladder copy with mixed layers, and a SmolLM2-like one whose 3 KV
    heads split unevenly over 2 ranks (tied embeddings, odd intermediate size, upper-2 ladder)."""
    root = tmp_path_factory.mktemp("tp-checkpoints")
    standard = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    to_ladder(standard, LADDER_LAYERS).save_pretrained(root / "ladder")
    uneven = tiny_llama(
        hidden_size=96,
        intermediate_size=129,
        num_attention_heads=6,
        num_key_value_heads=3,
        num_hidden_layers=3,
        tie_word_embeddings=True,
    )
    to_ladder(uneven, 2).save_pretrained(root / "uneven")
    return {"standard": tiny_checkpoint, "ladder": root / "ladder", "uneven": root / "uneven"}


@pytest.fixture(scope="module")
def tp2_results(checkpoints, tmp_path_factory):
    ids = random_ids(BATCH, PROMPT, vocab_size=256)
    ranks = tp2_ranks(checkpoints, ids, tmp_path_factory.mktemp("tp2"))
    references = {name: reference_outputs(path, ids) for name, path in checkpoints.items()}
    return ranks, references


@pytest.mark.parametrize("name", ["standard", "ladder", "uneven"])
def test_tp2_logits_and_greedy_tokens_match_transformers(tp2_results, name):
    ranks, references = tp2_results
    logits, tokens, _ = references[name]
    for rank in ranks:
        torch.testing.assert_close(rank[name]["logits"], logits, atol=1e-4, rtol=0)
        assert torch.equal(rank[name]["tokens"], tokens)


def test_ladder_wiring_changes_the_function(tp2_results):
    # Otherwise the ladder comparison above could not tell the two wirings apart.
    _, references = tp2_results
    assert (references["ladder"][0] - references["standard"][0]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["standard", "ladder", "uneven"])
def test_each_rank_holds_only_its_share_of_the_layers(tp2_results, name):
    ranks, references = tp2_results
    shares = [rank[name]["layer_weights"] for rank in ranks]
    assert sum(shares) == references[name][2]
    if name != "uneven":
        assert shares[0] == shares[1]


def test_no_communication_bound_really_skips_the_all_reduce(tp2_results):
    ranks, references = tp2_results
    for rank in ranks:
        assert (rank["standard"]["bound_logits"] - references["standard"][0]).abs().max() > 1e-2


def test_tp1_in_process_and_rewiring_in_place(checkpoints):
    """No process group at TP=1; `set_ladder_layers` on standard weights gives the ladder model."""
    ids = random_ids(BATCH, PROMPT, vocab_size=256)
    shard = load_shard(checkpoints["standard"])
    assert shard.ladder_layers == []
    shard.set_ladder_layers(LADDER_LAYERS)
    logits, tokens = sharded_outputs(shard, ids)
    reference_logits, reference_tokens, _ = reference_outputs(checkpoints["ladder"], ids)
    torch.testing.assert_close(logits, reference_logits, atol=1e-4, rtol=0)
    assert torch.equal(tokens, reference_tokens)
    assert load_shard(checkpoints["ladder"]).ladder_layers == LADDER_LAYERS


def test_a_shard_reads_the_upper_n_form_of_ladder_layers():
    """`ladder_layers: N` (the upper N layers, as the published configs write it) on a Llama config
    was iterated as is: a TypeError before any layer was built."""
    config = tiny_llama(num_hidden_layers=4).config
    config.ladder_layers = 2
    assert ModelShard(config).ladder_layers == [2, 3]


# --- The benchmark's command line ----------------------------------------------------------------


def tp_speed(*arguments: object) -> subprocess.CompletedProcess:
    """`python -m benchmarks.tp_speed ARGUMENTS` (the suite imports no benchmark; it runs them). The
    limit only catches a hang: the slowest run takes about 70 s idle and passed 300 s at load 14."""
    command = [sys.executable, "-m", "benchmarks.tp_speed", *map(str, arguments)]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)


def test_benchmark_refuses_bad_options_in_one_line(tmp_path):
    result = tp_speed("--new-tokens", "1", "--out", tmp_path / "out.json")
    assert result.returncode == 2 and result.stderr.startswith("tp_speed: error: argument --new-tokens: '1' is outside")
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out.json").exists()


@pytest.mark.parametrize(
    ("check", "message"),
    [
        (lambda: check_rate("20furlongs"), "is not 'loopback' or a rate"),
        (lambda: read_config("/no/such/checkpoint"), "not a checkpoint directory"),
    ],
    ids=["link", "model"],
)
def test_the_benchmark_s_inputs_are_checked_in_one_line(check, message):
    with pytest.raises(UsageError, match=message) as refused:
        check()
    assert "\n" not in str(refused.value)


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


@pytest.mark.slow  # two ranks under torchrun, once per link
def test_benchmark_runs_all_variants_on_loopback_and_an_emulated_link(tiny_checkpoint, tmp_path):
    """As root with iproute2 the same run also times an emulated 1 Gbit/s link (a network namespace),
    which it removes afterwards."""
    emulated = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
    links, before = (["loopback", "1gbit"], namespaces()) if emulated else (["loopback"], set())
    out = tmp_path / "bench.json"
    result = tp_speed("--model", tiny_checkpoint, "--batch", "1,2", "--prompt-length", 8, "--new-tokens", 3,
                      "--repeats", 2, "--warmup", 0, "--link", ",".join(links), "--out", out)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    variants = ["standard", "ladder (all 4)", "ladder (upper 2)", "no-comm bound"]
    expected = [(link, b, v) for link in links for b in (1, 2) for v in variants]
    assert [(row["link"], row["batch"], row["variant"]) for row in report["rows"]] == expected
    for row in report["rows"]:
        assert row["tp"] == 2 and len(row["decode_ms_samples"]) == 2
        assert row["tokens_per_s"] == pytest.approx(1e3 * row["batch"] / row["decode_ms_per_token"])
    assert [(summary["link"], summary["batch"]) for summary in report["summaries"]] == [
        (link, b) for link in links for b in (1, 2)
    ]
    assert "OUTPUTS ARE WRONG" in result.stdout and "communication share of standard decode" in result.stdout
    # Nothing new is left (stale namespaces of killed runs may have gone: they are cleaned up first).
    assert not emulated or namespaces() <= before


def test_ladder_all_reduces_are_waited_on_only_after_the_next_branch_launches(checkpoints):
    """The overlap itself: each all-reduce of a ladder layer's branch is launched asynchronously and
    waited on only after the next branch (when that one is ladder too) has been launched. Fails if
    a ladder all-reduce is made blocking (async_op=False) or waited on at once."""
    shard = load_shard(checkpoints["ladder"])
    events = []

    class Recorded:
        def __init__(self, branch, pending):
            self.branch, self.pending = branch, pending

        def wait(self):
            events.append(("wait", self.branch))
            return self.pending.wait()

    def recording_reduce(partial, async_op):
        branch = sum(event[0] == "launch" for event in events)
        events.append(("launch", branch, async_op))
        return Recorded(branch, shard_reduce(partial, async_op))

    shard_reduce, shard.reduce = shard.reduce, recording_reduce
    shard.setup_cache(1, PROMPT)
    with torch.inference_mode():
        shard(random_ids(1, 4, vocab_size=256), torch.arange(4))
    launched = {event[1]: (position, event[2]) for position, event in enumerate(events) if event[0] == "launch"}
    waited = {event[1]: position for position, event in enumerate(events) if event[0] == "wait"}
    layers = len(launched) // 2
    assert layers == 4 and LADDER_LAYERS == [0, 2, 3]
    overlapped = []
    for branch in range(2 * layers - 1):
        layer, next_layer = branch // 2, (branch + 1) // 2
        if layer in LADDER_LAYERS and next_layer in LADDER_LAYERS:
            assert launched[branch][1] is True, f"branch {branch} of ladder layer {layer} all-reduces blocking"
            assert waited[branch] > launched[branch + 1][0], f"branch {branch} is waited on before the next launches"
            overlapped.append(branch)
    assert overlapped == [0, 4, 5, 6]
