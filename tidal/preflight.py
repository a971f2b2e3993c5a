"""What can be checked before any process starts: the task and its data, its reward on a few rows, the
model and its tokenizer, the prompts as the tokenizer encodes them. `tidal run` checks first and creates
nothing when a check fails (one line, or one short block naming the user's file and line; exit 2)."""
from __future__ import annotations

import asyncio

from tidal.config import ConfigError, RunConfig, TaskConfig

SCORED_PROMPTS = 3  # training prompts the reward scores before the run


def preflight(cfg: RunConfig) -> list[str]:
    """One line per thing checked; raises ConfigError or FileNotFoundError naming what is wrong."""
    from tidal.models import resolve_model_path
    from tidal.tasks import PromptEncoder, get_task

    split = get_task(cfg.task.name).load_prompts(cfg.task)
    if not split.train:
        raise ConfigError(f"config key 'task.name' = {cfg.task.name!r}: the task gave no training prompts")
    found = [f"task {cfg.task.name}: {len(split.train)} training prompts, {len(split.val)} held out"]
    if cfg.task.reward_funcs:  # an unknown function is one line before the model is looked for
        from tidal.tasks.rewards import load_reward_funcs

        load_reward_funcs(cfg.task)
    check_vllm_names(cfg)
    check_task_options(cfg)
    try:
        path = resolve_model_path(cfg.model, cfg.task)
    except FileNotFoundError:
        if cfg.model.path:
            raise
        scored = check_reward(cfg.task, split.train, None)
        return [*found, *scored, "model: the tiny model is not built yet (tidal run builds it)"]
    check_lora_targets(cfg, path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    encode = PromptEncoder.for_task(tokenizer, cfg.task, cfg.env.kwargs)
    longest = max(len(encode(p)) for p in split.train[:64] + split.val[:64])
    limit = cfg.actor.vllm.max_model_len
    if limit and longest + cfg.sampling.max_tokens > limit:
        raise ConfigError(f"config key 'actor.vllm.max_model_len' = {limit}: prompts of up to {longest} tokens plus "
                          f"sampling.max_tokens = {cfg.sampling.max_tokens} do not fit")
    check_sampling(cfg, tokenizer)
    scored = check_reward(cfg.task, split.train, tokenizer)
    return [*found, *scored, f"model {path}: tokenizer of {len(tokenizer)} tokens, prompts of up to {longest} tokens"]


def check_lora_targets(cfg: RunConfig, model_path) -> None:
    """learner.lora's target modules and layers against the model's decoder layers (its shape from
    config.json, built on the meta device): ConfigError naming what it lacks and the linear layers it has."""
    if not cfg.learner.lora.enabled:
        return
    from pathlib import Path

    from tidal.memory import ModelShape

    shape = ModelShape.from_config(Path(model_path))
    cfg.learner.lora.check_model(shape.layer_linears, shape.num_layers)


def check_task_options(cfg: RunConfig) -> None:
    """task.kwargs against the options the task module declares (OPTIONS, name -> help), and env.kwargs
    against its environment's (built here, which checks them): a misspelt one was silently ignored. A
    module or environment that declares none is not checked."""
    from tidal.tasks import get_environment, get_task
    from tidal.tasks.env import options_text

    task = cfg.task
    declared = getattr(get_task(task.name), "OPTIONS", None)
    unknown = sorted(set(task.kwargs) - set(declared)) if declared is not None else []
    if unknown:
        raise ConfigError(f"config key 'task.kwargs.{unknown[0]}': task {task.name} has no such option "
                          f"({options_text(declared)})")
    if cfg.env.kwargs:
        get_environment(task, cfg.env.kwargs)


def check_vllm_names(cfg: RunConfig) -> None:
    """Names the config passes to vLLM that this vLLM must know: engine_kwargs keys and a tool parser
    other than the default. Each costs the import of part of vLLM, so it is looked up only when set;
    the actor would otherwise find out after every process had started."""
    if cfg.actor.vllm.engine_kwargs:
        import dataclasses

        from vllm.engine.arg_utils import AsyncEngineArgs

        unknown = sorted(set(cfg.actor.vllm.engine_kwargs) - {f.name for f in dataclasses.fields(AsyncEngineArgs)})
        if unknown:
            raise ConfigError(f"config key 'actor.vllm.engine_kwargs' = {dict(cfg.actor.vllm.engine_kwargs)}: "
                              f"vLLM's engine has no argument {', '.join(unknown)}")
    if cfg.env.tool_parser != type(cfg.env)().tool_parser:
        from vllm.tool_parsers import ToolParserManager

        known = ToolParserManager.list_registered()
        if cfg.env.tool_parser not in known:
            raise ConfigError(f"config key 'env.tool_parser' = {cfg.env.tool_parser!r}: vLLM has no such tool "
                              f"parser ({', '.join(sorted(known))})")


def check_sampling(cfg: RunConfig, tokenizer) -> None:
    """The sampling the learner will send, built as it builds it: the interruption text's token count
    is known only with the tokenizer, so whether the budgets fit sampling.max_tokens is checked here,
    before any process starts, rather than by the learner after it has."""
    from tidal.broker.schema import WireError
    from tidal.learner.build import dispatch_plan

    try:
        dispatch_plan(cfg, tokenizer).sampling.check()
    except WireError as err:
        key = "sampling.interrupt" if err.detail.startswith("sampling.interrupt") else "sampling.overlong"
        raise ConfigError(f"config key '{key}': {err.detail}") from None


def check_reward(cfg: TaskConfig, prompts: list, tokenizer) -> list[str]:
    """A few training prompts scored by task.reward_funcs, or by a task module of the user's own (the
    built-in ones are tested), each with its reference answer as the completion where the row has one;
    one line per function. A reward that raises is a ConfigError naming its file and line."""
    from tidal.tasks import BUILTIN, get_task

    if cfg.reward_funcs:
        return _check_reward_funcs(cfg, prompts[:SCORED_PROMPTS], tokenizer)
    module = get_task(cfg.name)
    if cfg.name in BUILTIN or getattr(module, "Environment", None) is not None:
        return []
    return _check_task_reward(cfg, prompts[:SCORED_PROMPTS])


def _check_reward_funcs(cfg: TaskConfig, prompts: list, tokenizer) -> list[str]:
    from tidal.tasks.rewards import PROMPT_TEXT, RewardFailed, call_kwargs, decode_row, load_reward_funcs, score

    funcs = load_reward_funcs(cfg)
    values: dict[str, list[float]] = {f.name: [] for f in funcs}
    totals = []
    for prompt in prompts:
        reference = decode_row(prompt.payload).get(cfg.answer_field)
        completion = reference if isinstance(reference, str) else ""
        ids = tokenizer(completion, add_special_tokens=False)["input_ids"] if tokenizer is not None else []
        kwargs = call_kwargs({**prompt.payload, PROMPT_TEXT: prompt.text}, cfg.prompt_field, completion, ids)
        try:
            total, components = asyncio.run(score(funcs, kwargs))
        except RewardFailed as err:
            raise ConfigError(f"config key 'task.reward_funcs': {err}\n  (scoring training prompt "
                              f"{prompt.prompt_id}{_completion_said(cfg, reference)})") from None
        totals.append(total)
        for name, value in components.items():
            values[name].append(value)
    said = _completion_said(cfg, "" if any(isinstance(decode_row(p.payload).get(cfg.answer_field), str)
                                         for p in prompts) else None)
    lines = [f"reward {f.name} (weight {f.weight:g}) on {len(prompts)} training prompts{said}: "
             f"{_listed(values[f.name])}" for f in funcs]
    judged = f"reward function {cfg.pass_on}'s value" if cfg.pass_on else "the weighted sum"
    return [*lines, f"reward, their weighted sum: {_listed(totals)}",
            f"a sample passes when {judged} is >= {cfg.pass_threshold:g} (task.pass_threshold)"]


def _check_task_reward(cfg: TaskConfig, prompts: list) -> list[str]:
    from tidal.tasks import get_reward
    from tidal.tasks.rewards import where_raised

    reward, values = get_reward(cfg), []
    for prompt in prompts:
        completion = prompt.payload.get("answer", "")
        try:
            values.append(float(reward(completion, dict(prompt.payload))))
        except Exception as err:
            raise ConfigError(f"config key 'task.name' = {cfg.name!r}: its reward raised {type(err).__name__}: "
                              f"{err}\n{where_raised(err, reward)}\n  (scoring training prompt {prompt.prompt_id}, "
                              "completion = its payload's answer)") from None
    return [f"reward of task {cfg.name} on {len(prompts)} training prompts, completion = the payload's answer: "
            f"{_listed(values)}"]


def _completion_said(cfg: TaskConfig, reference) -> str:
    if reference is None:
        return ", completion = '' (no answer column to use)"
    return f", completion = its {cfg.answer_field!r} column"


def _listed(values: list[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)
