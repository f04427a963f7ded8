"""`ladder serve MODEL [--tp N] [--host H] [--port P] [--api-key KEY] [-- VLLM_ARGS...]`: checks in
one line what vLLM would refuse only after starting (checkpoint, arguments, address, memory), then
replaces itself with `vllm serve` (docs/serving.md)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import ipaddress
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from ladder.cli_types import positive_int
from ladder.errors import ArgumentParser, UsageError, first_line
from ladder.io.loading import HUB_MODEL_ID, check_checkpoint, read_config_dict, resolve_model_path
from ladder.serving.engine import (
    cpu_binding,
    cpu_kv_cache_space,
    gpu_memory_utilization,
    vllm_error_message,
    vllm_version_problem,
)
from ladder.tp.degrees import vllm_refusal

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
API_KEY_VARIABLE = "VLLM_API_KEY"  # what vLLM's own --api-key option defaults to
# Seconds in-flight requests may finish after SIGTERM. vLLM's default, 0, sends the engine SIGTERM
# and SIGKILL at once, which leaks its shared memory and semaphores.
SHUTDOWN_TIMEOUT = 30
# Set for the server's processes; the plugin (ladder/serving/plugin.py) then applies `quiet_engine_shutdown`.
SERVE_ENV_FLAG = "LADDER_SERVE"


def quiet_engine_shutdown() -> None:
    """Work around vLLM's shutdown race (vllm-project/vllm#48745): on SIGTERM the output handler reads
    the stopped engine's EngineDeadError and the server exits with status 1 and a traceback. Once
    shutdown has started, that error waits for the handler's cancellation instead. Applied once per
    process: vLLM loads its plugins once (vllm.plugins.load_general_plugins)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import AsyncMPClient
    from vllm.v1.engine.exceptions import EngineDeadError

    shutdown, get_output_async = AsyncLLM.shutdown, AsyncMPClient.get_output_async

    def quiet_shutdown(self: AsyncLLM, *args, **kwargs) -> None:
        if getattr(self, "engine_core", None) is not None:
            self.engine_core.shutting_down = True
        return shutdown(self, *args, **kwargs)

    async def outputs(self: AsyncMPClient):
        try:
            return await get_output_async(self)
        except EngineDeadError:
            if getattr(self, "shutting_down", False):
                await asyncio.Event().wait()  # cancelled by the shutdown in progress
            raise

    AsyncLLM.shutdown, AsyncMPClient.get_output_async = quiet_shutdown, outputs


def drop_exit_leak_reports() -> None:
    """An exit handler: drop nanobind's leak report (about 30 lines of "nanobind: leaked ..." per vLLM
    process: triton objects alive at interpreter exit, which is no leak) from this process's stderr."""
    sys.stderr.flush()
    report = r"^(nanobind: | - leaked | - \.\.\. skipped remainder|See https://nanobind\.readthedocs\.io/)"
    grep = subprocess.Popen(["grep", "--line-buffered", "-v", "-E", report], stdin=subprocess.PIPE, stdout=2)
    os.dup2(grep.stdin.fileno(), 2)
    grep.stdin.close()


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="ladder serve",
        description="Serve a ladder or Llama checkpoint with vLLM's OpenAI-compatible server. "
        "Arguments after `--` go to `vllm serve` as they are.",
    )
    parser.add_argument("model", metavar="MODEL", help="checkpoint directory (safetensors)")
    parser.add_argument(
        "--tp", type=positive_int, default=1, metavar="N", help="tensor-parallel degree: worker processes (default 1)"
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=positive_int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VARIABLE),
        help=f"the key clients must send (vLLM's --api-key; default ${API_KEY_VARIABLE}); "
        "needed to listen on an address other than loopback",
    )
    parser.add_argument("--check-only", action="store_true", help="check that vLLM can serve the checkpoint, then exit")
    return parser


