"""vLLM plugin (entry point group `vllm.general_plugins`, see setup.cfg): lets `vllm serve` and
`vllm.LLM` load ladder checkpoints.

vLLM calls `register()` in every process it starts (the API server, the engine core and each
tensor-parallel worker), so registration must be cheap and repeatable: the model class is
registered by its "module:Class" name and imported only where a model is built. Under `ladder serve`
it also applies the server's shutdown fixes (ladder/serving/server.py: `quiet_engine_shutdown`,
`drop_exit_leak_reports`).

The model subclasses vLLM's Llama internals (layer, model and loader signatures, its custom-op
registration), which change between minor versions: the plugin registers it only with the versions
it was tested with (`SUPPORTED_VLLM` in engine.py), and logs one line instead under any other.
"""

import logging
import os

from ladder.serving.engine import vllm_version_problem

ARCHITECTURE = "LadderLlamaForCausalLM"
MODEL_CLASS = "ladder.serving.model:LadderLlamaForCausalLM"


def register() -> None:
    """Register the ladder config (model_type `llamaLadder`) with transformers' AutoConfig, so
    vLLM reads a ladder config.json without remote code, and the architecture with vLLM."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from ladder.model.configuration_ladder_llama import LadderLlamaConfig

    AutoConfig.register(LadderLlamaConfig.model_type, LadderLlamaConfig, exist_ok=True)
    if problem := vllm_version_problem():
        # vLLM calls plugins unguarded: an exception here would be a traceback in every process.
        logging.getLogger(__name__).error(problem)
        return
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    from ladder.serving.server import SERVE_ENV_FLAG, drop_exit_leak_reports, quiet_engine_shutdown

    if os.environ.get(SERVE_ENV_FLAG):
        quiet_engine_shutdown()
        drop_exit_leak_reports()
