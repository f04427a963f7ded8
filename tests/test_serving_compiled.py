"""The code inductor builds for a ladder model in vLLM's default (compiled) mode at TP=2, read back
from vLLM's compile cache: the ladder all-reduces keep their buffers alive until they are joined,
run one at a time in program order, and each hides behind the module it is meant to overlap.

On a GPU, `all_reduce_start` forks vLLM's all-reduce onto a second stream and `all_reduce_wait`
joins it; only data flow keeps inductor from freeing, reusing or reordering around them, so these
checks read what inductor wrote. The CPU build compiles the same graph (one Dynamo trace, inductor);
a GPU build splits it into pieces at each attention, which run back to back, each as a CUDA graph
(piecewise) or all inside one (a full graph): the last test reads that split, emulated in-process,
where an MLP output's reduction starts in one piece and is joined in the next.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass

import pytest
import torch
from test_serving_ops import Attention, inputs, model_stream
from torch._inductor.compile_fx import compile_fx
from torch._inductor.utils import run_and_get_code
from torch.fx.passes.split_module import split_module

from ladder.serving import ops
from serving import TINY_LADDER_LAYERS, serve_env_vars, serve_python

# Needs vLLM's environment (.venv-serve), which `make test` builds: `make test-fast` skips it.
pytestmark = pytest.mark.envs

# What the model issues at TP > 1: every ladder attention output's reduction starts and is joined
# after the MLP; an MLP output's does where the next layer is a ladder one too (layer 2 here), and is
# joined after that layer's attention; the other MLP outputs are reduced at once.
ATTENTION_STARTS = len(TINY_LADDER_LAYERS)
MLP_STARTS = sum(layer + 1 in TINY_LADDER_LAYERS for layer in TINY_LADDER_LAYERS)


@pytest.fixture(scope="module")
def compiled_calls(vllm_greedy) -> list[str]:
    """The `call` function of each graph inductor built for the tiny ladder model at TP=2 (4 heads
    of 32: the smallest head vLLM's CPU attention takes), read from its run's own compile cache in
    the session's vLLM job (conftest's vllm_greedy)."""
    run = vllm_greedy["tiny-ladder-tp2"]
    assert run["compilation_mode"] != "NONE"
    codes = [path.read_text() for path in run["compile_cache"].rglob("*.py")]
    calls = [code[code.index("def call(") :] for code in codes if "torch.ops.ladder.all_reduce_start" in code]
    assert calls, "no compiled code with the ladder's all-reduce start"
    return calls


# --- Reading inductor's wrapper code ----------------------------------------------------------------

NAME = r"\b(?:buf\d+|arg\d+_\d+)\b"
LADDER_OP = re.compile(r"^(\w+) = torch\.ops\.ladder\.(\w+)\.default\((.*)\)$")
# vLLM's own all-reduce: the CPU build's in-place shared-memory one, the GPU build's custom op.
VLLM_REDUCTION = re.compile(
    r"^torch\.ops\._C\.shm_allreduce\.default\(\d+, (\w+)\)$|^(\w+) = torch\.ops\.vllm\.all_reduce\."
)
ATTENTION = re.compile(r"torch\.ops\.(?:vllm\.unified_attention\w*|ladder_test\.attention)\.default\(")
MATMUL = re.compile(r"onednn_mm\.default\((buf\d+)|extern_kernels\.a?d?d?mm\(.*out=(buf\d+)")
ALLOCATION = re.compile(rf"^({NAME}) = empty_strided")
ALIAS = re.compile(rf"^({NAME}) = ({NAME})$|^({NAME}) = reinterpret_tensor\(({NAME}),.*# alias$")
REUSE = re.compile(rf"^({NAME}) = (?:reinterpret_tensor\()?({NAME})\b.*; del \2\s+# reuse$")
DELETE = re.compile(rf"^del ({NAME})$")


@dataclass
class Step:
    """One statement of inductor's `call`: its kind, and the tensors (numbered as they come to exist,
    an alias sharing its source's number) it makes and reads."""

    line: int
    kind: str  # a ladder op's name, "vllm_reduction", "attention", "matmul", "reuse" or "free"
    out: int | None = None
    args: tuple[int, ...] = ()
    flag: bool = False  # all_reduce_start's spans_attention


