"""adapt's objectives and its memory savings against independent computations: the KD loss from its
definition, merged LoRA against the PEFT model, chunked losses against full logits, fewer saved
activations and preallocated optimizer state against the plain computation."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM

import ladder
from adapt_runs import write_recipe
from ladder.adapt.losses import IGNORE_INDEX, head_losses, next_token_labels
from ladder.adapt.recipe import load_recipe
from tiny import random_ids, tiny_llama

# --- the objectives and LoRA against independent computations --------------------------------------


def test_kd_loss_is_the_forward_kl_at_temperature_times_t_squared(tiny_checkpoint):
    # Teacher: the tiny original; student: its ladder rewiring (different logits). The reference
    # is written out from the definition, in float64: mean over positions of
    # T² · Σ_v p_T(v) (log p_T(v) - log q_T(v)), with p the teacher's and q the student's softmax at T.
    teacher = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    student = ladder.to_ladder(AutoModelForCausalLM.from_pretrained(tiny_checkpoint), 2).eval()
    ids = torch.randint(0, teacher.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # A random tiny model's distributions are nearly uniform, where forward and reverse KL agree
        # to second order; sharpened logits (x100, through the LM head's weight) make the direction,
        # and T, matter. head_losses takes final hidden states and LM head weights (it never holds all logits).
        teacher_hidden, student_hidden = teacher.model(input_ids=ids)[0], student.model(input_ids=ids)[0]
        teacher_weight, student_weight = 100 * teacher.lm_head.weight, 100 * student.lm_head.weight
        teacher_logits, student_logits = teacher_hidden @ teacher_weight.T, student_hidden @ student_weight.T
    for temperature in (1.0, 2.0):
        p = (teacher_logits.double() / temperature).log_softmax(-1)
        q = (student_logits.double() / temperature).log_softmax(-1)
        expected = temperature**2 * (p.exp() * (p - q)).sum(-1).mean()
        reverse = temperature**2 * (q.exp() * (q - p)).sum(-1).mean()
        assert expected > 0.05 and abs(reverse / expected - 1) > 1e-3  # 10x the tolerance: the directions differ
        unlabelled = torch.full(ids.shape, IGNORE_INDEX)  # kd_weight 1: the distillation term alone
        computed, _ = head_losses(
            student_hidden, student_weight, unlabelled, teacher_hidden, teacher_weight, 1.0, temperature
        )
        assert float(computed) == pytest.approx(float(expected), rel=1e-4)


def test_merged_lora_model_gives_the_logits_of_the_peft_model(tmp_path, tiny_checkpoint, corpus):
    from ladder.adapt.train import start

    recipe = load_recipe(
        write_recipe(
            tmp_path,
            tiny_checkpoint,
            corpus,
            budget=3 * 256,
            **{"trainable.mode": "lora", "trainable.lora.target_modules": ["q_proj", "v_proj"]},
        )
    )
    with contextlib.ExitStack() as releases:
        run = start(recipe, releases)
        run.train()
        device = run.accelerator.device
        ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
        peft_model = run.accelerator.unwrap_model(run.model).eval()
        with torch.no_grad():
            before_merge = peft_model(input_ids=ids).logits
            with peft_model.disable_adapter():
                without_adapters = peft_model(input_ids=ids).logits
        final = run.save_final()
    merged = AutoModelForCausalLM.from_pretrained(final).to(device).eval()
    with torch.no_grad():
        after_merge = merged(input_ids=ids).logits
    assert (before_merge - without_adapters).abs().max() > 1e-3  # the adapters learned something
    torch.testing.assert_close(after_merge, before_merge, atol=1e-4, rtol=0)


# --- Chunked losses: equal to the full-logits computation ----------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("kd_weight", [0.0, 0.3, 1.0])
def test_chunked_losses_equal_the_full_logits_computation(kd_weight, temperature):
    generator = torch.Generator().manual_seed(0)
    batch, seq, width, vocab = 2, 37, 16, 50
    hidden = torch.randn(batch, seq, width, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, width, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher_hidden = torch.randn(batch, seq, width, generator=generator, dtype=torch.float64)
    teacher_weight = torch.randn(vocab, width, generator=generator, dtype=torch.float64)
    labels = next_token_labels(torch.randint(0, vocab, (batch, seq), generator=generator))
    labels[0, 5:12] = -100  # masked positions (chat masking) count for nothing

    logits = hidden @ weight.T
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    student = (logits / temperature).log_softmax(-1).flatten(0, 1)
    teacher = ((teacher_hidden @ teacher_weight.T) / temperature).log_softmax(-1).flatten(0, 1)
    kd = torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="batchmean") * temperature**2
    expected = (1 - kd_weight) * ce + kd_weight * kd
    expected_grads = torch.autograd.grad(expected, (hidden, weight))

    loss, next_token = head_losses(
        hidden, weight, labels, teacher_hidden, teacher_weight, kd_weight, temperature, chunk_tokens=10
    )  # 74 positions: 8 chunks, the last one short
    grads = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(next_token, ce, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(head_losses(hidden, weight, labels, chunk_tokens=7)[0], ce, rtol=1e-10, atol=1e-12)
    unlabelled = torch.full_like(labels, IGNORE_INDEX)
    kd_alone = head_losses(hidden, weight, unlabelled, teacher_hidden, teacher_weight, 1.0, temperature, chunk_tokens=7)
    torch.testing.assert_close(kd_alone[0], kd, rtol=1e-10, atol=1e-12)


def test_losses_in_lm_head_computes_no_logits_and_trains_like_the_plain_loss(tiny_checkpoint):
    from ladder.adapt.losses import losses_in_lm_head

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = next_token_labels(ids)
    plain = torch.nn.functional.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), labels.flatten())
    plain_grads = torch.autograd.grad(plain, list(model.parameters()))
    with losses_in_lm_head(model, lambda hidden, weight: head_losses(hidden, weight, labels, chunk_tokens=16)) as out:
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 0, model.config.vocab_size)
    loss, _ = out[0]
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert model(input_ids=ids).logits.shape == (2, 24, model.config.vocab_size)  # the hook is gone


def test_held_out_losses_come_chunk_by_chunk_and_equal_the_full_logits(tiny_checkpoint):
    """`block_loss_sums` (adapt's held-out evaluation) computes its logits a chunk of positions at a
    time inside the head, with the sums of the plain cross-entropy over full logits; chunks hold
    16 MiB of float32 logits on the CPU."""
    from ladder.adapt import losses
    from ladder.adapt.losses import block_loss_sums, chunk_positions, token_losses

    assert chunk_positions(49_152) == 85 and chunk_positions(2**40) == 1
    # On an accelerator a chunk spans at least 1,024 positions of a 128k vocabulary: the head weight is
    # read a few times per micro-step, not 63 (issue 29).
    assert chunk_positions(128_256, "cuda") == chunk_positions(128_256, "meta") == 1046
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2))
    labels = next_token_labels(ids)
    labels[1, :25] = IGNORE_INDEX
    with torch.no_grad():
        plain = torch.nn.functional.cross_entropy(
            model(input_ids=ids).logits.flatten(0, 1), labels.flatten(), reduction="none"
        ).view(3, 40)
    chunk_sizes = []
    original = token_losses

    def recording(hidden, weight, labels, chunk_tokens=None):
        chunk_sizes.append(chunk_positions(weight.shape[0], weight.device))
        return original(hidden, weight, labels, chunk_tokens=7)  # 120 positions: 18 chunks, the last short

    losses.token_losses = recording
    try:
        sums, counts = block_loss_sums(model, ids, labels)
    finally:
        losses.token_losses = original
    assert chunk_sizes == [chunk_positions(model.config.vocab_size)]
    torch.testing.assert_close(sums, plain.sum(dim=1), rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [39, 14, 39]


# --- Training in less memory: the same forward and gradients ---------------------------------------


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(logits, bytes of the distinct tensors autograd keeps for backward) of one forward."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(input_ids=ids).logits
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return logits, sum(size for pointer, size in storages.items() if pointer not in parameters)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_fewer_saved_activations_give_the_same_forward_and_gradients(autocast):
    from peft import LoraConfig, get_peft_model

    from ladder.adapt.memory import CheckpointedLlamaRMSNorm, LeanLlamaMLP, keep_fewer_activations

    plain = ladder.to_ladder(tiny_llama(), [2, 3]).train()
    lean = ladder.to_ladder(tiny_llama(), [2, 3]).train()
    for model in (plain, lean):
        model.model.layers[:2].requires_grad_(False)  # as `trainable: ladder` leaves them
    config = lean.config
    assert keep_fewer_activations(lean) == config.num_hidden_layers * 3 + 1  # MLPs, two norms each, the final norm
    assert type(lean.model.layers[3].mlp) is LeanLlamaMLP
    assert type(lean.model.norm) is CheckpointedLlamaRMSNorm
    ids = random_ids(batch=2, length=24, vocab_size=config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        (plain_logits, plain_saved), (lean_logits, lean_saved) = saved_bytes(plain, ids), saved_bytes(lean, ids)
    assert torch.equal(lean_logits, plain_logits)
    # Per trained layer: silu(gate) and the product (tokens x intermediate, in the projections' dtype),
    # and each norm's normalized input (float32: Llama's norm computes in float32).
    projected = 2 if autocast else 4
    tokens = ids.numel()
    spared = 2 * (2 * tokens * config.intermediate_size * projected + 2 * tokens * config.hidden_size * 4)
    assert lean_saved <= plain_saved - spared
    plain_logits.float().square().mean().backward()
    lean_logits.float().square().mean().backward()
    for (name, want), got in zip(plain.named_parameters(), lean.parameters()):
        assert (got.grad is None) == (want.grad is None), name
        if want.grad is not None:
            assert got.grad.dtype == want.grad.dtype
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-9, msg=name)

    # LoRA wraps the projections: that MLP keeps its own forward (the norms still change).
    wrapped = get_peft_model(ladder.to_ladder(tiny_llama(), [2, 3]), LoraConfig(r=2, target_modules=["gate_proj"]))
    assert keep_fewer_activations(wrapped) == config.num_hidden_layers * 2 + 1
    assert type(wrapped.base_model.model.model.layers[3].mlp) is not LeanLlamaMLP


def test_allocated_optimizer_state_trains_like_the_lazily_allocated_one():
    from ladder.adapt.memory import allocate_optimizer_state

    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=generator), torch.randn(3, generator=generator)]
    gradients = [[torch.randn_like(p) for p in start] for _ in range(3)]
    results = []
    for allocate in (False, True):
        parameters = [p.clone().requires_grad_() for p in start]
        optimizer = torch.optim.AdamW(
            [{"params": parameters[:1], "weight_decay": 0.1}, {"params": parameters[1:], "weight_decay": 0.0}],
            lr=0.1,
            fused=True,
        )
        if allocate:
            allocate_optimizer_state(optimizer)
            assert all(torch.count_nonzero(optimizer.state[p]["exp_avg_sq"]) == 0 for p in parameters)
        for step in gradients:
            for parameter, gradient in zip(parameters, step):
                parameter.grad = gradient.clone()
            optimizer.step()
        results.append((parameters, optimizer.state_dict()["state"]))
    (lazy, lazy_state), (allocated, allocated_state) = results
    for want, got in zip(lazy, allocated):
        assert torch.equal(got, want)
    for index, want in lazy_state.items():
        for key, value in want.items():
            assert torch.equal(allocated_state[index][key], value), key
