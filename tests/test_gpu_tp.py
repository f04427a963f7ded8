"""ladder/tp's runtime in one process, on the CPU over gloo and (a GPU check, `pytest -m gpu`) on CUDA
over NCCL: prefill, then decoding through the KV cache, gives transformers' logits."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import patch_environment
from transformers import AutoModelForCausalLM

import ladder
from tiny import DEVICES, random_ids, tiny_llama


@pytest.mark.parametrize("device", DEVICES)
def test_tp_runtime_at_world_size_1_gives_transformers_logits(device, tmp_path):
    from ladder.launch import free_port
    from ladder.tp.runtime import init_distributed, install_communication, load_shard

    tf32 = torch.backends.cuda.matmul.allow_tf32  # off: the comparison is at fp32's precision
    torch.backends.cuda.matmul.allow_tf32 = False
    rendezvous = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    with patch_environment(**rendezvous):  # as torchrun sets it for one rank
        _, world_size, shard_device = init_distributed(cuda=device == "cuda")
    try:
        assert torch.distributed.get_backend() == ("nccl" if device == "cuda" else "gloo")
        model = tiny_llama(num_hidden_layers=4)
        model.save_pretrained(tmp_path / "standard")
        ladder.to_ladder(model, [0, 2, 3]).save_pretrained(tmp_path / "ladder")
        ids = random_ids(length=12)
        for name in ("standard", "ladder"):
            reference = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
            with torch.no_grad():
                expected = reference(ids).logits
            shard = load_shard(tmp_path / name, 0, world_size, device=shard_device)
            install_communication(shard)
            shard.setup_cache(2, 16)
            with torch.inference_mode():
                logits = [shard(ids[:, :8].to(shard_device), torch.arange(8, device=shard_device))]
                logits += [
                    shard(ids[:, i : i + 1].to(shard_device), torch.tensor([i], device=shard_device))
                    for i in range(8, 12)
                ]
            assert (torch.cat(logits, dim=1).cpu() - expected).abs().max() < 1e-4, name
    finally:
        torch.distributed.destroy_process_group()
        torch.backends.cuda.matmul.allow_tf32 = tf32
