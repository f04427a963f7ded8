"""Who can reach `ladder serve`: never an address beyond this machine without an API key.

`ladder serve` reads the arguments it passes on to `vllm serve` with vLLM's own parser, so that an
option spelled as vLLM takes it (a prefix, `_` for `-`, the last of several) cannot open the server
beyond loopback, and a key counts as vLLM counts it (an empty `--api-key` asks no key and hides
$VLLM_API_KEY). The table runs in .venv-serve; the live test starts the suite's one real server,
`make serve` on the embedded SmolLM2, at a non-loopback address of a network namespace it makes
(on loopback where it cannot make one), checks that the key is asked on every path, not only on
those vLLM guards, and that SIGTERM stops it cleanly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ladder.errors import UsageError
from ladder.launch import free_port
from ladder.serving.engine import cpu_kv_cache_space, gpu_memory_utilization
from serving import serve_env_vars, serve_python
from tiny import save_tiny_checkpoint

# Needs vLLM's environment (.venv-serve), which `make test` builds: `make test-fast` skips it. The
# session's vLLM jobs (conftest's vllm_jobs, those its tests need) start first: they compile while
# this file's `.venv-serve` processes start, which leave a core idle most of the time.
pytestmark = [pytest.mark.envs, pytest.mark.usefixtures("vllm_jobs")]

REPO = Path(__file__).resolve().parents[1]
KEY = "ladder-test-key"
REFUSED = "listens beyond this machine: give an API key"

# `ladder serve MODEL --check-only ARGS`, with $VLLM_API_KEY set to ENV_KEY where given (unset
# otherwise): refused, or let through to vLLM's checkpoint check. The first two refusals were
# issue 37's bypasses, served with no key on every interface.
REFUSALS = {
    "an option prefix vLLM takes": ["--", "--hos", "0.0.0.0"],
    "an empty passthrough key": ["--host", "0.0.0.0", "--", "--api-key="],
    "an empty passthrough key over ours": ["--host", "0.0.0.0", "--api-key", KEY, "--", "--api-key", ""],
    "an empty key hides $VLLM_API_KEY (underscore spelling)": ["--", "--host", "0.0.0.0", "--api_key", "", "ENV_KEY"],
    "every IPv4 interface": ["--host", "0.0.0.0"],
    "every IPv6 interface": ["--host", "::"],
    "a host name": ["--host", "example.org"],
    "our empty key": ["--host", "10.1.2.3", "--api-key", ""],
    "passthrough host": ["--", "--host", "0.0.0.0"],
    "passthrough host=": ["--", "--host=::"],
    "an empty host: every interface": ["--", "--host", ""],
    "the last of several hosts": ["--", "--host", "127.0.0.1", "--host", "10.1.2.3"],
}
ACCEPTED = {
    "loopback by default": [],
    "another loopback address": ["--", "--host", "127.0.0.2"],
    "IPv6 loopback": ["--host", "::1"],
    "localhost": ["--host", "localhost"],
    "every interface with our key": ["--host", "0.0.0.0", "--api-key", KEY],
    "prefixes with a key": ["--", "--hos", "0.0.0.0", "--api-k", KEY],
    "every interface with $VLLM_API_KEY": ["--", "--host", "0.0.0.0", "ENV_KEY"],
    "a Unix socket (host ignored)": ["--host", "0.0.0.0", "--", "--uds", "UDS"],
}
# What vLLM will run, as its parser reads the passthrough (issue 43 item 1): refused in one line
# containing the text given, or checked at the TP degree vLLM will run. Its gRPC server reads neither
# --api-key nor --uds and binds host:port (every interface for ""); its extra is not in .venv-serve.
RUN_REFUSALS = {
    "gRPC beyond loopback, with a key": (["--host", "0.0.0.0", "--api-key", KEY, "--", "--grpc"], "asks no API key"),
    "gRPC with a Unix socket": (["--host", "0.0.0.0", "--", "--uds", "UDS", "--grpc"], "asks no API key"),
    "gRPC on loopback, not installed": (["--", "--grpc"], "vLLM's gRPC server is not installed"),
    "our --tp": (["--tp", "3"], "attention heads are not divisible by TP=3"),  # 4 heads do not split over 3
    "passthrough -tp": (["--", "-tp", "3"], "at TP=3"),
    "passthrough --tensor-parallel-size": (["--", "--tensor-parallel-size", "3"], "at TP=3"),
    "a prefix of --tensor-parallel-size": (["--tp", "2", "--", "--tensor-p", "3"], "at TP=3"),
    "port above 65535": (["--", "--port", "70000"], "--port 70000: a port is"),
    "negative port": (["--", "--port", "-1"], "--port -1: a port is"),
    "our port above 65535": (["--port", "70000"], "--port 70000: a port is"),
    "passthrough --model": (["--", "--model", "other"], "give no other (--model)"),
    "--model=": (["--", "--model=other"], "give no other (--model)"),
    "a second positional model": (["--", "other"], "give no other (--model)"),
}
RUN_ACCEPTED = {
    "the passthrough TP over ours": (["--tp", "3", "--", "-tp", "1"], "at TP=1 "),
    "passthrough TP 2": (["--", "-tp", "2"], "at TP=2 "),
}

# Every row in one .venv-serve process (importing vLLM takes 10-20 s): `ladder serve` as the CLI
# runs it, each row with the session's environment plus its own key.
RUN_ROWS = """
import contextlib, io, json, os, sys
from ladder.cli import main