def vllm_serve_arguments(model: Path, args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    """The arguments of `vllm serve`: ours first, so that the passthrough overrides them (argparse
    keeps the last)."""
    ours = ["--host", args.host, "--port", str(args.port), "--tensor-parallel-size", str(args.tp)]
    # The name clients send: a Hub ID as given, else the folder's name (vLLM's default is the path).
    hub_id = HUB_MODEL_ID.fullmatch(args.model) and not Path(args.model).expanduser().exists()
    ours += ["--served-model-name", args.model if hub_id else model.name]
    ours += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--middleware", f"{__name__}.{KeyOnEveryPath.__name__}"]
    return [str(model), *ours, *passthrough]


def parse_vllm_serve(arguments: list[str]) -> argparse.Namespace:
    """`arguments` as `vllm serve` reads them, with its own parser (option prefixes, `_` for `-`, the
    last of a repeated option, `--config FILE`): no other reading tells what the server will run."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):  # the `serve` subparser is of the same class
        def error(self, message: str):
            # vLLM moves a `--model M` to the front, as the positional model: ours is then one too many.
            extras = message.removeprefix("unrecognized arguments: ").split() if "unrecognized" in message else []
            if arguments[0] in extras or (extras[:1] and not extras[0].startswith("-")):
                message = f"the model to serve is MODEL ({arguments[0]}): give no other (--model)"
            raise UsageError(f"the arguments for vllm serve: {message}")

    parser = Parser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.CRITICAL)  # it logs a bad --config file too: the UsageError is the one line
    try:
        return parser.parse_args(["serve", *arguments])
    except UsageError:
        raise
    except Exception as error:  # --config: a missing file, not YAML, two of them (ValueError, OSError, ...)
        raise UsageError(f"the arguments for vllm serve: {first_line(error)}") from None
    finally:
        vllm_logger.setLevel(level)


def is_loopback(host: str | None) -> bool:
    """Whether a listening address is loopback ("" is every interface; a host name may be any)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_keys(serve: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    """The keys vLLM asks for, by its own rule: the non-empty --api-key values, or $VLLM_API_KEY when
    no --api-key was given (so an empty --api-key asks none)."""
    return [key for key in (serve.api_key or [environ.get(API_KEY_VARIABLE)]) if key]


def check_access(serve: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Refuse to listen beyond loopback without an API key (vLLM's server would answer anyone);
    `serve` is what vLLM's parser read, `environ` the environment vLLM starts in."""
    if not 0 < serve.port < 65536:
        raise UsageError(f"--port {serve.port}: a port is a number from 1 to 65535")
    if serve.grpc:  # vLLM's serve_grpc binds host:port, "" as every interface, and reads no key and no --uds
        if not is_loopback(serve.host):
            raise UsageError(
                f"--grpc: vLLM's gRPC server asks no API key, so it may listen on loopback only, not on "
                f"--host {serve.host or '(every interface)'}"
            )
        if importlib.util.find_spec("smg_grpc_servicer") is None:
            raise UsageError("--grpc: vLLM's gRPC server is not installed here: pip install 'vllm[grpc]'")
        return
    # On a Unix socket (--uds) vLLM ignores the host and the port.
    if serve.uds or api_keys(serve, environ) or is_loopback(serve.host):
        return
    host = serve.host or '"" (every interface)'
    raise UsageError(
        f"--host {host} listens beyond this machine: give an API key that clients must send "
        f"(--api-key KEY or ${API_KEY_VARIABLE}; an empty key asks none), or listen on {DEFAULT_HOST}"
    )


class KeyOnEveryPath:
    """ASGI middleware (`--middleware`): where the server has API keys, every path but the liveness
    probes asks for one. vLLM's own check guards only /v1, /v2, /inference and /cohere, while
    /invocations, /tokenize, /metrics ... answer anyone. Keys are read at the first request."""

    OPEN_PATHS = ("/health", "/ping")

    def __init__(self, app) -> None:
        self.app, self.guard = app, None

    def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return self.app(scope, receive, send)  # as vLLM's check: lifespan events, CORS preflight
        if self.guard is None:
            from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

            keys = api_keys(scope["app"].state.args, os.environ)
            self.guard = AuthenticationMiddleware(self.app, keys) if keys else False
        from starlette.datastructures import Headers
        from starlette.responses import JSONResponse

        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if self.guard and path not in self.OPEN_PATHS and not self.guard.verify_token(Headers(scope=scope)):
            return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        return self.app(scope, receive, send)


def check_servable(model: Path, tp: int) -> None:
    """Build vLLM's engine configuration for the checkpoint, as `vllm serve` will, and on a CPU check
    the head sizes its attention kernel runs (vLLM checks those only at the first request)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    # vLLM checks the KV heads only when it builds the model, after loading: check both here (the
    # rules `ladder plan` prices with, ladder/tp/degrees.py).
    declared = read_config_dict(model)
    heads = declared.get("num_attention_heads")
    kv_heads = declared.get("num_key_value_heads", heads)
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads > 0 and kv_heads > 0:
        if problem := vllm_refusal(heads, kv_heads, tp):
            raise UsageError(f"vLLM cannot serve {model} at TP={tp}: {problem}")
    try:
        config = EngineArgs(model=str(model), tensor_parallel_size=tp).create_engine_config()
    except Exception as error:  # vLLM raises ValueError, TypeError, pydantic errors, RuntimeError...
        # vLLM follows an unknown architecture with the list of the ~400 it knows: drop the list.
        message = vllm_error_message(error).split(" Supported architectures:")[0]
        raise UsageError(f"vLLM cannot serve {model}: {message}") from None
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head_size, supported = config.model_config.get_head_size(), CPUAttentionBackend.get_supported_head_sizes()
        if head_size not in supported:
            raise UsageError(
                f"vLLM cannot serve {model} on the CPU: its attention head size is {head_size}, and vLLM's CPU "
                f"attention runs {', '.join(map(str, supported))}"
            )


def size_memory(model: Path, serve: argparse.Namespace, environ: dict[str, str]) -> list[str]:
    """Size vLLM's memory unless the user did: on a CPU the KV cache, in `environ`; on a GPU the share
    of its memory, as arguments to add (vLLM's default, 92%, refuses to start where 8% is in use)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    chosen = (
        serve.kv_cache_memory_bytes is not None or serve.gpu_memory_utilization != EngineArgs.gpu_memory_utilization
    )
    if chosen or environ.get("VLLM_CPU_KVCACHE_SPACE") or not (current_platform.is_cpu() or current_platform.is_cuda()):
        return []
    weights = sum(path.stat().st_size for path in model.glob("*.safetensors"))
    if serve.dtype in ("float32", "float") and read_config_dict(model).get("torch_dtype") in ("bfloat16", "float16"):
        weights *= 2  # widened as it loads
    tp = serve.tensor_parallel_size
    if current_platform.is_cpu():
        import psutil

        environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_space(psutil.virtual_memory().available, weights, tp))
        return []
    import torch

    free, total = min(torch.cuda.mem_get_info(device) for device in range(tp))
    return ["--gpu-memory-utilization", str(gpu_memory_utilization(free, total, weights, tp))]


def main(argv: list[str]) -> int:
    ours, passthrough = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = build_parser().parse_args(ours)
    if not args.model:
        raise UsageError("name the checkpoint folder to serve: make serve MODEL=DIR")
    model = resolve_model_path(args.model)
    if not model.is_dir():
        raise UsageError(f"{model} is a GGUF file: vLLM serves checkpoint directories; `ladder convert` writes one")
    check_checkpoint(model)  # before vLLM reads it: another model_type may ship code
    # vLLM warns when imported: keep that out of the checks, so that a refusal is one line.
    logging_level = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    logging.getLogger("vllm").setLevel(logging.ERROR)
    try:
        from vllm.platforms import current_platform
    except ImportError:
        raise UsageError(
            "vLLM is not installed in this environment: run `make serve MODEL=...`, which builds and uses .venv-serve"
        ) from None

    if problem := vllm_version_problem():
        raise UsageError(problem)
    if args.api_key:
        os.environ[API_KEY_VARIABLE] = args.api_key  # vLLM's --api-key default: kept off the printed command
    arguments = vllm_serve_arguments(model, args, passthrough)
    serve = parse_vllm_serve(arguments)
    check_access(serve, os.environ)
    tp = serve.tensor_parallel_size  # what vLLM will run: the passthrough's, in any spelling, over ours
    if tp < 1:
        raise UsageError(f"--tensor-parallel-size {tp}: the tensor-parallel degree must be at least 1")
    check_servable(model, tp)
    if current_platform.is_cpu() and tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tp, sorted(os.sched_getaffinity(0)))
    sizing = size_memory(model, serve, os.environ)
    arguments += sizing
    kv_cache = os.environ.get("VLLM_CPU_KVCACHE_SPACE") if current_platform.is_cpu() else None
    environment = [f"VLLM_CPU_KVCACHE_SPACE={kv_cache}"] if kv_cache else []
    if args.check_only:
        memory = " ".join(sizing or environment) or "memory as given"
        print(f"vLLM can serve {model} at TP={tp} as {serve.served_model_name[0]} ({memory})")
        return 0
    if logging_level is None:
        del os.environ["VLLM_LOGGING_LEVEL"]
    else:
        os.environ["VLLM_LOGGING_LEVEL"] = logging_level
    command = [str(Path(sys.executable).parent / "vllm"), "serve", *arguments]
    print(" ".join([*environment, *command]), file=sys.stderr, flush=True)
    os.environ[SERVE_ENV_FLAG] = "1"
    os.execv(command[0], command)
    return 0  # not reached
