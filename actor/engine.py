"""The one module that speaks vLLM: start an AsyncLLM engine, sample a group, swap weights in flight.

vLLM's weight-update API has changed several times; this wrapper pins the calls tidal uses
(vllm 0.32: pause_generation(mode="keep"), collective_rpc into a worker extension, the
weight-transfer API (init_weight_transfer_engine, start/update/finish_weight_update) with an
engine tidal registers, update_weight_version, per-output weight_versions spans).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import gc
import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tidal.actor.worker_ext import CPU_LINEAR_ENV
from tidal.broker.schema import SamplingParams
from tidal.config import ActorConfig, parse_cores


@dataclass
class Completion:
    tokens: np.ndarray  # int32 [completion_len]
    logprobs: np.ndarray  # float32 [completion_len], processed (after temperature)
    version_spans: list[tuple[int, int, int]]  # (version, start, end)
    text: str
    finish_reason: str  # stop | length | interrupted (see Sample.finish_reason)
    injected_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) injected by the actor


# Benchmarks only (bench/corrections.py), never a user setting: the engine serves every version's weights
# rounded to this dtype while it computes in its own, a numeric mismatch between actor and learner that a
# CPU without bf16 kernels cannot make otherwise. Needs plain linear layers (actor.vllm.cpu_linear: plain):
# a packed layer computes from its own copy.
BENCH_ROUND_ENV = "TIDAL_BENCH_ROUND_WEIGHTS"


class Engine:
    """One vLLM AsyncLLM per actor process. The actor loop needs only `version`, `set_version`,
    `init_weight_transfer`, `weight_transport`, `num_workers`, `transfer_weights`, `sample`, `info` and
    `shutdown`: a scripted engine with those runs the loop in tests."""

    def __init__(
        self, cfg: ActorConfig, model_path: str, dtype: str, max_num_seqs: int | None = None, adapter_rank: int = 0
    ):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.kv_cache_gib))))
        if cfg.cpu_cores:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_cores
        os.environ[CPU_LINEAR_ENV] = cfg.vllm.cpu_linear  # read by tidal's vLLM plugin in the engine's processes
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = engine_args(cfg, model_path, dtype, max_num_seqs, adapter_rank)
        engine_env = cpu_engine_env(cfg) if current_platform.is_cpu() else {}
        if engine_env:
            kwargs["distributed_executor_backend"] = IN_PROCESS_EXECUTOR
        try:
            args = AsyncEngineArgs(**kwargs)
        except TypeError as err:  # an engine_kwargs key this vLLM does not know
            raise ValueError(f"config key 'actor.vllm.engine_kwargs' = {dict(cfg.vllm.engine_kwargs)}: {err}") from None
        # the engine-core process is spawned with engine_env (this process keeps its own) and reads its
        # logging config from a file, which is needed only while the engine's processes start
        with _environ(engine_env), quiet_update_logs(args):
            self._llm = AsyncLLM.from_engine_args(args)
        self._decode = batch_decoder(self._llm.tokenizer)  # None when the engine runs without a tokenizer
        self.version = 0
        self._swap_lock = asyncio.Lock()
        self.weight_transport = ""  # the weight channel the workers are set up for (init_weight_transfer)
        self.torn = False  # an update failed part-way: paused until one loads whole
        self.adapter_rank = adapter_rank  # > 0: the engine serves a LoRA adapter, and every update is one
        self._lora = None  # the adapter's request, once installed: every request carries it
        # actor.on_update: keep: running requests keep their keys and values over an update, and each
        # request is salted by the weights it starts under (a count of the updates begun), so that
        # none reuses a prefix cached by older weights
        self.keep_cache = cfg.on_update == "keep"
        self.loads = 0

    async def set_version(self, version: int) -> None:
        """Label the weights just loaded (at start, version 0) as `version`."""
        if os.environ.get(BENCH_ROUND_ENV):
            await self._llm.collective_rpc("tidal_round_weights", args=(os.environ[BENCH_ROUND_ENV],))
        await self._llm.update_weight_version(str(version))
        self.version = version

    async def init_weight_transfer(self, init_info: dict) -> None:
        """Every worker sets up the weight channel `init_info` names (a collective one forms its
        group with the learner here); again whenever the channel's learner changes."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        init_info = {**init_info, "adapter": bool(self.adapter_rank)}
        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
        self.weight_transport = init_info["transport"]

    def num_workers(self) -> int:
        """The engine's worker processes (tensor x pipeline parallel): each receives every update."""
        return self._llm.vllm_config.parallel_config.world_size

    async def transfer_weights(self, version: int, update_info: dict, streaming: bool = False) -> float:
        """Pause (in-flight requests keep their place and tokens), load the update in every worker through
        vLLM's weight-transfer API (tidal's engine, fixed when this engine started), label the
        version, resume; returns seconds paused. A `streaming` update loads as its bytes arrive:
        one that fails part-way leaves the model torn, so the engine stays paused (its requests
        waiting) until a later update loads whole; any other failure leaves the weights as they were.
        An adapter is never torn: the previous version stays installed until a new one arrives whole."""
        async with self._swap_lock:
            if self.weight_transport != update_info["transport"]:  # the first update, or another channel's
                await self.init_weight_transfer({"transport": update_info["transport"]})
            start = time.perf_counter()
            if not self.torn:
                await self._pause()
            # a new salt from here on (actor.on_update: keep): a request added while paused, or after an
            # update that failed part-way, prefills under whatever weights the engine resumes with
            self.loads += 1
            try:
                await self._update(update_info)
                await self.set_version(version)
            except BaseException:
                self.torn = self.torn or (streaming and not self.adapter_rank)
                if not self.torn:
                    await self._llm.resume_generation()
                raise
            self.torn = False
            await self._llm.resume_generation()
            return time.perf_counter() - start

    async def _update(self, update_info: dict) -> None:
        """One weight-transfer session in every worker; serving an adapter, the newest one received whole
        is installed after it, whatever the session's outcome: finishing one drops vLLM's adapters."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        try:
            await self._llm.start_weight_update()
            try:
                await self._llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))
            except BaseException:
                await self._end_failed_update()
                raise
            await self._llm.finish_weight_update()
        finally:
            if self.adapter_rank:
                await self.install_adapter()

    async def install_adapter(self) -> None:
        """The newest adapter version each worker holds (zeros before the first) under ADAPTER_ID; from
        then on every request carries it."""
        from vllm.lora.request import LoRARequest

        from tidal.actor.adapter import ADAPTER_ID, ADAPTER_NAME

        await self._llm.collective_rpc("tidal_install_adapter")
        # the path is never read: the adapter is registered before any request names it, and stays so
        self._lora = LoRARequest(ADAPTER_NAME, ADAPTER_ID, f"/in-memory/{ADAPTER_NAME}")

    async def _end_failed_update(self) -> None:
        """A worker whose update raised has ended its session; one whose update went through has not:
        end those, so that the next update can start."""
        try:
            await self._llm.finish_weight_update()
        except Exception:
            pass  # the workers whose session had ended already say so; the update's own error is raised

    async def _pause(self) -> None:
        """Requests in flight stop between engine steps and keep their place and their tokens. With
        actor.on_update: recompute the caches are cleared: a prompt's cached keys and values were
        computed by the weights being replaced, and clearing them preempts the running requests, so
        on resume each recomputes its keys and values (prompt and tokens so far) under the new weights
        before it samples on. With keep they stay, and salts keep later requests off them. The
        engine core is asked directly: AsyncLLM.pause_generation adds a fixed 20 ms sleep, only so
        that outputs already produced reach their callers first (our version spans do not depend on
        it), and 20 ms is a large share of a small model's whole pause."""
        clear = not self.keep_cache
        core = getattr(self._llm, "engine_core", None)
        if core is None or not hasattr(core, "pause_scheduler_async"):
            await self._llm.pause_generation(mode="keep", clear_cache=clear)
            return
        await core.pause_scheduler_async(mode="keep", clear_cache=clear)

    async def sample(
        self, prompt_tokens: list[int], n: int, params: SamplingParams, request_id: str, max_tokens: int | None = None
    ) -> list[Completion]:
        """n samples of one prompt; `max_tokens` overrides params.max_tokens (thinking budgets, answers)."""
        from vllm import SamplingParams as VllmSamplingParams

        sp = VllmSamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_tokens if max_tokens is None else max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            logprobs=0,  # the sampled token's own logprob
            flat_logprobs=True,  # kept as one list of floats, not a dict per token
            detokenize=False,
        )  # a finished sample is decoded once: completion_texts
        if self.adapter_rank and self._lora is None:  # before any version: a zero adapter, the base model's outputs
            async with self._swap_lock:
                if self._lora is None:
                    await self.install_adapter()
        # With n > 1 each streamed output carries only the samples that changed in that engine
        # step, so samples that finished early are absent from the last one: keep each by index.
        latest = {}
        async for out in self._llm.generate(
            self.prompt(prompt_tokens), sp, request_id=request_id, lora_request=self._lora
        ):
            latest.update((c.index, c) for c in out.outputs)
        if len(latest) != n or not all(c.finished() for c in latest.values()):
            raise RuntimeError(f"request {request_id}: vLLM returned {len(latest)} finished samples, expected {n}")
        outputs = [latest[i] for i in range(n)]
        texts = completion_texts(self._decode, prompt_tokens, [_text_tokens(c) for c in outputs])
        return [_completion(c, text) for c, text in zip(outputs, texts)]

    def prompt(self, prompt_tokens: list[int]) -> dict:
        """A request's prompt as vLLM takes it; under actor.on_update: keep, salted by the weights it
        starts under, so that its prefix is cached apart from every other version's."""
        if not self.keep_cache:
            return {"prompt_token_ids": prompt_tokens}
        return {"prompt_token_ids": prompt_tokens, "cache_salt": f"tidal-weights-{self.loads}"}

    @property
    def tokenizer(self):
        """The model's tokenizer (Hugging Face), as vLLM loaded it."""
        return self._llm.tokenizer

    async def weight_layout(self) -> str:
        """How weight updates enter the model: "copy" in place, or "reload" layer-wise (vLLM's CPU
        backend with actor.vllm.cpu_linear: packed)."""
        layouts = set(await self._llm.collective_rpc("tidal_weight_layout"))
        return "reload" if "reload" in layouts else "copy"

    def info(self) -> dict[str, str]:
        import vllm

        return {
            "vllm": vllm.__version__,
            "pid": str(os.getpid()),
            "model": str(self._llm.model_config.model),
            "dtype": str(self._llm.model_config.dtype),
        }

    def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        llm.shutdown()
        # Collected now, not at interpreter exit: vLLM's __del__ shuts down again, and at exit it
        # finds its module's globals gone and prints a TypeError traceback into every actor's log.
        del llm
        gc.collect()


