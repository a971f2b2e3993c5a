"""model.*: which weights the actors serve and the learner trains, and the tiny model built
locally (model.tiny, with its supervised warm start model.tiny.warmstart)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tidal.config.base import Dtype, Section, _require, opt


# StrEnum: code outside the config reads it as its word (why: tidal/config/base.py)
class LmHead(enum.StrEnum):
    fp32 = "fp32"
    served = "served"


@dataclass(frozen=True)
class WarmStartConfig(Section):
    """Supervised warm start of the tiny model, so RL starts from a non-zero pass rate."""

    max_steps: int = opt(2000, "upper bound on SFT steps")
    target_greedy_pass_rate: float = opt(
        0.9, "stop once greedy decoding solves this fraction of val prompts at stable_checks checks in a row"
    )
    stable_checks: int = opt(
        1,
        "checks in a row that must reach target_greedy_pass_rate: one pass can be a lucky jump "
        "(0.52 -> 0.93 in 25 steps) that leaves the model short of what RL needs",
    )
    format_noise: float = opt(0.0, "fraction of SFT answers followed by stray characters before <eos>")
    check_every: int = opt(25, "SFT steps between pass-rate checks")
    batch_size: int = opt(256, "sequences per SFT step")
    lr: float = opt(3e-3, "AdamW learning rate")
    seed: int = opt(0, "init and data-order seed")


@dataclass(frozen=True)
class TinyModelConfig(Section):
    """A small Qwen2 built locally (no download) with a character-level tokenizer."""

    hidden_size: int = opt(128, "model width")
    num_layers: int = opt(4, "decoder layers")
    num_heads: int = opt(4, "attention heads (head_dim = hidden_size / num_heads; 32 or 64 on CPU)")
    num_kv_heads: int = opt(2, "key/value heads (grouped-query attention)")
    intermediate_size: int = opt(512, "MLP width")
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)

    def check(self) -> None:
        _require(
            self.hidden_size % self.num_heads == 0,
            "model.tiny.num_heads",
            self.num_heads,
            "must divide model.tiny.hidden_size",
        )
        head_dim = self.hidden_size // max(self.num_heads, 1)
        _require(
            head_dim in (32, 64, 128),
            "model.tiny.num_heads",
            self.num_heads,
            f"head_dim {head_dim} is not 32, 64 or 128 (vLLM's CPU attention rejects others)",
        )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "model.tiny.num_kv_heads",
            self.num_kv_heads,
            "must divide model.tiny.num_heads",
        )


@dataclass(frozen=True)
class ModelConfig(Section):
    """Which weights the actors serve and the learner trains."""

    path: str = opt(
        "",
        "a Hugging Face model folder, or a Hub id (org/name) fetched into the Hugging Face cache "
        "(HF_HUB_OFFLINE=1: the cache only); empty builds (or reuses) the tiny model",
    )
    revision: str = opt("", "Hub ids: a branch, tag or commit; empty = main")
    cache_dir: str = opt("~/.cache/tidal/models", "where built tiny models are kept, keyed by config")
    dtype: Dtype = opt(Dtype.float32, "what the actors serve (and weights travel in)")
    head: LmHead = opt(
        LmHead.fp32,
        "the LM head's numerics, alike on both sides: fp32 = the learner computes logits "
        "from its fp32 master head weights; served = from the head weights in model.dtype, "
        "its hidden states rounded to model.dtype, products summed in fp32, which is what "
        "the actors compute. Either way an actor serving bfloat16 or float16 computes its "
        "head in fp32 (vLLM's head_dtype) instead of rounding its logits to model.dtype",
    )
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def check(self) -> None:
        self.tiny.check()
        _require(
            not self.revision or bool(self.path),
            "model.revision",
            self.revision,
            "names a version of a Hub model: set model.path to its id (org/name)",
        )
