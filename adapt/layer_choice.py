"""A recipe's `model.ladder_layers` as the layers to rewire: parsed once (ladder/layers.py), and for
`auto:N` measured on calibration blocks spread over data.train (ladder/layer_search.py), with the
measurement recorded in the run folder so that a resumed run (and every other process) reuses it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator

from ladder.io.files import atomic_write
from ladder.layer_search import calibration_from_blocks, choose_ladder_layers
from ladder.layers import AutoLayers, parse_layer_choice, resolve_layer_choice
from ladder.log import log

from .recipe import Recipe

LAYER_SEARCH_FILE = "layer_search.json"  # what `model.ladder_layers: auto:N` measured and chose


def resolve_ladder_layers(
    recipe: Recipe, model: torch.nn.Module, accelerator: Accelerator, run_dir: Path, train_ids: np.ndarray
) -> list[int]:
    """model.ladder_layers as a list of layers. `auto:N`: the main process searches, the others read
    its record; a resumed run reuses the recorded choice."""
    choice = parse_layer_choice(recipe.model.ladder_layers, model.config.num_hidden_layers, "model.ladder_layers")
    record = run_dir / LAYER_SEARCH_FILE

    def search(auto: AutoLayers) -> list[int]:
        with accelerator.main_process_first():
            recorded = recipe.resume and record.is_file() and json.loads(record.read_text())["spec"] == str(auto)
            if accelerator.is_main_process and not recorded:
                found = choose_ladder_layers(model, calibration_from_blocks(train_ids), auto)
                run_dir.mkdir(parents=True, exist_ok=True)
                atomic_write(record, json.dumps(dataclasses.asdict(found), indent=1) + "\n")
                log.info(found.summary())
            return json.loads(record.read_text())["chosen"]

    return resolve_layer_choice(choice, search)