def engine_args(
    cfg: ActorConfig, model_path: str, dtype: str, max_num_seqs: int | None = None, adapter_rank: int = 0
) -> dict:
    """AsyncEngineArgs for an actor: what tidal's correctness needs, then the user's engine settings."""
    from tidal.actor.weight_engine import VLLM_BACKEND

    vllm = cfg.vllm
    return {
        "model": model_path,
        "dtype": dtype,
        "enforce_eager": cfg.enforce_eager,
        "seed": cfg.seed + cfg.index,
        "max_num_seqs": max_num_seqs or cfg.max_inflight,
        "logprobs_mode": "processed_logprobs",  # behavior logprobs after temperature
        "worker_extension_cls": "tidal.actor.worker_ext.TidalWorker",
        # a group's n samples share their prompt's cached keys and values; every weight update clears the cache
        "enable_prefix_caching": True,
        "tensor_parallel_size": vllm.tensor_parallel_size,
        "gpu_memory_utilization": vllm.gpu_memory_utilization,
        **({"max_model_len": vllm.max_model_len} if vllm.max_model_len else {}),
        "weight_transfer_config": {"backend": VLLM_BACKEND},  # every weight channel enters through tidal's engine
        **(lora_args(adapter_rank) if adapter_rank else {}),
        **vllm.engine_kwargs,
        **head_overrides(dtype, vllm.engine_kwargs.get("hf_overrides")),
    }