def read_steps(call: str) -> list[Step]:
    tensors: dict[str, int] = {}  # name -> tensor
    names: dict[int, set[str]] = {}  # tensor -> its live names

    def tensor(name: str) -> int:
        if name not in tensors:  # a graph input, or a buffer inductor made
            tensors[name] = len(names)
            names[len(names)] = {name}
        return tensors[name]

    def new(name: str) -> int:
        tensors.pop(name, None)
        return tensor(name)

    steps = []
    for line, text in enumerate(call.splitlines()):
        text = text.strip()
        if match := LADDER_OP.match(text):
            args = tuple(tensor(name) for name in re.findall(NAME, match[3]))
            flag = match[3].rstrip().endswith("True")
            steps.append(Step(line, match[2], new(match[1]), args, flag))
        elif match := VLLM_REDUCTION.match(text):
            out = tensor(match[1]) if match[1] else new(match[2])
            steps.append(Step(line, "vllm_reduction", out))
        elif ATTENTION.search(text):
            steps.append(Step(line, "attention"))
        elif match := MATMUL.search(text):
            steps.append(Step(line, "matmul", tensor(match[1] or match[2])))
        elif match := REUSE.match(text):
            steps.append(Step(line, "reuse", args=(tensor(match[2]),)))
            names[tensors.pop(match[2])].discard(match[2])
            new(match[1])
        elif match := ALIAS.match(text):
            alias, source = (match[1], match[2]) if match[1] else (match[3], match[4])
            tensors[alias] = tensor(source)
            names[tensors[alias]].add(alias)
        elif match := DELETE.match(text):
            freed = tensor(match[1])
            names[tensors.pop(match[1])].discard(match[1])
            if not names[freed]:
                steps.append(Step(line, "free", args=(freed,)))
        elif match := ALLOCATION.match(text):
            new(match[1])
    return steps


def started_and_joined(steps: list[Step]) -> list[tuple[int, int | None]]:
    """(index of each all_reduce_start, index of the wait that takes its output, or None)."""
    pairs = []
    for index, step in enumerate(steps):
        if step.kind == "all_reduce_start":
            waits = (i for i in range(index + 1, len(steps)) if steps[i].kind == "all_reduce_wait")
            pairs.append((index, next((i for i in waits if steps[i].args[0] == step.out), None)))
    return pairs


def lifetime_problems(call: str) -> list[str]:
    """Where a start's input or output is freed or its memory reused before the wait that joins it:
    on a GPU the side stream may still read the input and write the output then."""
    steps = read_steps(call)
    problems = []
    for start, wait in started_and_joined(steps):
        if wait is None:
            problems.append(f"line {steps[start].line}: a start that no wait joins")
            continue
        for role, tensor in (("input", steps[start].args[0]), ("output", steps[start].out)):
            for step in steps[start + 1 : wait]:
                if step.kind in ("reuse", "free") and step.args == (tensor,):
                    problems.append(
                        f"line {steps[start].line}: the start's {role} is {'reused' if step.kind == 'reuse' else 'freed'} "
                        f"at line {step.line}, before its wait at line {steps[wait].line}"
                    )
        if not {steps[start].args[0], steps[start].out} <= set(steps[wait].args):
            problems.append(f"line {steps[wait].line}: the wait does not take its start's input and output")
    return problems


def ordering_problems(call: str) -> list[str]:
    """Where two reductions may run at once: one issued while a start is in flight, or a ladder
    reduction that does not take the previous reduction's result (nothing then keeps a compiler
    from moving it before that reduction, or the previous one after it)."""
    problems = []
    in_flight: Step | None = None
    last_sum: int | None = None  # the result of the last reduction, joined
    for step in read_steps(call):
        if step.kind in ("all_reduce_start", "all_reduce", "vllm_reduction"):
            if in_flight is not None:
                problems.append(f"line {step.line}: a reduction issued while the start at line {in_flight.line} runs")
            if step.kind != "vllm_reduction" and last_sum is not None and last_sum not in step.args[1:]:
                problems.append(f"line {step.line}: ladder.{step.kind} does not take the previous reduction's result")
            if step.kind == "all_reduce_start":
                in_flight = step
            else:
                last_sum = step.out
        elif step.kind == "all_reduce_wait":
            if in_flight is None or step.args[0] != in_flight.out:
                problems.append(f"line {step.line}: a wait for no start in flight")
            in_flight, last_sum = None, step.out
        elif step.kind == "fence" and step.args == (last_sum,):  # the same sum, copied
            last_sum = step.out
    return problems


def overlap_problems(call: str) -> list[str]:
    """Where a started reduction does not overlap the module it is for: an attention output's, the
    MLP's two projections, joined after the down projection; an MLP output's, the next layer's
    attention, joined after its o_proj. Compiled for every step: at run time the MLP output's start
    forks only in a full CUDA graph (test_mlp_reduction_forks_only_in_a_full_cuda_graph)."""
    steps = read_steps(call)
    problems = []
    counts = {False: 0, True: 0}
    for start, wait in started_and_joined(steps):
        if wait is None:
            continue
        spans_attention = steps[start].flag
        counts[spans_attention] += 1
        between = steps[start + 1 : wait]
        matmuls = [step.out for step in between if step.kind == "matmul"]
        attentions = sum(step.kind == "attention" for step in between)
        what = "an MLP output's" if spans_attention else "an attention output's"
        if attentions != spans_attention or len(matmuls) < 2:
            problems.append(
                f"line {steps[start].line}: {what} reduction spans {attentions} attention(s) and {len(matmuls)} matmuls"
            )
        elif steps[wait].args[-1] != matmuls[-1]:
            problems.append(f"line {steps[wait].line}: {what} wait does not take the last projection's output")
    if counts != {False: ATTENTION_STARTS, True: MLP_STARTS}:
        problems.append(f"starts (attention, MLP): {counts[False]}, {counts[True]}")
    return problems


