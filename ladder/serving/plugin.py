"""vLLM plugin (entry point group `vllm.general_plugins`, see setup.cfg): lets `vllm serve` and
`vllm.LLM` load ladder checkpoints. vLLM calls `register()` in every process it starts (API server,
engine core, each tensor-parallel worker), so it must be cheap and repeatable: the model classes are
registered by name and imported only where a model is built. Under `ladder serve` it also applies the
server's shutdown fixes (ladder/serving/server.py). The models subclass vLLM's internals, which change
between minor versions: they are registered only with the versions tested (`SUPPORTED_VLLM`).
"""

import atexit
import logging
import os

from ladder.model.config_rules import LADDER_MODEL_TYPES, ladder_architecture
from ladder.serving.engine import vllm_version_problem


def register() -> None:
    """Register each family's ladder config (model_type `llamaLadder`, `qwen3Ladder`, ...) with
    transformers' AutoConfig, so vLLM reads a ladder config.json without remote code, and each
    family's ladder architecture with vLLM."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from ladder.model import configuration_ladder

    for name in configuration_ladder.__all__:
        config_class = getattr(configuration_ladder, name)
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    if problem := vllm_version_problem():
        # vLLM calls plugins unguarded: an exception here would be a traceback in every process.
        logging.getLogger(__name__).error(problem)
        return
    for architecture in map(ladder_architecture, LADDER_MODEL_TYPES):  # config.json's `architectures`
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, f"ladder.serving.model:{architecture}")
    from ladder.serving.server import SERVE_ENV_FLAG, drop_exit_leak_reports, quiet_engine_shutdown

    if os.environ.get(SERVE_ENV_FLAG):
        quiet_engine_shutdown()
        atexit.register(drop_exit_leak_reports)  # registered early, so it runs after the other exit handlers