rows, base = json.loads(sys.argv[1]), dict(os.environ)
results = []
for argv, env in rows:
    os.environ.clear()
    os.environ.update(base, **env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    results.append({"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def servable_checkpoint(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """A tiny Llama that vLLM's CPU backend serves: heads 32 wide (the smallest its attention takes)."""
    directory = tmp_path_factory.mktemp("servable-llama")
    return save_tiny_checkpoint(
        directory, smollm2_tokenizer_dir, num_hidden_layers=2, hidden_size=128, num_attention_heads=4, head_dim=32
    )


@pytest.fixture(scope="module")
def outcomes(servable_checkpoint, family_checkpoints, tiny_checkpoint, tmp_path_factory) -> dict[str, dict]:
    uds = tmp_path_factory.mktemp("uds") / "server.sock"
    rows = []
    run = [arguments for arguments, _ in [*RUN_REFUSALS.values(), *RUN_ACCEPTED.values()]]
    for arguments in [*REFUSALS.values(), *ACCEPTED.values(), *run, []]:
        env = {"VLLM_API_KEY": KEY} if "ENV_KEY" in arguments else {}
        arguments = [str(uds) if arg == "UDS" else arg for arg in arguments if arg != "ENV_KEY"]
        ours = arguments[: arguments.index("--")] if "--" in arguments else arguments
        rest = arguments[len(ours) :]
        rows.append((["serve", str(servable_checkpoint), *ours, "--check-only", *rest], env))
    rows[-1][1]["VLLM_CPU_KVCACHE_SPACE"] = ""  # unset, as vLLM reads it: `ladder serve` sizes it
    rows.append((["serve", str(tiny_checkpoint), "--check-only"], {}))  # heads 16 wide
    rows.append((["serve", str(family_checkpoints["qwen3-ladder"]), "--check-only"], {}))  # tests/family_engines.py
    env = serve_env_vars()
    env.pop("VLLM_API_KEY", None)
    done = subprocess.run(
        [str(serve_python()), "-c", RUN_ROWS, json.dumps(rows)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    names = [*REFUSALS, *ACCEPTED, *RUN_REFUSALS, *RUN_ACCEPTED, "sized", "head size 16", "qwen3"]
    return dict(zip(names, results, strict=True))


@pytest.mark.parametrize("case", REFUSALS)
def test_serve_refuses_to_listen_beyond_this_machine_without_a_key(outcomes, case):
    outcome = outcomes[case]
    assert outcome["status"] == 2, (case, outcome)
    (line,) = outcome["stderr"].strip().splitlines()
    assert line.startswith("ladder serve: error: --host ") and REFUSED in line, line


@pytest.mark.parametrize("case", ACCEPTED)
def test_serve_listens_on_loopback_or_with_a_key(outcomes, case):
    outcome = outcomes[case]
    assert outcome["status"] == 0, (case, outcome)
    assert "vLLM can serve" in outcome["stdout"], outcome


@pytest.mark.parametrize("case", RUN_REFUSALS)
def test_serve_refuses_what_vllm_would_run_wrong(outcomes, case):
    outcome, expected = outcomes[case], RUN_REFUSALS[case][1]
    assert outcome["status"] == 2, (case, outcome)
    (line,) = outcome["stderr"].strip().splitlines()
    assert line.startswith("ladder serve: error: ") and expected in line, line


@pytest.mark.parametrize("case", RUN_ACCEPTED)
def test_serve_checks_the_tp_degree_vllm_will_run(outcomes, case):
    outcome = outcomes[case]
    assert outcome["status"] == 0, (case, outcome)
    assert RUN_ACCEPTED[case][1] in outcome["stdout"], outcome


def test_serve_sizes_the_kv_cache_for_this_machine(outcomes, servable_checkpoint):
    """Issue 44 items 1 and 9: without VLLM_CPU_KVCACHE_SPACE vLLM reserves 92% of the machine's
    memory and refuses to start where more than 8% is in use; `ladder serve` sets it from the
    memory available. Clients name the model by its folder's name, not its path."""
    outcome = outcomes["sized"]
    assert outcome["status"] == 0, outcome
    assert f" as {servable_checkpoint.name} (VLLM_CPU_KVCACHE_SPACE=" in outcome["stdout"], outcome


def test_serve_pre_check_refuses_a_head_size_the_cpu_attention_cannot_run(outcomes):
    """The tiny checkpoint's heads are 16 wide: vLLM's CPU attention has no kernel for that, the
    pre-check passed it, and the first request killed the engine."""
    outcome = outcomes["head size 16"]
    assert outcome["status"] == 2, outcome
    (line,) = outcome["stderr"].strip().splitlines()
    assert "attention head size is 16, and vLLM's CPU attention runs 32, 64" in line, line


def test_serve_checks_a_converted_qwen3(outcomes, family_checkpoints):
    """Every family goes through the same `ladder serve` (tests/test_vllm_families.py runs each in
    vLLM; the live server below stands for every family's HTTP layer): a converted Qwen3 passes its
    checks, vLLM's engine configuration included, which resolves the architecture by the plugin."""
    outcome = outcomes["qwen3"]
    assert outcome["status"] == 0, outcome
    assert f"vLLM can serve {family_checkpoints['qwen3-ladder']} at TP=1 as qwen3-ladder" in outcome["stdout"], outcome


# --- one live server: `make serve`, beyond loopback with a key, stopped by SIGTERM ----------------------

ADDRESS = "10.37.0.1"  # inside the namespace the test makes; nothing outside it sees the address
PORT = 8000

# Run where the server's clients are (inside the namespace, if any), in .venv-serve (the `openai`
# client): whether /health answers; then a completion with no key, with a wrong key, on the paths
# vLLM's own key does not guard, and a chat completion with the key through the `openai` client.
HEALTH = """
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/health", timeout=5) as response:
    sys.exit(response.status != 200)
"""
CLIENT = """
import json, sys, urllib.error, urllib.request
from openai import OpenAI

base, key, model = sys.argv[1:4]

def post(path, key, **fields):
    body = json.dumps({"model": model, "max_tokens": 4} | fields).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": "Bearer " + key} if key else {})
    request = urllib.request.Request(base + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return {"status": response.status, "body": json.loads(response.read())}
    except urllib.error.HTTPError as error:
        return {"status": error.code, "body": error.read().decode()}

prompt = "The capital of France is"
client = OpenAI(base_url=base + "/v1", api_key=key)
listed = client.models.list().data[0].id
reply = client.chat.completions.create(
    model=listed, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0.0,
)
print(json.dumps({
    "no key": post("/v1/completions", None, prompt=prompt),
    "wrong key": post("/v1/completions", "not-" + key, prompt=prompt),
    # vLLM's own key guards /v1, /v2, /inference and /cohere only: SageMaker's /invocations answers
    # the same completions, and /tokenize reads the model's tokenizer.
    "invocations, no key": post("/invocations", None, prompt=prompt),
    "tokenize, no key": post("/tokenize", None, prompt=prompt),
    "chat": {"model": listed, "content": reply.choices[0].message.content,
             "finish_reason": reply.choices[0].finish_reason, "completion_tokens": reply.usage.completion_tokens},
}))
"""


def ip(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *arguments], capture_output=True, text=True, timeout=60)


@pytest.fixture
def namespace():
    """A network namespace with loopback and a veth pair, one end at ADDRESS, deleted afterwards; None
    where this machine cannot make one (no iproute2, or not root with CAP_NET_ADMIN)."""
    name = f"ladder-test-{os.getpid()}"
    if shutil.which("ip") is None or ip("netns", "add", name).returncode != 0:
        yield None
        return
    try:
        for command in (
            ["link", "set", "lo", "up"],
            ["link", "add", "ladder0", "type", "veth", "peer", "name", "ladder1"],
            ["addr", "add", f"{ADDRESS}/24", "dev", "ladder0"],
            ["link", "set", "ladder0", "up"],
            ["link", "set", "ladder1", "up"],
        ):
            done = ip("-n", name, *command)
            assert done.returncode == 0, f"ip -n {name} {' '.join(command)}: {done.stderr}"
        yield name
    finally:
        deadline = time.monotonic() + 60
        while pids := ip("netns", "pids", name).stdout.split():  # the server's processes, once stopped
            if time.monotonic() > deadline:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):  # it may have exited since
                        os.kill(int(pid), signal.SIGKILL)
            time.sleep(1)
        assert ip("netns", "delete", name).returncode == 0


def test_make_serve_answers_only_with_the_key_and_stops_on_sigterm(namespace, tmp_path, smollm2_ladder):
    """`make serve` on the embedded SmolLM2 (ladder, conftest's smollm2_ladder) with `--api-key` and,
    where this machine can make a network namespace, `--host` at a veth address in it (else on
    loopback), both in ARGS (vLLM's spelling, which `ladder serve` reads), and no
    VLLM_CPU_KVCACHE_SPACE (`ladder serve` sizes it). A completion with no key or a wrong one gets
    401, and so do /invocations and /tokenize with no key (they answered before KeyOnEveryPath); a
    chat completion with the key through the `openai` client gets an answer from the model named by
    its folder. Then SIGTERM to the server (what a process manager sends) stops every process of it
    without a traceback or triton's leak report, none killed (`ladder serve` gives vLLM a shutdown
    grace period). (Ctrl-C, SIGINT to the whole group, also stops it, but vLLM's engine process then
    exits before its API server and the server logs the dead engine.)"""
    host, port = (ADDRESS, PORT) if namespace else ("127.0.0.1", free_port())
    in_namespace = ["ip", "netns", "exec", namespace] if namespace else []
    log_path = tmp_path / "server.log"
    args = f"--dtype float32 --max-model-len 512 --enforce-eager --host {host} --api-key {KEY}"
    serve = ["make", "--no-print-directory", "serve", f"MODEL={smollm2_ladder}", f"PORT={port}", f"ARGS={args}"]
    env = {name: value for name, value in serve_env_vars().items() if name != "VLLM_CPU_KVCACHE_SPACE"}
    with open(log_path, "w") as log:
        # `ip netns exec` becomes make, whose child is `ladder serve`, which becomes `vllm serve`.
        server = subprocess.Popen(
            [*in_namespace, *serve], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://{host}:{port}"
    client = [*in_namespace, str(serve_python()), "-c"]
    try:
        deadline = time.monotonic() + 600
        while subprocess.run([*client, HEALTH, base], capture_output=True, timeout=60).returncode != 0:
            assert server.poll() is None, (
                f"the server exited with status {server.returncode}: " + log_path.read_text()[-3000:]
            )
            assert time.monotonic() < deadline, "the server did not answer /health within 600 s"
            time.sleep(2)
        reply = subprocess.run(
            [*client, CLIENT, base, KEY, smollm2_ladder.name],
            env=serve_env_vars(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert reply.returncode == 0, (reply.stderr[-3000:], log_path.read_text()[-3000:])
        answers = json.loads(reply.stdout.strip().splitlines()[-1])
    finally:
        if server.poll() is None:
            # make's child is `ladder serve`, which became `vllm serve` (same process)
            for pid in subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split():
                os.kill(int(pid), signal.SIGTERM)
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
                raise AssertionError("the server did not stop within 120 s of SIGTERM") from None
    for refused in ("no key", "wrong key", "invocations, no key", "tokenize, no key"):
        assert answers[refused]["status"] == 401, (refused, answers)
    chat = answers["chat"]
    assert chat["model"] == smollm2_ladder.name  # its folder's name, not its path
    assert chat["completion_tokens"] > 0 and isinstance(chat["content"], str)
    assert chat["finish_reason"] in ("length", "stop")
    log_text = log_path.read_text()
    assert server.returncode == 0, log_text[-3000:]
    assert base in log_text  # vLLM's own report of where it listens
    assert "Resolved architecture: LadderLlamaForCausalLM" in log_text
    assert "Traceback" not in log_text, log_text[-3000:]
    # Each process exited on its own: none was killed, nothing of theirs was left to clean up.
    assert "force killing" not in log_text and "leaked shared_memory" not in log_text, log_text[-3000:]
    assert "nanobind: leaked" not in log_text, log_text[-3000:]
    deadline = time.monotonic() + 60  # the engine and worker processes exit just after the API server
    while leftovers := subprocess.run(["pgrep", "-g", str(server.pid)], capture_output=True, text=True).stdout.split():
        assert time.monotonic() < deadline, f"processes of the server still running 60 s after shutdown: {leftovers}"
        time.sleep(1)
    with pytest.raises(subprocess.CalledProcessError):  # nothing listens on the port any more
        subprocess.run([*client, HEALTH, base], capture_output=True, timeout=60, check=True)


def test_serve_sizes_memory_or_refuses_in_one_line():
    """Issue 44 item 1, the rule: half of the memory left beside the weights and vLLM's processes
    for the KV cache on a CPU, the free share of a GPU; a line naming the setting where none fits."""
    gib = 1 << 30
    assert cpu_kv_cache_space(12 * gib, gib // 4, tp=1) == 3  # (12 - 0.25 - 4) / 2
    assert cpu_kv_cache_space(12 * gib, gib // 4, tp=2) == 1  # (12 - 0.25 - 6) / 2 / 2
    with pytest.raises(UsageError, match=r"no room for a KV cache .*VLLM_CPU_KVCACHE_SPACE"):
        cpu_kv_cache_space(5 * gib, gib, tp=1)
    assert gpu_memory_utilization(free=40 * gib, total=80 * gib, weights=16 * gib, tp=1) == 0.48
    assert gpu_memory_utilization(free=80 * gib, total=80 * gib, weights=16 * gib, tp=1) == 0.92  # vLLM's default
    with pytest.raises(UsageError, match="--gpu-memory-utilization"):
        gpu_memory_utilization(free=10 * gib, total=80 * gib, weights=16 * gib, tp=1)
