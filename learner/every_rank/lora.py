"""LoRA on the policy (learner.lora): a peft adapter injected into the model in place, so that the
module tree the trainer runs stays the model's (`policy.model(...)`, the fused logprob head on
`policy.lm_head.weight`) and the kernels and every loss work unchanged.

    the base      frozen, held in the compute dtype (no fp32 master copy, no gradient, no AdamW state);
                  under model.head = fp32 the LM head (and the embedding tied to it) stays fp32
    the adapter   lora_A [r, in] and lora_B [out, r] of each targeted linear layer, in learner.param_dtype
                  (fp32), the only parameters AdamW sees and a checkpoint holds

Its tensors go by three names:

    in the module          model.layers.3.self_attn.q_proj.lora_A.default.weight  (base: ...q_proj.base_layer.weight)
    pushed and exported    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  (PEFT's saved names)
    merged                 model.layers.3.self_attn.q_proj.weight = W + (alpha / r) B A  (the model's own)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from tidal.config import LoraConfig

ADAPTER = "default"  # peft's name for the one adapter the policy carries
PEFT_PREFIX = "base_model.model."  # what PEFT's saved names put before the model's module path
FACTORS = ("lora_A", "lora_B")


def layer_linears(policy) -> list[str]:
    """The paths of the linear layers inside the policy's decoder layers (self_attn.q_proj, ...), each once."""
    found: dict[str, None] = {}
    for layer in policy.model.layers:
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                found[name] = None
    return list(found)


def peft_config(cfg: LoraConfig, base_model: str | None = None):
    """learner.lora as peft's LoraConfig (what adapter_config.json holds)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        layers_to_transform=list(cfg.layers) or None,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )


def attach(policy, cfg: LoraConfig, adapter_dtype: str, head_dtype: str | None = None) -> None:
    """Freeze `policy` and inject learner.lora's adapter into it in place (in `adapter_dtype`); with
    `head_dtype` the LM head (and a tied embedding) is cast to it first. ConfigError naming the targets
    or layers the model lacks. The adapter's values are set by `initialize` (a meta-device policy has none)."""
    from peft import inject_adapter_in_model

    cfg.check_model(layer_linears(policy), len(policy.model.layers))
    policy.requires_grad_(False)
    if head_dtype is not None:
        policy.lm_head.to(getattr(torch, head_dtype))
    with torch.random.fork_rng(devices=[]):  # peft initializes from the global generator: `initialize` from the seed
        inject_adapter_in_model(peft_config(cfg), policy)
    for _, param in adapter_parameters(policy):
        param.data = param.data.to(getattr(torch, adapter_dtype))


def adapter_parameters(module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters() if is_adapter(name)]


def initialize(module, seed: int) -> None:
    """The adapter's starting values, the same on every rank however the policy was built (on the meta
    device or not): A as torch.nn.Linear initializes a weight, from a generator seeded with `seed`, and B
    zero, so the policy starts as the base. Sharded, each rank keeps its shards (every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    generator = torch.Generator().manual_seed(seed)
    whole = {}
    for name, param in adapter_parameters(module):
        value = torch.zeros(param.shape, dtype=param.dtype)  # the whole shape, sharded or not
        if ".lora_A." in name:
            torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
        whole[name] = value
    if any(isinstance(p, DTensor) for _, p in adapter_parameters(module)):
        set_model_state_dict(module, whole, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    with torch.no_grad():
        for name, param in adapter_parameters(module):
            param.copy_(whole[name])


def is_adapter(name: str) -> bool:
    return any(f".{factor}." in name for factor in FACTORS)


def peft_name(name: str) -> str:
    """An adapter tensor's name in the module (relative to the policy) as PEFT saves it."""
    for factor in FACTORS:
        name = name.replace(f".{factor}.{ADAPTER}.", f".{factor}.")
    return PEFT_PREFIX + name


def model_name(name: str) -> str:
    """A base tensor's name in the module (relative to the policy) as the model's checkpoint has it."""
    return name.replace(".base_layer.", ".")


def merged(pairs: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the policy's state (the module's names, relative to the policy) as the
    model's own state: each adapted weight W merged into W + scaling B A (in fp32, then in W's dtype), the
    adapter's tensors consumed. A module's base weight and its factors are held until all three have come
    (in the module's order they come one after the other)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}  # module path -> what of it has come
    for name, tensor in pairs:
        owner, part = _split(name)
        if owner is None:
            yield model_name(name), tensor
            continue
        parts = pending.setdefault(owner, {})
        parts[part] = tensor
        if len(parts) == 3:
            del pending[owner]
            weight, a, b = parts["weight"], parts["lora_A"], parts["lora_B"]
            delta = scaling * (b.float() @ a.float())  # [out, r] @ [r, in]
            yield f"{owner}.weight", (weight.float() + delta).to(weight.dtype)
    assert not pending, f"adapted modules without their base weight or a factor: {sorted(pending)}"


def merged_and_adapter(pairs: Iterable[tuple[str, torch.Tensor]], scaling: float, convert) -> dict[str, torch.Tensor]:
    """The final export's state from the policy's (name, tensor) pairs: `merged`, and beside it the adapter
    alone under PEFT's names, each tensor passed through `convert` (e.g. to host memory in the served dtype)."""
    adapter = {}

    def noting_the_adapter():
        for name, tensor in pairs:
            if is_adapter(name):
                adapter[peft_name(name)] = convert(tensor)
            yield name, tensor

    state = {name: convert(tensor) for name, tensor in merged(noting_the_adapter(), scaling)}
    return state | adapter


def _split(name: str) -> tuple[str | None, str]:
    """(module path, weight | lora_A | lora_B) of an adapted module's weight or factor; (None, '') otherwise."""
    for factor in FACTORS:
        marker = f".{factor}.{ADAPTER}.weight"
        if name.endswith(marker):
            return name.removesuffix(marker), factor
    if name.endswith(".base_layer.weight"):
        return name.removesuffix(".base_layer.weight"), "weight"
    return None, ""
