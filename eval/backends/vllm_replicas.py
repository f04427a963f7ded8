"""`--data-parallel N` for the vllm backend: N engines that split every batch of requests, started
once per model (engine 0 in this process, the others spawned). lm-eval's own `data_parallel_size`
is not used: it needs Ray, which on a CPU-only machine never schedules a replica (each reserves
GPUs), and starts N new engines for every batch it sends.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import traceback
import weakref

from accelerate.utils import patch_environment
from lm_eval.models.utils import undistribute
from lm_eval.models.vllm_causallms import VLLM
from more_itertools import distribute
from vllm import SamplingParams


def _serve_engine(connection, vllm_arguments: dict, environment: dict[str, str]) -> None:
    """An engine process: lm-eval's VLLM generating each batch it is sent until None or the pipe closes."""
    os.environ.update(environment)
    try:
        lm = VLLM(**vllm_arguments)
        connection.send(("ready", None))
        while (batch := connection.recv()) is not None:
            prompts, sampling_params = batch
            connection.send(("done", lm._model_generate(prompts, generate=True, sampling_params=sampling_params)))
    except EOFError:  # the run ended without saying so (killed): nothing to answer
        return
    except BaseException as error:  # the run gets the first line and the traceback
        connection.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


class EngineProcess:
    def __init__(self, vllm_arguments: dict, environment: dict[str, str]):
        context = multiprocessing.get_context("spawn")  # vLLM and CUDA do not survive a fork
        self.connection, child = context.Pipe()
        # Not a daemon: vLLM's engine starts processes of its own, which a daemon may not.
        self.process = context.Process(target=_serve_engine, args=(child, vllm_arguments, environment))
        self.process.start()
        child.close()

    def receive(self):
        try:
            status, value = self.connection.recv()
        except EOFError:
            raise RuntimeError(f"a vLLM data-parallel engine (pid {self.process.pid}) died") from None
        if status == "error":
            raise RuntimeError(f"a vLLM data-parallel engine failed: {value}")
        return value

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # a broken pipe: the engine is gone
            self.connection.send(None)
        self.process.join(timeout=120)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.connection.close()


class DataParallelVLLM(VLLM):
    """lm-eval's VLLM with every batch split over this process's engine and the others (`environments`:
    each engine's, from vllm.py's `engine_environments`)."""

    def __init__(self, environments: list[dict[str, str]], **vllm_arguments):
        # The other engines first, so that all of them start at once; this process's last.
        self.engines = [EngineProcess(vllm_arguments, environment) for environment in environments[1:]]
        for engine in self.engines:
            weakref.finalize(self, engine.stop)
        # Engine 0's devices (or cores) only while it starts its processes, which inherit them: the
        # next model's check counts the devices this process was given, not engine 0's share.
        with patch_environment(**environments[0]):
            super().__init__(**vllm_arguments)
        for engine in self.engines:
            engine.receive()  # "ready", or the engine's error

    def _model_generate(self, requests, generate: bool = False, sampling_params=None):
        if not generate or sampling_params is None:  # lm-eval's log-likelihood request
            sampling_params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(requests)
        count = len(self.engines) + 1
        shares = [list(share) for share in distribute(count, requests)]
        parameters = [list(share) for share in distribute(count, sampling_params)]
        for engine, share, share_parameters in zip(self.engines, shares[1:], parameters[1:]):
            if share:  # fewer requests than engines: the last ones idle
                engine.connection.send((share, share_parameters))
        local = super()._model_generate(shares[0], generate=True, sampling_params=parameters[0]) if shares[0] else []
        others = [engine.receive() if share else [] for engine, share in zip(self.engines, shares[1:])]
        return undistribute([local, *others])
