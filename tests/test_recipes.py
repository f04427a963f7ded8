"""Every shipped recipe (and accelerate config) loads and validates; recipe errors name the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

import ladder
from checkpoints import cache_hub_model
from ladder.adapt.data import local_files
from ladder.adapt.preflight import check_model
from ladder.adapt.recipe import load_recipe
from ladder.cli import main as ladder_main
from ladder.errors import UsageError

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SHIPPED = sorted(RECIPES.glob("*.yaml"))
PAPER = {"llama31-8b-instruct-ladder16.yaml": 16, "llama31-8b-instruct-ladder20.yaml": 20}


def test_the_expected_recipes_ship():
    assert {p.name for p in SHIPPED} >= {"smollm2-135m-ladder-cpu.yaml", *PAPER}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem
    header = path.read_text().split("\nname:")[0]
    assert path.name in header or f"RECIPE=recipes/{path.name}" in header, "the header gives the launch command"
    for source in recipe.data.train + recipe.data.eval:
        if not source.path.startswith("hf:"):
            assert local_files(source, source.path)  # the shared data files exist


def test_cpu_recipe_trains_on_other_books_than_it_evaluates():
    recipe = load_recipe(RECIPES / "smollm2-135m-ladder-cpu.yaml")
    assert recipe.model.path == "embedded" and recipe.precision == "fp32"
    train = {f for s in recipe.data.train for f in local_files(s, s.path)}
    heldout = {f for s in recipe.data.eval for f in local_files(s, s.path)}
    assert train and heldout and not train & heldout
    assert {f.parent for f in train}.isdisjoint({f.parent for f in heldout})
    # Enough distinct text for the whole budget (no block is read twice).
    assert sum(s.max_tokens for s in recipe.data.train) * 0.95 > recipe.budget


@pytest.mark.parametrize("name, layers", PAPER.items())
def test_paper_recipes_match_the_paper_setting(name, layers):
    recipe = load_recipe(RECIPES / name)
    assert recipe.model.ladder_layers == layers and recipe.precision == "bf16"
    (source,) = recipe.data.train
    assert source.path == "hf:BAAI/Infinity-Instruct" and source.chat_field == "conversations"
    assert recipe.objective.name == "lm" and recipe.trainable.mode == "all"
    gpus = 8
    tokens_per_step = recipe.batch.micro_batch * recipe.batch.grad_accum * gpus * recipe.data.seq_len
    assert 2.5e9 <= int(recipe.budget // tokens_per_step) * tokens_per_step <= 3.5e9
    assert source.max_tokens > recipe.budget  # the held-out tail is taken out of max_tokens
    header = (RECIPES / name).read_text()
    launch = re.search(r"accelerate launch --config_file (\S+)", header)
    assert launch and (RECIPES.parent / launch.group(1)).is_file()
    assert "GPU-hours" in header


HUB_ID = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("name", PAPER)
def test_paper_recipes_load_the_hub_model_and_say_how_to_get_it(name, hub_cache, tiny_checkpoint, capsys):
    """The 8B recipes name the Hub ID: offline and not cached, one line naming a download that works;
    once the snapshot is in the cache, the recipe resolves to it (the tiny model stands in)."""
    recipe = load_recipe(RECIPES / name, ["model.ladder_layers=2", "data.seq_len=512"])  # the tiny model's context
    assert recipe.model.path == HUB_ID
    with pytest.raises(UsageError, match=re.escape(f"`hf download {HUB_ID}`")) as error:
        check_model(recipe)
    assert "\n" not in str(error.value)
    assert ladder_main(["adapt", str(RECIPES / name), "--prepare-data"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"`hf download {HUB_ID}`" in err
    snapshot = cache_hub_model(hub_cache, HUB_ID, tiny_checkpoint)
    assert check_model(recipe).student == snapshot


def test_a_missing_local_model_folder_suggests_no_hub_download(tmp_path, monkeypatch):
    """A path under a folder that exists here is a local path: its absence is said as such, with no
    `hf download` of a local path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    recipe = load_recipe(RECIPES / "llama31-8b-instruct-ladder16.yaml", ["model.path=models/Llama-3.1-8B-Instruct"])
    with pytest.raises(UsageError, match="model path models/Llama-3.1-8B-Instruct does not exist") as error:
        check_model(recipe)
    assert "hf download" not in str(error.value) and "Hub" not in str(error.value)


