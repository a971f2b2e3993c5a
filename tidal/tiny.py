"""The tiny model: a small Qwen2 with a character-level tokenizer, built locally (no download).

`build_tiny_model` writes a Hugging Face model directory (config, safetensors weights,
tokenizer.json) that both vLLM and transformers load. The supervised warm start that makes
it useful lives in tidal.learner.tools.warmstart; the cache key covers everything that shapes it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import secrets
import shutil
import string
from dataclasses import asdict, dataclass
from pathlib import Path

from tidal.config import ConfigError, ModelConfig, TaskConfig, TinyModelConfig

PAD, EOS = "<pad>", "<eos>"


def build_tokenizer(alphabet: str):
    """A fast tokenizer with one token per character, plus <pad> (id 0) and <eos> (id 1)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, **{ch: i + 2 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)


DEFAULT_POSITIONS = 64


def max_positions(task_module) -> int:
    """The tiny model's context length: the task's MAX_POSITIONS, or 64 (prompt and answer of a short task)."""
    return int(getattr(task_module, "MAX_POSITIONS", DEFAULT_POSITIONS))


def cache_key(
    tiny: TinyModelConfig,
    task: TaskConfig,
    alphabet: str,
    positions: int = DEFAULT_POSITIONS,
    chat_template: str | None = None,
    teacher: str | None = None,
) -> str:
    """Hash of every input that shapes the warm-started model (architecture, SFT, task split)."""
    # only the task fields that shape the tiny task's prompts: keys added for other tasks must
    # not invalidate (and rebuild) every cached model; for the same reason the context length
    # enters the hash only where it differs from the one every earlier model was built with
    shaping = {k: getattr(task, k) for k in ("name", "max_operand", "num_val", "seed")}
    extra = {"positions": positions} if positions != DEFAULT_POSITIONS else {}
    if chat_template:  # a task's own template shapes its demonstrations (tasks without one keep their keys)
        extra["chat_template"] = chat_template
    if teacher:  # the source of a task that demonstrates episodes: a changed teacher builds a new model
        extra["teacher"] = teacher
    described = asdict(tiny)
    if described["warmstart"]["stable_checks"] == 1:  # as every model before the key existed was built
        del described["warmstart"]["stable_checks"]
    blob = json.dumps(
        {"tiny": described, "task": shaping, "alphabet": alphabet, "format": 2, **extra}, sort_keys=True, default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_model_path(model: ModelConfig, task: TaskConfig) -> Path:
    """Where the warm-started tiny model for this config lives (built by `tidal prepare`)."""
    from tidal.tasks import get_task

    module = get_task(task.name)
    alphabet, positions = getattr(module, "ALPHABET", None), max_positions(module)
    teacher = inspect.getsource(module) if hasattr(module, "demonstration") else None
    if alphabet is None:  # a task of one's own: its answers are the teacher, another dataset another model
        own = OwnTask.of(module, task)
        alphabet, positions, teacher = own.alphabet, own.positions, own.digest
    key = cache_key(model.tiny, task, alphabet, positions, getattr(module, "CHAT_TEMPLATE", None), teacher)
    return Path(model.cache_dir).expanduser() / f"tiny-{task.name.replace('/', '_')}-{key}"


OWN_TASK_HELP = "set model.path to a Hugging Face model, or see docs/tasks.md for what the tiny model needs"


@dataclass(frozen=True)
class OwnTask:
    """The tiny model of a task that names no ALPHABET (its own module, or rows): one token per printable
    ASCII character and per other character of its prompts and answers, context for its longest prompt and
    answer, warm-started to write each prompt's answer (the `answer` of its payload, or task.answer_field's
    column). Prompts must be text: chat messages need a model with a chat template."""

    alphabet: str
    positions: int
    pairs: tuple[tuple[str, str], ...]  # (prompt, answer) of the training then the held-out prompts
    num_train: int
    digest: str  # of the pairs: the cache key's teacher

    @classmethod
    def of(cls, module, task: TaskConfig) -> OwnTask:
        split = module.load_prompts(task)
        pairs = tuple(_answered(p, task) for p in [*split.train, *split.val])
        seen = {ch for text, answer in pairs for ch in text + answer}
        alphabet = "".join(sorted(set(string.printable.strip()) | {" "} | seen - {PAD, EOS}))
        longest = max((len(t) + len(a) for t, a in pairs), default=0) + 8  # an answer's <eos> and a slip
        positions = max(DEFAULT_POSITIONS, 1 << (longest - 1).bit_length())
        digest = hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]
        return cls(alphabet, positions, pairs, len(split.train), digest)


def _answered(prompt, task: TaskConfig) -> tuple[str, str]:
    answer = prompt.payload.get("answer", prompt.payload.get(task.answer_field))
    if prompt.messages is not None or not isinstance(answer, (str, int, float)):
        what = (
            "is chat messages"
            if prompt.messages is not None
            else f"has no answer (payload 'answer' or column task.answer_field = {task.answer_field!r})"
        )
        raise ConfigError(
            f"config key 'model.path' = '': task {task.name!r} names no ALPHABET, so the tiny model is "
            f"warm-started to write each prompt's answer, and prompt {prompt.prompt_id} {what}; "
            f"{OWN_TASK_HELP}"
        )
    return prompt.text, str(answer)


def build_tiny_model(
    tiny: TinyModelConfig,
    alphabet: str,
    seed: int,
    positions: int = DEFAULT_POSITIONS,
    chat_template: str | None = None,
):
    """A freshly initialised Qwen2ForCausalLM (fp32, tied embeddings) and its tokenizer (with the
    task's chat template, when it has one)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(alphabet)
    if chat_template:
        tokenizer.chat_template = chat_template
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        head_dim=tiny.hidden_size // tiny.num_heads,
        max_position_embeddings=positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def save_model(model, tokenizer, path: Path) -> None:
    """Write a loadable HF directory atomically: build under a temp name of this process's own, then
    rename. Two processes building the same model at once (two runs sharing a cache) each write their
    own; the first rename wins and the other's copy, the same model, is dropped."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:
        if not (path / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
