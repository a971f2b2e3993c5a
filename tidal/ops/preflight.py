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

    check_prompt_template(cfg.task)
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
        raise ConfigError(
            f"config key 'actor.vllm.max_model_len' = {limit}: prompts of up to {longest} tokens plus "
            f"sampling.max_tokens = {cfg.sampling.max_tokens} do not fit"
        )
    check_sampling(cfg, tokenizer)
    scored = check_reward(cfg.task, split.train, tokenizer)
    return [*found, *scored, f"model {path}: tokenizer of {len(tokenizer)} tokens, prompts of up to {longest} tokens"]


def check_lora_targets(cfg: RunConfig, model_path) -> None:
    """learner.lora's target modules and layers against the model's decoder layers (its shape from
    config.json, built on the meta device): ConfigError naming what it lacks and the linear layers it has."""
    if not cfg.learner.lora.enabled:
        return
    from pathlib import Path

    from tidal.ops.memory import ModelShape

    shape = ModelShape.from_config(Path(model_path))
    cfg.learner.lora.check_model(shape.layer_linears, shape.num_layers)


def check_task_options(cfg: RunConfig) -> None:
    """task.kwargs against the options the task module declares (OPTIONS, name -> help), and env.kwargs
    against its environment's (built here, which checks them): a misspelt one was silently ignored. A
    module or environment that declares none is not checked."""
    from tidal.tasks import get_task
    from tidal.tasks.env import options_text

    task = cfg.task
    declared = getattr(get_task(task.name), "OPTIONS", None)
    unknown = sorted(set(task.kwargs) - set(declared)) if declared is not None else []
    if unknown:
        raise ConfigError(
            f"config key 'task.kwargs.{unknown[0]}': task {task.name} has no such option ({options_text(declared)})"
        )
    check_environment(cfg)


def check_environment(cfg: RunConfig) -> None:
    """The task's environment built as an actor builds it (which checks env.kwargs), and its tools'
    schemas read: an environment that raises as it is built, or a tool without a docstring, is a
    line naming the user's file here rather than an actor's traceback."""
    from tidal.tasks import get_environment, tool_schemas
    from tidal.tasks.user_code import failure

    try:
        env = get_environment(cfg.task, cfg.env.kwargs)
        tools = list(env.tools())
    except ConfigError:
        raise
    except Exception as err:  # the user's __init__ or tools()
        raise ConfigError(f"config key 'task.name' = {cfg.task.name!r}: {failure(err, 'its Environment')}") from None
    tool_schemas(tools)


# the built-in tasks whose string prompts go through task.prompt_template; the others would ignore it
TEMPLATED_TASKS = ("math",)


def check_prompt_template(task: TaskConfig) -> None:
    """A task.prompt_template set for a built-in task that does not use it is refused (it was silently
    ignored); a task module of the user's own may read it from its config."""
    from tidal.tasks import BUILTIN

    if task.prompt_template == TaskConfig().prompt_template or task.name not in BUILTIN:
        return
    if task.name not in TEMPLATED_TASKS:
        uses = "sends each row's prompt as it is" if task.name in ("rows", "skyrl") else "makes its own prompts"
        raise ConfigError(
            f"config key 'task.prompt_template' = {task.prompt_template!r}: task {task.name} "
            f"{uses}; the template is for task {', '.join(TEMPLATED_TASKS)} (put the text into "
            "the prompts, or leave task.prompt_template unset)"
        )


