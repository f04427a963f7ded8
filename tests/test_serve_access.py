"""Who can reach `ladder serve`: never an address beyond this machine without an API key.

`ladder serve` reads the arguments it passes on to `vllm serve` with vLLM's own parser, so that an
option spelled as vLLM takes it (a prefix, `_` for `-`, the last of several) cannot open the server
beyond loopback, and a key counts as vLLM counts it (an empty `--api-key` asks no key and hides
$VLLM_API_KEY). The table runs in .venv-serve; the live test starts one real server on the
embedded SmolLM2 at a non-loopback address of a network namespace it makes, and checks that the
key is asked on every path, not only on those vLLM guards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ladder.errors import UsageError
from ladder.serving.engine import cpu_kv_cache_space, gpu_memory_utilization
from serving import serve_env_vars, serve_python
from tiny import save_tiny_checkpoint

# Needs vLLM's environment (.venv-serve), which `make test` builds: `make test-fast` skips it.
pytestmark = pytest.mark.envs

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
    "passthrough -tp": (["--", "-tp", "3"], "at TP=3"),  # 4 heads do not split over 3 ranks
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
        directory, smollm2_tokenizer_dir, num_hidden_layers=2, hidden_size=128, num_attention_heads=4
    )


@pytest.fixture(scope="module")
def outcomes(servable_checkpoint, tmp_path_factory) -> dict[str, dict]:
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
    env = serve_env_vars()
    env.pop("VLLM_API_KEY", None)
    done = subprocess.run(
        [str(serve_python()), "-c", RUN_ROWS, json.dumps(rows)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    return dict(zip([*REFUSALS, *ACCEPTED, *RUN_REFUSALS, *RUN_ACCEPTED, "sized"], results, strict=True))


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


# --- a live server on a non-loopback address ----------------------------------------------------------

ADDRESS = "10.37.0.1"  # inside the namespace the test makes; nothing outside it sees the address
PORT = 8000

# Run inside the namespace (both address the server as a client elsewhere would): whether /health
# answers, and a completion with no key, with a wrong key and with the key.
HEALTH = """
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/health", timeout=5) as response:
    sys.exit(response.status != 200)
"""
CLIENT = """
import json, sys, urllib.error, urllib.request

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
print(json.dumps({
    "no key": post("/v1/completions", None, prompt=prompt),
    "wrong key": post("/v1/completions", "not-" + key, prompt=prompt),
    "key": post("/v1/completions", key, prompt=prompt),
    # vLLM's own key guards /v1, /v2, /inference and /cohere only: SageMaker's /invocations answers
    # the same completions, and /tokenize reads the model's tokenizer.
    "invocations, no key": post("/invocations", None, prompt=prompt),
    "tokenize, no key": post("/tokenize", None, prompt=prompt),
}))
"""


def ip(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *arguments], capture_output=True, text=True, timeout=60)


@pytest.fixture
def namespace():
    """A network namespace with loopback and a veth pair, one end at ADDRESS; deleted afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed: it makes the test's network namespace")
    name = f"ladder-test-{os.getpid()}"
    made = ip("netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace here (root with CAP_NET_ADMIN): {made.stderr.strip()}")
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


def test_served_beyond_loopback_answers_only_with_the_key(namespace, tmp_path, smollm2_ladder):
    """The embedded SmolLM2 (ladder, conftest's smollm2_ladder) served at a veth address with `--api-key`: a
    completion with no key or a wrong one gets 401, and so do /invocations and /tokenize with no key
    (they answered before KeyOnEveryPath); one with the key gets an answer."""
    model = smollm2_ladder
    log_path = tmp_path / "server.log"
    serve = [str(REPO / ".venv-serve" / "bin" / "ladder"), "serve", str(model), "--host", ADDRESS]
    serve += ["--api-key", KEY, "--", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
    with open(log_path, "w") as log:
        # `ip netns exec` becomes the command, which becomes `vllm serve`: one process id throughout.
        server = subprocess.Popen(
            ["ip", "netns", "exec", namespace, *serve],
            env=serve_env_vars(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://{ADDRESS}:{PORT}"
    in_namespace = ["ip", "netns", "exec", namespace, sys.executable, "-c"]
    try:
        deadline = time.monotonic() + 600
        while subprocess.run([*in_namespace, HEALTH, base], capture_output=True, timeout=60).returncode != 0:
            assert server.poll() is None, (
                f"the server exited with status {server.returncode}: " + log_path.read_text()[-3000:]
            )
            assert time.monotonic() < deadline, "the server did not answer /health within 600 s"
            time.sleep(2)
        reply = subprocess.run(
            [*in_namespace, CLIENT, base, KEY, model.name], capture_output=True, text=True, timeout=600
        )
        assert reply.returncode == 0, (reply.stderr, log_path.read_text()[-3000:])
        answers = json.loads(reply.stdout.strip().splitlines()[-1])
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    for refused in ("no key", "wrong key", "invocations, no key", "tokenize, no key"):
        assert answers[refused]["status"] == 401, (refused, answers)
    assert answers["key"]["status"] == 200, answers
    completion = answers["key"]["body"]
    assert completion["usage"]["completion_tokens"] > 0 and isinstance(completion["choices"][0]["text"], str)
    assert base in log_path.read_text()  # vLLM's own report of where it listens


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