# --- The tests --------------------------------------------------------------------------------------


def test_started_reductions_keep_their_buffers_until_joined(compiled_calls):
    """Issue 36 item 1: inductor reused the start's input (`buf30 = buf19; del buf19  # reuse`) for
    the MLP's activations while the side stream still read it: wrong tokens at TP > 1, compiled."""
    assert [problem for call in compiled_calls for problem in lifetime_problems(call)] == []


def test_reductions_run_one_at_a_time_in_program_order(compiled_calls):
    """Issue 36 item 2: vLLM's custom all-reduce has one staging buffer and assumes one call at a
    time; nothing ordered the MLP output's reduction after the wait, or a layer's start after the
    previous layer's reduction."""
    assert [problem for call in compiled_calls for problem in ordering_problems(call)] == []


def test_each_started_reduction_overlaps_its_module(compiled_calls):
    """Issue 36 item 3: an MLP output's reduction between two ladder layers starts before the next
    attention and is joined after it; an attention output's is joined after the MLP. Every ladder
    reduction is still its own op (no compile pass merged or dropped one)."""
    assert [problem for call in compiled_calls for problem in overlap_problems(call)] == []
    for call in compiled_calls:  # one per rank
        ops = [step.kind for step in read_steps(call)]
        assert ops.count("all_reduce") == len(TINY_LADDER_LAYERS) - MLP_STARTS  # the MLP outputs reduced at once