def check_vllm_names(cfg: RunConfig) -> None:
    """Names the config passes to vLLM that this vLLM must know: engine_kwargs keys and a tool parser
    other than the default. Each costs the import of part of vLLM, so it is looked up only when set;
    the actor would otherwise find out after every process had started."""
    if cfg.actor.vllm.engine_kwargs:
        import dataclasses

        from vllm.engine.arg_utils import AsyncEngineArgs

        unknown = sorted(set(cfg.actor.vllm.engine_kwargs) - {f.name for f in dataclasses.fields(AsyncEngineArgs)})
        if unknown:
            raise ConfigError(
                f"config key 'actor.vllm.engine_kwargs' = {dict(cfg.actor.vllm.engine_kwargs)}: "
                f"vLLM's engine has no argument {', '.join(unknown)}"
            )
    if cfg.env.tool_parser != type(cfg.env)().tool_parser:
        from vllm.tool_parsers import ToolParserManager

        known = ToolParserManager.list_registered()
        if cfg.env.tool_parser not in known:
            raise ConfigError(
                f"config key 'env.tool_parser' = {cfg.env.tool_parser!r}: vLLM has no such tool "
                f"parser ({', '.join(sorted(known))})"
            )


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
    """Each function's signature against the rows' columns, then the prompts scored together (a
    function taking lists gets them in one call, as it gets a group), then their sums against
    task.reward_range."""
    from tidal.tasks.rewards import RewardFailed, decode_row, load_reward_funcs, score_rows, signature_mismatch

    funcs = load_reward_funcs(cfg)
    samples = [_reference_kwargs(cfg, p, tokenizer) for p in prompts]
    columns = list(decode_row(prompts[0].payload))
    for func in funcs:
        mismatch = signature_mismatch(func, samples[0], columns)
        if mismatch:
            raise ConfigError(f"config key 'task.reward_funcs': {mismatch}")
    said = _completion_said(
        cfg, "" if any(isinstance(decode_row(p.payload).get(cfg.answer_field), str) for p in prompts) else None
    )
    try:
        scored = asyncio.run(score_rows(funcs, samples))
    except RewardFailed as err:
        ids = ", ".join(str(p.prompt_id) for p in prompts)
        raise ConfigError(f"config key 'task.reward_funcs': {err}\n  (scoring training prompts {ids}{said})") from None
    totals = [total for total, _ in scored]
    for prompt, (total, components) in zip(prompts, scored):
        parts = " + ".join(f"{f.name} {components[f.name]:g} x {f.weight:g}" for f in funcs if f.name in components)
        _check_range(cfg, total, f"training prompt {prompt.prompt_id} scored {total:g} ({parts}){said}")
    lines = [
        f"reward {f.name} (weight {f.weight:g}) on {len(prompts)} training prompts{said}: "
        f"{_listed([c[f.name] for _, c in scored if f.name in c])}"
        for f in funcs
    ]
    judged = f"reward function {cfg.pass_on}'s value" if cfg.pass_on else "the weighted sum"
    return [
        *lines,
        f"reward, their weighted sum: {_listed(totals)}",
        f"a sample passes when {judged} is >= {cfg.pass_threshold:g} (task.pass_threshold)",
    ]


def _reference_kwargs(cfg: TaskConfig, prompt, tokenizer) -> dict:
    """A prompt's reward keywords with its answer column as the completion ("" where it has none)."""
    from tidal.tasks.rewards import PROMPT_TEXT, call_kwargs, decode_row

    reference = decode_row(prompt.payload).get(cfg.answer_field)
    completion = reference if isinstance(reference, str) else ""
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"] if tokenizer is not None else []
    return call_kwargs({**prompt.payload, PROMPT_TEXT: prompt.text}, cfg.prompt_field, completion, ids)


def _check_range(cfg: TaskConfig, reward: float, scored: str) -> None:
    """A reward outside task.reward_range is one line: the learner would refuse every group holding one."""
    low, high = cfg.reward_range
    if not low <= reward <= high:
        raise ConfigError(
            f"config key 'task.reward_range' = [{low:g}, {high:g}]: {scored}, outside it; the learner "
            "refuses every group holding such a reward (widen task.reward_range, or rescale the "
            "rewards)"
        )


def _check_task_reward(cfg: TaskConfig, prompts: list) -> list[str]:
    from tidal.tasks import get_reward
    from tidal.tasks.user_code import where_raised

    reward, values = get_reward(cfg), []
    for prompt in prompts:
        completion = prompt.payload.get("answer", "")
        try:
            values.append(float(reward(completion, dict(prompt.payload))))
        except Exception as err:
            raise ConfigError(
                f"config key 'task.name' = {cfg.name!r}: its reward raised {type(err).__name__}: "
                f"{err}\n{where_raised(err, reward)}\n  (scoring training prompt {prompt.prompt_id}, "
                "completion = its payload's answer)"
            ) from None
        _check_range(
            cfg,
            values[-1],
            f"training prompt {prompt.prompt_id} scored {values[-1]:g} (completion = its payload's answer)",
        )
    return [
        f"reward of task {cfg.name} on {len(prompts)} training prompts, completion = the payload's answer: "
        f"{_listed(values)}"
    ]


def _completion_said(cfg: TaskConfig, reference) -> str:
    if reference is None:
        return ", completion = '' (no answer column to use)"
    return f", completion = its {cfg.answer_field!r} column"


def _listed(values: list[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)