def lora_args(rank: int) -> dict:
    """vLLM's LoRA for an adapter of `rank`: one adapter, one slot (each version replaces it in place)."""
    from tidal.config import served_lora_rank

    return {"enable_lora": True, "max_lora_rank": served_lora_rank(rank), "max_loras": 1, "max_cpu_loras": 1}


def head_overrides(dtype: str, chosen: dict | None) -> dict:
    """Served in half precision, the LM head still computes in fp32 (vLLM's head_dtype: the weights as
    served, products summed and logits kept in fp32), as the learner's does: rounded to bf16, logits of
    magnitude 20-30 keep 3 significant digits, and the behaviour logprobs would differ from the
    learner's by far more than their kernels do. What the user sets in hf_overrides stays."""
    if dtype not in ("bfloat16", "float16"):
        return {}
    return {"hf_overrides": {"head_dtype": "float32", **(chosen or {})}}


# vLLM loggers that write INFO lines at every weight update (the scheduler paused and unpaused, the
# prefix cache reset): 453 of the 662 lines of a demo actor's log. At WARNING their warnings still show
PER_UPDATE_LOGGERS = ("vllm.v1.core.sched.scheduler", "vllm.v1.core.block_pool")


def quiet_logging_config(default: Mapping) -> dict:
    """vLLM's logging config (`default`: vllm.logger.DEFAULT_LOGGING_CONFIG) with PER_UPDATE_LOGGERS at
    WARNING; every other vLLM logger as vLLM sets it."""
    config = copy.deepcopy(dict(default))
    config["loggers"] = {**config.get("loggers", {}), **{name: {"level": "WARNING"} for name in PER_UPDATE_LOGGERS}}
    return config


