"""Which tensor-parallel degrees each engine runs a Llama at, and why it refuses the others: one
place for the rules, which the TP runtime (shard.py), `ladder serve` (ladder/serving/server.py) and
`ladder plan` all apply. Plain arithmetic on head counts (no torch, no vLLM).

- The TP runtime (ladder/tp) gives each rank whole KV heads with their groups of query heads, so
  attention needs no communication: it needs at least one KV head per rank, and KV heads that do
  not divide evenly give ranks unequal groups (it runs, unevenly: SmolLM2's 3 KV heads at TP=2).
- vLLM (`ladder serve`, `ladder eval --backend vllm`) splits query heads evenly and splits KV heads
  evenly or replicates each over TP / KV ranks. In vLLM 0.32: `ModelConfig.verify_with_parallel_config`
  (vllm/config/model.py, heads divisible by TP) when it builds its configuration, and `LlamaAttention`
  (vllm/model_executor/models/llama.py, KV heads divisible by TP, or TP by KV heads) only when it
  builds the model, after the weights are read.
"""

from __future__ import annotations


def tp_runtime_refusal(heads: int, kv_heads: int, tp: int) -> str | None:
    """Why the TP runtime cannot run a model with these head counts at TP=`tp`; None when it can."""
    if kv_heads < tp:
        return f"TP={tp} needs at least one KV head per rank; the model has {kv_heads}"
    if heads % kv_heads:
        return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
    return None


def vllm_refusal(heads: int, kv_heads: int, tp: int) -> str | None:
    """Why vLLM cannot serve a model with these head counts at TP=`tp`; None when it can."""
    if heads % tp:
        return f"its {heads} attention heads are not divisible by TP={tp}"
    if kv_heads >= tp and kv_heads % tp:
        return f"its {kv_heads} KV heads are not divisible by TP={tp}"
    if kv_heads < tp and tp % kv_heads:
        return f"TP={tp} is not a multiple of its {kv_heads} KV heads (each KV head is replicated over TP / KV ranks)"
    return None


# Engine (`--engine`) -> its name in messages, and why it refuses TP=`tp` for these head counts
# (heads, kv_heads, tp; None when it runs it).
ENGINES = {"vllm": ("vLLM", vllm_refusal), "tp-runtime": ("the TP runtime", tp_runtime_refusal)}
