"""Worker for tests/test_portability.py, run by the Python of a transformers 4.x environment: read
converted checkpoints as code written for the published ladder format does, and save the
logits it computes and the RoPE settings it read.

That code is the official ladder modeling file (github.com/mayank31398/ladder-residual-inference,
hf_modeling_utils/, written against transformers 4.47): a 4.x `LlamaConfig` subclass reads
config.json, 4.x Llama modules (rotary embedding, attention, MLP, RMSNorm) do the work, and its
layer loop wires them. It cannot be fetched at test time (no network), so this is that forward
pass without a cache: the config, the weights and every module come from 4.x, and the loop below
is its loop (both streams start as the embeddings; a ladder layer's attention reads the previous
attention stream and its MLP the previous MLP stream).

    python read_with_transformers4.py INPUT_IDS.pt OUTPUT.pt CHECKPOINT [CHECKPOINT ...]
"""

import sys

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

ids_path, output_path, *checkpoints = sys.argv[1:]
input_ids = torch.load(ids_path)
length = input_ids.shape[1]
positions = torch.arange(length)[None].expand(input_ids.shape[0], -1)
causal_mask = torch.full((length, length), float("-inf")).triu(1)[None, None]

results = {"transformers": transformers.__version__}
for checkpoint in checkpoints:
    # model_type "llamaLadder": 4.x says it is not "llama" and reads it as a Llama config.
    config = LlamaConfig.from_pretrained(checkpoint, attn_implementation="eager")
    ladder_layers = config.ladder_layers
    if isinstance(ladder_layers, int):  # the published form: the upper N layers
        ladder_layers = list(range(config.num_hidden_layers - ladder_layers, config.num_hidden_layers))
    model = LlamaForCausalLM.from_pretrained(checkpoint, config=config).eval()
    backbone = model.model
    with torch.no_grad():
        embeddings = backbone.embed_tokens(input_ids)
        position_embeddings = backbone.rotary_emb(embeddings, positions)
        attn_stream = mlp_stream = embeddings
        for index, layer in enumerate(backbone.layers):
            is_ladder = index in ladder_layers
            attention = layer.self_attn(
                hidden_states=layer.input_layernorm(attn_stream if is_ladder else mlp_stream),
                attention_mask=causal_mask,
                position_ids=positions,
                position_embeddings=position_embeddings,
            )[0]
            new_attn_stream = mlp_stream + attention
            mlp = layer.mlp(layer.post_attention_layernorm(mlp_stream if is_ladder else new_attn_stream))
            attn_stream, mlp_stream = new_attn_stream, new_attn_stream + mlp
        logits = model.lm_head(backbone.norm(mlp_stream))
    results[checkpoint] = {
        "logits": logits,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "inv_freq": backbone.rotary_emb.inv_freq,
    }
torch.save(results, output_path)
