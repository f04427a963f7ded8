"""Every family served by vLLM (its CPU backend): Llama, Mistral, Qwen2 and Qwen3 ladder models
(ladder/serving/model.py) against vLLM's own model of the family and against transformers.

The checkpoints and engines are tests/family_engines.py's: tiny random models of each family, with
biases, q/k norms and sliding windows. All engines run one after another in one subprocess of
.venv-serve (tests/vllm_runner.py), in that process (`in_process`: no engine or worker processes to
start), eager and, with no ladder layers, compiled too (Qwen2's and Qwen3's); conftest's vllm_jobs
starts that job beside the greedy one. (`ladder serve` checks a converted Qwen3 in
tests/test_serve_access.py, whose live server is the suite's one: the HTTP layer is the same for
every family.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from family_engines import COMPILED, FAMILIES, LADDER_LAYERS
from ladder.model.config_rules import CLASS_NAMES, ladder_architecture

# Needs vLLM's environment (.venv-serve), which `make test` builds: `make test-fast` skips it.
pytestmark = pytest.mark.envs

# fp32 on both sides; vLLM's kernels sum in another order than transformers' (see tests/test_vllm.py).
LOGPROB_ATOL = 1e-3
TIE_MARGIN = 1e-4  # vLLM's greedy token may be another only where the reference's best two are closer


@pytest.mark.parametrize(
    ("family", "mode"), [(family, "eager") for family in FAMILIES] + [(family, "compiled") for family in COMPILED]
)
def test_no_ladder_layers_is_vllms_own_model(vllm_families, family, mode):
    """With no ladder layers the ladder model is vLLM's own model of the family, to the bit: the
    same prompt log-probabilities, greedy tokens and their log-probabilities."""
    suffix = "-compiled" if mode == "compiled" else ""
    own, ladder = vllm_families[family + suffix], vllm_families[f"{family}-ladder0{suffix}"]
    assert own["model_classes"] == [f"vllm.model_executor.models.{family}.{CLASS_NAMES[family]}ForCausalLM"]
    assert ladder["model_classes"] == [f"ladder.serving.model.{ladder_architecture(family)}"]
    assert (own["compilation_mode"] == "NONE") == (ladder["compilation_mode"] == "NONE") == (mode == "eager")
    for key in ("prompt_logprobs", "tokens", "logprobs"):
        assert ladder[key] == own[key], f"{family}, {mode}: {key} differ"


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_ladder_layers_match_transformers(vllm_families, family_checkpoints, family_prompts, family):
    """With ladder layers, vLLM's ladder model computes the transformers ladder model's function
    (ladder/model/modeling_ladder.py) on the same checkpoint: on vLLM's own greedy path, fed to
    transformers whole, each prompt token's and each generated token's log-probability agree, and
    each generated token is transformers' best (or within a tie of it). vLLM's generation reads its
    KV cache; the reference has none."""
    result = vllm_families[f"{family}-ladder"]
    assert result["model_classes"] == [f"ladder.serving.model.{ladder_architecture(family)}"]
    model = AutoModelForCausalLM.from_pretrained(family_checkpoints[f"{family}-ladder"], dtype=torch.float32).eval()
    assert type(model).__name__ == ladder_architecture(family)
    assert model.config.ladder_layers == LADDER_LAYERS
    for prompt, tokens, logprobs, prompt_logprobs in zip(
        family_prompts, result["tokens"], result["logprobs"], result["prompt_logprobs"]
    ):
        steps = reference_logprobs(model, prompt + tokens)
        sequence = torch.tensor(prompt + tokens)
        chosen = steps[:-1].gather(1, sequence[1:, None])[:, 0]
        served_logprobs = torch.tensor(prompt_logprobs + logprobs)
        assert (served_logprobs - chosen).abs().max().item() <= LOGPROB_ATOL, f"{family}: log-probabilities differ"
        generated = steps[len(prompt) - 1 : -1]
        assert (generated.max(dim=-1).values - chosen[len(prompt) - 1 :]).max().item() < TIE_MARGIN, (
            f"{family}: vLLM's greedy tokens are not transformers' best"
        )
