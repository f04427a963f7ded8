"""Greedy generation through vLLM, run inside the serving environment (.venv-serve) by
tests/test_vllm.py, which lives in the main environment (another transformers version).

    .venv-serve/bin/python tests/vllm_runner.py JOB.json RESULT.json

JOB.json: {"runs": [{"name", "model", "tp", "eager", "prompts": [[token ids], ...], "max_tokens"}]}, and
optionally "max_model_len" (512) and "compile_cache" (the run's own VLLM_CACHE_ROOT); "in_process": true
(for the job, or from a run on) runs TP=1 engines in the runner's process.
RESULT.json: per run name, the generated token ids and their log-probabilities per prompt, the
log-probability of each prompt token after the first, the model class each worker built, and the
engine's start-up time. "eager": false is vLLM's default mode (torch.compile). Runs go one after another in this
process, each with its own engine (vLLM serves one model per engine).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def run(spec: dict) -> dict:
    from accelerate.utils import patch_environment
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # One core per rank (this machine has one NUMA node, so vLLM's "auto" binding refuses TP > 1).
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = (
        "|".join(str(core) for core in range(spec["tp"])) if spec["tp"] > 1 else "auto"
    )
    # A run's own compile cache, for a test that reads the code inductor wrote (the engine's processes
    # read VLLM_CACHE_ROOT as they start, within LLM()).
    own_cache = {"VLLM_CACHE_ROOT": spec["compile_cache"]} if "compile_cache" in spec else {}
    started = time.monotonic()
    with patch_environment(**own_cache):
        llm = LLM(
            model=spec["model"],
            tensor_parallel_size=spec["tp"],
            dtype="float32",
            enforce_eager=spec["eager"],
            max_model_len=spec.get("max_model_len", 512),
            seed=0,
        )
    startup = time.monotonic() - started
    compilation_mode = llm.llm_engine.vllm_config.compilation_config.mode.name  # NONE when eager
    params = SamplingParams(
        temperature=0.0, max_tokens=spec["max_tokens"], logprobs=0, prompt_logprobs=0, ignore_eos=True
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]], params, use_tqdm=False)
    tokens, logprobs, prompt_logprobs = [], [], []
    for output in outputs:
        completion = output.outputs[0]
        tokens.append(list(completion.token_ids))
        logprobs.append([step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)])
        prompt = output.prompt_token_ids
        prompt_logprobs.append([step[token].logprob for token, step in zip(prompt[1:], output.prompt_logprobs[1:])])
    # `type` itself: apply_model's argument is pickled by reference, and the class comes back the same way.
    classes = [f"{cls.__module__}.{cls.__qualname__}" for cls in llm.apply_model(type)]
    del llm
    gc.collect()
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "model_classes": classes,
        "startup_seconds": startup,
        "compilation_mode": compilation_mode,
    }


def register_loaded(models: list[str]) -> None:
    """Register the architectures of `models` by their classes, loaded here. vLLM inspects an
    architecture registered by name (its own, and the ladder plugin's) in a new Python that imports
    vLLM, 8-10 s each, remembered under VLLM_CACHE_ROOT, which is the test session's own; this process
    has vLLM imported already (and builds each engine's config, where the inspection happens)."""
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the ladder architectures, as LLM() registers them
    for model in models:
        for architecture in json.loads(open(os.path.join(model, "config.json")).read())["architectures"]:
            ModelRegistry.register_model(architecture, ModelRegistry.models[architecture].load_model_cls())


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    results = {}
    register_loaded([spec["model"] for spec in job["runs"]])
    for spec in job["runs"]:
        # A TP=1 engine in this process: no engine or worker process to start. Once one has run here,
        # vLLM reads its environment no more (enable_envs_cache): the runs after it stay in process.
        if spec.get("in_process", job.get("in_process")):
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        results[spec["name"]] = run(spec)
    with open(result_path, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":  # vLLM starts its engine and workers by spawn: they re-import this file
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a large share of RAM
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships a function to the workers
    main(*sys.argv[1:])