def test_fsdp_config_is_one_accelerate_reads():
    path = RECIPES / "accelerate" / "fsdp-8gpu.yaml"
    config = load_config_from_file(str(path))
    assert str(config.distributed_type).endswith("FSDP") and config.num_processes == 8
    assert config.mixed_precision == "bf16"
    layer_class = config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"]
    assert layer_class == ladder.LadderLlamaForCausalLM._no_split_modules[0] == "LadderLlamaDecoderLayer"
    assert yaml.safe_load(path.read_text())["fsdp_config"]["fsdp_version"] == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optimzer.lr=1"], "unknown recipe key 'optimzer'"),
        (["optimizer.learning_rate=1"], "unknown recipe key 'optimizer.learning_rate'"),
        (["optimizer.lr=fast"], "optimizer.lr = 'fast': expected a number"),
        (["optimizer.lr=-1"], "optimizer.lr = -1: input should be greater than 0"),
        (["batch.micro_batch=1.5"], "batch.micro_batch = 1.5: input should be a valid integer"),
        (["objective.name=distill"], "objective.name = 'distill': input should be 'lm', 'kd', 'mix' or 'hidden'"),
        (["precision=fp16"], "precision = 'fp16': input should be 'fp32' or 'bf16'"),
        (["resume=yes please"], "resume = 'yes please': input should be a valid boolean"),
        (["trainable.mode=layers"], "trainable.layers goes with trainable.mode=layers"),
        (["data.train=[]"], "data.train must list at least one source"),
        (["data.train.0.pth=x"], "unknown recipe key 'data.train[0].pth'"),
        (["data.train.9.max_tokens=1"], "data.train has 8 item(s); 9 is past the end"),
        (["data.train.first.max_tokens=1"], "data.train is a list; address its items by number"),
        (["budget.0=1"], "budget is not a section"),
        (["budget"], "is not key=value"),
        (["data.eval=${NO_SUCH_VARIABLE}/x.txt"], "environment variable NO_SUCH_VARIABLE"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        load_recipe(RECIPES / "smollm2-135m-ladder-cpu.yaml", overrides)


def test_overrides_and_numbers_in_e_notation():
    recipe = load_recipe(
        RECIPES / "smollm2-135m-ladder-cpu.yaml",
        ["budget=2e4", "optimizer.betas=[0.8, 0.9]", "data.train=a/b.txt", "model.ladder_layers=4-7"],
    )
    assert recipe.budget == 2e4 and recipe.optimizer.betas == [0.8, 0.9]
    assert [s.path for s in recipe.data.train] == ["a/b.txt"] and recipe.model.ladder_layers == "4-7"
    with pytest.raises(UsageError, match="recipe .*missing.yaml does not exist"):
        load_recipe(RECIPES / "missing.yaml")


def test_overrides_address_list_items():
    shipped = load_recipe(RECIPES / "smollm2-135m-ladder-cpu.yaml")
    recipe = load_recipe(
        RECIPES / "smollm2-135m-ladder-cpu.yaml",
        [
            "data.train.0.max_tokens=1e6",
            "data.train[1].documents=blank_line",
            f"data.train.{len(shipped.data.train)}=extra.txt",
            "data.eval.0.path=held.txt",
        ],
    )
    assert recipe.data.train[0].max_tokens == 1_000_000 and recipe.data.train[0].path == shipped.data.train[0].path
    assert recipe.data.train[1].documents == "blank_line"
    assert recipe.data.train[2:-1] == shipped.data.train[2:]
    assert recipe.data.train[-1].path == "extra.txt" and recipe.data.eval[0].path == "held.txt"
    assert load_recipe(None, ["data.train.0.path=a.txt", "data.train.0.max_tokens=10"]).data.train[0].max_tokens == 10