def user_configures_logging(engine_args: Mapping, environ: Mapping[str, str]) -> bool:
    """Whether the user set vLLM's logging (its environment, or engine_kwargs): then tidal leaves it as set."""
    return (
        environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0"
        or bool(environ.get("VLLM_LOGGING_CONFIG_PATH"))
        or any(engine_args.get(key) for key in ("logging_config", "log_config_file"))
    )


@contextlib.contextmanager
def quiet_update_logs(args):
    """While the engine starts, `args` (AsyncEngineArgs) carry a logging config with PER_UPDATE_LOGGERS
    at WARNING, in a file: vLLM applies it in this process and in each process it spawns (the
    engine core, its workers), which a logger level set here would not reach."""
    if user_configures_logging(vars(args), os.environ):
        yield
        return
    from vllm.config.logging import LoggingConfig
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    with tempfile.TemporaryDirectory(prefix="tidal-vllm-logging-") as folder:
        path = Path(folder) / "logging.json"
        path.write_text(json.dumps(quiet_logging_config(DEFAULT_LOGGING_CONFIG)))
        args.logging_config = LoggingConfig(pylogging_config_file=str(path))
        yield


IN_PROCESS_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"
_PARALLEL_KEYS = (
    "distributed_executor_backend",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
)


def cpu_engine_env(cfg: ActorConfig) -> dict[str, str]:
    """On vLLM's CPU platform, a one-worker engine pinned to actor.cpu_cores runs its model in the
    engine-core process instead of a worker process of its own: one process fewer to start (a
    dozen seconds of imports on a small machine) and no shared-memory queue between scheduler and
    model, whose busy-waits took about half of both processes' time. vLLM's CPU platform turns the
    "uni" executor name into its multiprocess executor because only a process it spawns gets its
    OpenMP threads bound; tidal names the executor class instead, and this environment binds the
    engine-core process's threads as vLLM binds a worker's. {} where the engine is left as vLLM
    sets it up: no cores given, or an executor or parallelism the user chose."""
    chosen = {"tensor_parallel_size": cfg.vllm.tensor_parallel_size, **cfg.vllm.engine_kwargs}
    if not cfg.cpu_cores or any(chosen.get(k) not in (None, 1) for k in _PARALLEL_KEYS):
        return {}
    cores = parse_cores(cfg.cpu_cores)
    return {
        "OMP_NUM_THREADS": str(len(cores)),
        "OMP_PLACES": ",".join(f"{{{c}}}" for c in cores),
        "OMP_PROC_BIND": "close",
    }


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def batch_decoder(tokenizer):
    """How completion_texts decodes a batch with this tokenizer (chosen once per engine): the Rust
    decoder for the tokenizers vLLM decodes with it, else `batch_decode` without clean-up of spaces
    around punctuation, as vLLM's slow detokenizer joins tokens. None without a tokenizer."""
    if tokenizer is None:
        return None
    from transformers import TokenizersBackend

    if isinstance(tokenizer, TokenizersBackend):
        return functools.partial(tokenizer._tokenizer.decode_batch, skip_special_tokens=True)
    return functools.partial(tokenizer.batch_decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def completion_texts(decode, prompt: list[int], completions: list[list[int]]) -> list[str]:
    """Each completion's text as vLLM's detokenizer writes it (special tokens skipped), in one batch
    decode per group (`decode`: from batch_decoder). vLLM, left to detokenize, decodes every token as it
    is generated and the token of every sampled logprob too: on the demo that was a quarter of the actor
    process's time, for a text tidal reads once, when the sample is finished. vLLM primes its decoder
    with the prompt, so the prompt's last tokens go in front here as well (a completion's first token
    keeps a leading space that depends on what precedes it) and their own text is cut off again."""
    if decode is None:
        return [""] * len(completions)
    context = list(prompt[-CONTEXT_TOKENS:])
    head, *texts = decode([context] + [context + list(c) for c in completions])
    return [_cut(decode, context, head, list(c), text) for c, text in zip(completions, texts)]


# Enough prompt for a completion's first token to decode as it does after the whole prompt: a UTF-8
# character spans at most 4 bytes (tokens), and a leading space depends on the token before alone
CONTEXT_TOKENS = 8
MAX_HELD_BACK = 3  # a character's bytes that can be missing at a sample's end: at most 3 of its 4


def _cut(decode, context: list[int], head: str, tokens: list[int], text: str) -> str:
    """The completion's part of `text` (context + tokens decoded). A decode stream holds back a
    character whose bytes are not all there yet, and a sample can end in one (cut at max_tokens): the
    last tokens go until the text is whole, as the stream would have left it. At most MAX_HELD_BACK:
    a policy emitting invalid bytes keeps its replacement characters instead of a decode per token."""
    for _ in range(MAX_HELD_BACK):
        if not (text.endswith("\ufffd") and tokens):
            break
        tokens = tokens[:-1]
        text = decode([context + tokens])[0]
    # the context's own text changes only when a character's bytes span the prompt's end: decoded alone
    return text[len(head) :] if text.startswith(head) else decode([tokens])[0]


def _text_tokens(c) -> list[int]:
    """The tokens a completion's text is made of: vLLM leaves out the stop token that ended it."""
    tokens = list(c.token_ids)
    return tokens[:-1] if c.finish_reason == "stop" and tokens else tokens


def _completion(c, text: str) -> Completion:
    tokens = np.asarray(list(c.token_ids), dtype=np.int32)
    flat = getattr(c.logprobs, "logprobs", None)  # flat logprobs with logprobs=0: one float per token
    if flat is not None and len(flat) == len(tokens):
        logprobs = np.asarray(flat, dtype=np.float32)
    else:
        logprobs = np.asarray([lp[tok].logprob for lp, tok in zip(c.logprobs, c.token_ids)], dtype=np.float32)
    spans = [(int(s.version), s.start, s.end) for s in (c.weight_versions or [])]
    finish = "stop" if c.finish_reason == "stop" else "length"
    return Completion(tokens, logprobs, spans, text, finish)