def test_mlp_reduction_forks_only_in_a_full_cuda_graph():
    """What the MLP output's start asks vLLM about the step, run in vLLM's environment: only a full
    CUDA graph (a uniform decode batch under FULL_AND_PIECEWISE) holds the next attention, so only
    there may the reduction run beside it; piecewise graphs split at attention, and eager steps
    outside a forward context (profiling) stay synchronous as well."""
    script = """
import json
from vllm.config import CUDAGraphMode
from vllm.forward_context import ForwardContext, override_forward_context
from ladder.serving.model import _may_span_attention

answers = {"no forward context": _may_span_attention()}
for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
    context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}, cudagraph_runtime_mode=mode)
    with override_forward_context(context):
        answers[mode.name] = _may_span_attention()
print(json.dumps(answers))
"""
    completed = subprocess.run(
        [str(serve_python()), "-c", script], env=serve_env_vars(), capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    answers = json.loads(completed.stdout.strip().splitlines()[-1])
    assert answers == {"no forward context": False, "NONE": False, "PIECEWISE": False, "FULL": True}


# --- vLLM's GPU compile path, read on a CPU -----------------------------------------------------------
# On a GPU, vLLM's VllmBackend splits the Dynamo graph at each attention op (compilation/backends.py,
# split_graph) and inductor compiles each other piece on its own; the CPU build never splits
# (DYNAMO_TRACE_ONCE, vllm/platforms/cpu.py), so this emulates the split in-process, on the vLLM
# model's own layer loop and ops (ladder.serving.ops) with layers of vLLM's interface
# (tests/test_serving_ops.py) whose attention is an opaque op, as vLLM's is.

_ATTENTION_LIBRARY = torch.library.Library("ladder_test", "DEF")
_ATTENTION_LIBRARY.define("attention(Tensor x) -> Tensor")
_ATTENTION_LIBRARY.impl("attention", torch.tanh, "CompositeExplicitAutograd")
torch.library.register_fake("ladder_test::attention", torch.empty_like, lib=_ATTENTION_LIBRARY)


class OpaqueAttention(Attention):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.ops.ladder_test.attention(hidden_states @ self.weight + positions[:, None] / len(positions))


def piecewise_call(function, *arguments) -> str:
    """`function` as vLLM's piecewise backend compiles it: its Dynamo graph split at each attention op
    (a piece of its own, run as it is), each other piece compiled by inductor, and the pieces run
    one after another by the split graph. Returned as one `call` for the readers: the pieces' code
    with their buffers renamed apart, each value the split graph hands on under one name
    (`arg<node>_1`), aliased by the names a piece gives it and held until after the last piece that
    takes it, as the split graph holds it."""
    graphs, attention = [], (torch.ops.ladder_test.attention, torch.ops.ladder_test.attention.default)
    torch._dynamo.reset()
    with torch.no_grad():  # as vLLM runs the model
        torch.compile(function, backend=lambda graph, inputs: graphs.append((graph, inputs)) or graph.forward)(
            *arguments
        )
    ((graph, graph_inputs),) = graphs
    piece, pieces = 0, {}
    for node in graph.graph.nodes:  # as vLLM's split_graph: each attention op a piece of its own
        is_attention = node.target in attention
        pieces[node] = piece = piece + is_attention
        piece += is_attention
    split = split_module(graph, None, pieces.__getitem__, keep_original_order=True, tuple_return=True)
    piece_inputs = {}

    class Recorder(torch.fx.Interpreter):
        def call_module(self, target, args, kwargs):
            piece_inputs[target] = args
            return super().call_module(target, args, kwargs)

    with torch.no_grad():
        Recorder(split).run(*graph_inputs)
    name = {node: f"arg{index}_1" for index, node in enumerate(split.graph.nodes)}
    calls = [node for node in split.graph.nodes if node.op == "call_module"]
    last_use = {value: index for index, node in enumerate(calls) for value in node.args}
    lines = []
    for index, node in enumerate(calls):
        piece = getattr(split, node.target)
        outputs = {user.args[1]: name[user] for user in node.users}
        if any(inner.target in attention for inner in piece.graph.nodes):
            lines.append(f"{outputs[0]} = torch.ops.ladder_test.attention.default({name[node.args[0]]})")
        else:
            with torch.no_grad():
                _, (code,) = run_and_get_code(compile_fx, piece, list(piece_inputs[node.target]))
            call = code[code.index("def call(") :].splitlines()
            call = call[1 : next(i for i, line in enumerate(call[1:], 1) if line and not line[0].isspace())]

            def local(match: re.Match, index: int = index) -> str:
                return f"buf{index}0{match[1]}" if match[0].startswith("buf") else f"{match[0]}00{index}"

            body = [re.sub(r"\b(?:buf(\d+)|arg\d+_\d+)\b", local, line.strip()) for line in call]
            lines += [f"arg{argument}_100{index} = {name[value]}" for argument, value in enumerate(node.args)]
            lines += [line for line in body if not line.startswith(("return", "assert_", "args.clear"))]
            returned = next(line for line in body if line.startswith("return ("))
            lines += [f"{outputs[at]} = {word}" for at, word in enumerate(re.findall(NAME, returned)) if at in outputs]
            live = {word for line in body for word in re.findall(NAME, line)}
            deleted = {word for line in body for word in re.findall(rf"^del ({NAME})$", line)}
            lines += [f"del {word}" for word in sorted(live - deleted)]  # the piece's own names end with it
        lines += [f"del {name[value]}" for value in node.args if last_use[value] == index]
    return "\n".join(["def call(args):", *lines])


def broken_wait(self, after):  # does not take the start's input: nothing keeps it alive
    return torch.ops.ladder.all_reduce_wait(self.reduced, self.reduced, after)


def broken_start(cls, partial, after, spans_attention=False):  # not after the previous reduction
    return cls(torch.ops.ladder.all_reduce_start(partial, None, spans_attention), partial)


@pytest.mark.parametrize("chaining", ["as built", "wait without the start's input", "start after nothing"])
def test_piecewise_readers_see_reductions_across_attention(chaining, monkeypatch):
    """Issue 42 item 3: an MLP output's reduction starts in one piece and is joined in the next, after
    the attention between them: its input and output must live across the boundary, and reductions
    keep program order across pieces. Each reader fails on the chaining broken as it guards."""
    if chaining == "wait without the start's input":
        monkeypatch.setattr(ops.InFlight, "wait", broken_wait)
    elif chaining == "start after nothing":
        monkeypatch.setattr(ops.InFlight, "start", classmethod(broken_start))
    layers, positions, x = inputs(torch.device("cpu"))
    layers = layers[2:4]  # ladder -> ladder: layer 2's MLP reduction overlaps layer 3's attention
    for layer in layers:
        layer.self_attn.__class__ = OpaqueAttention
    call = piecewise_call(model_stream, layers, positions, x)
    steps = read_steps(call)
    pairs = [(start, wait) for start, wait in started_and_joined(steps) if wait is not None]
    assert any(step.kind == "attention" for start, wait in pairs for step in steps[start:wait]), "none across a piece"
    problems = {"lifetime": lifetime_problems(call), "ordering": ordering_problems(call)}
    expected = {"as built": set(), "wait without the start's input": {"lifetime"}, "start after nothing": {"ordering"}}
    assert {reader for reader, found in problems.items() if found} == expected[chaining], problems
