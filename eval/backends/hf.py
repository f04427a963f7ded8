"""The `hf` backend: the weights loaded here (`ladder.io.loading.load_model`) as lm-eval's `HFLM`,
scoring Llama-family log-likelihoods with each shared context run once (shared_prefix.py)."""

from __future__ import annotations

import transformers
from lm_eval.models.huggingface import HFLM

from ladder.errors import UsageError
from ladder.io.loading import DTYPES, load_model

from ..models import ModelRef
from ..runtime import Runtime
from .shared_prefix import score_continuations


def check(runtime: Runtime, models: list[ModelRef]) -> None:
    if runtime.tensor_parallel != 1:
        raise UsageError("--tp is for --backend vllm")
    if runtime.data_parallel != 1:
        raise UsageError("--data-parallel is for --backend vllm (the hf backend's copies: --processes N)")


def code_classes() -> list[type]:
    return []


class LoadedHFLM(HFLM):
    """lm-eval's HFLM over a model loaded here, sharing the items between processes: HFLM sets its
    rank and world size only for a path it loads itself on several GPUs."""

    def __init__(self, model, tokenizer, runtime: Runtime):
        # softmax_dtype: lm-eval's own path (rolling windows) takes its log-softmax in float32 too.
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=runtime.batch_size, softmax_dtype="float32")
        if runtime.processes > 1:
            # The attributes HFLM's all_gather, gather_object and barrier use.
            self.accelerator = runtime.accelerator
            self._rank = runtime.accelerator.process_index
            self._world_size = runtime.accelerator.num_processes

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """lm-eval's own path stays for rolling windows (nothing is shared) and other architectures."""
        shared = isinstance(self.model, transformers.LlamaForCausalLM) and all(
            request is not None for request, _, _ in requests
        )
        if not shared or not requests:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        batch_size = override_bs or self.batch_size
        if batch_size == "auto":
            longest = max(range(len(requests)), key=lambda index: len(requests[index][1]) + len(requests[index][2]))
            batch_size = self._detect_batch_size(requests=requests, pos=longest)
        return score_continuations(
            self.model.model,
            self.model.lm_head,
            [(context, continuation) for _, context, continuation in requests],
            max_length=self.max_length,
            batch_size=batch_size,
            done=getattr(self.cache_hook, "scored", lambda count: None),  # the run's progress (harness.ItemProgress)
        )


def load_lm(ref: ModelRef, runtime: Runtime) -> HFLM:
    device_map = "auto" if runtime.parallelize else None if runtime.device == "cpu" else {"": runtime.device}
    model, tokenizer = load_model(ref.path, dtype=DTYPES[runtime.dtype], device_map=device_map)
    return LoadedHFLM(model, tokenizer, runtime)
