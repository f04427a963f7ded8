"""Worker for tests/test_portability.py, run by the Python of another environment (another
transformers version, `ladder` not installed): load converted checkpoints with
trust_remote_code=True, so that only the modeling files they carry can build the model, and save
their logits and greedy continuations (which run the KV cache) for the test to compare.

    python load_remote.py INPUT_IDS.pt OUTPUT.pt CHECKPOINT [CHECKPOINT ...]
"""

import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

ids_path, output_path, *checkpoints = sys.argv[1:]
input_ids = torch.load(ids_path)
attention_mask = torch.ones_like(input_ids)

results = {"transformers": transformers.__version__}
for checkpoint in checkpoints:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(input_ids).logits
        generated = model.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
    results[checkpoint] = {"logits": logits, "generated": generated, "model_module": type(model).__module__}
torch.save(results, output_path)
