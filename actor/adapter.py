"""A LoRA adapter as the weight channels deliver it (learner.lora), inside a vLLM worker.

    channel ──(name, tensor) pairs──► AdapterStash.load_weights   (in place of the model's own)
    the update received whole        ► AdapterStash.received       (the version becomes the current one)
    finish_weight_update             ► vLLM resets its LoRA state  (every adapter dropped)
    actor: collective_rpc            ► AdapterStash.install        (the current version, or a zero adapter
                                                                     before the first, under ADAPTER_ID)

Every request carries the one adapter id, and each version replaces the adapter's weights under that
id while the engine is paused: requests in flight go on under the new adapter, as they do under new
full weights, so each token's recorded version stays right, and the engine holds one adapter however
many versions pass. An update that fails part-way leaves the previous adapter installed (its tensors
are kept until a new version has arrived whole), so an adapter engine is never torn. An adapter the
engine cannot serve as the learner holds it (a rank above the engine's, tensors of another rank or of
another base's shapes, modules the model lacks) is refused from its announcement, before any byte
of it lands; one that fails at install all the same puts the previous version back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ADAPTER_ID = 1  # the one LoRA id of an actor's engine; vLLM's ids start at 1
ADAPTER_NAME = "tidal-policy"
# PEFT's saved names: base_model.model.<module path>.lora_A.weight ([r, in]) and lora_B.weight ([out, r])
PEFT_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


@dataclass(frozen=True)
class Served:
    """What adapters the engine's model can serve: its max_lora_rank, and (in, out) features per module an
    adapter may carry, named as PEFT's module paths are once vLLM's renaming applies (a packed module's
    parts, such as q_proj, k_proj and v_proj, each under its own name)."""

    max_rank: int
    features: dict[str, tuple[int, int]]
    mapper: object = None  # the model's hf_to_vllm renaming of adapter names, if it has one

    @classmethod
    def of(cls, model, max_rank: int) -> Served:
        from vllm.model_executor.layers.linear import LinearBase

        packed = getattr(model, "packed_modules_mapping", {}) or {}
        features = {}
        for name, module in model.named_modules():
            base = getattr(module, "base_layer", None)
            if not isinstance(base, LinearBase):
                continue  # not a linear layer vLLM wrapped for LoRA
            prefix, _, leaf = name.rpartition(".")
            parts, outs = packed.get(leaf, []), _out_features(base)
            if len(parts) > 1 and len(parts) == len(outs):
                features.update({f"{prefix}.{part}": (base.input_size, out) for part, out in zip(parts, outs)})
            else:
                features[name] = (base.input_size, base.output_size)
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        return cls(max_rank, features, mapper.get_rename_mapper() if mapper is not None else None)

    def problem(self, spec, manifest) -> str | None:
        """Why an adapter of `spec` with these tensors is not one this engine serves as the learner holds it."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        if spec.rank > self.max_rank:
            return f"rank {spec.rank}, above the engine's max_lora_rank {self.max_rank} (learner.lora.rank differs)"
        for tensor in manifest:
            module, is_a = parse_fine_tuned_lora_name(tensor.name, self.mapper)
            module = module.removeprefix("base_model.model.")
            if module not in self.features:
                return f"{tensor.name!r} is for a module the served model lacks ({module})"
            inputs, outputs = self.features[module]
            want = (spec.rank, inputs) if is_a else (outputs, spec.rank)
            if tuple(tensor.shape) != want:
                return (
                    f"{tensor.name!r} is {list(tensor.shape)}, not {list(want)} (rank {spec.rank} over the served "
                    f"model's {inputs} -> {outputs}): an adapter of another rank or another base model"
                )
        return None


def _out_features(base) -> list[int]:
    """A linear layer's output features per part, as the checkpoint holds them (whatever the tensor
    parallelism: a q/k/v layer's key and value heads may be replicated across ranks)."""
    if hasattr(base, "total_num_kv_heads"):  # q, k and v in one
        kv, value_size = base.total_num_kv_heads, getattr(base, "v_head_size", base.head_size)
        return [base.total_num_heads * base.head_size, kv * base.head_size, kv * value_size]
    return list(getattr(base, "output_sizes", None) or [base.output_size])


class AdapterStash:
    """What the weight channels load an adapter version into, in place of the model: a model's surface
    to the loaders (no parameters of its own, `load_weights` keeping host copies of what lands), and the
    versions kept for `install`."""

    def __init__(self):
        self.current = None  # (AdapterSpec, {name: tensor}, version) of the newest version received whole
        self.previous = None  # the one before: installed again if `current` fails to install
        self.incoming: dict = {}  # the version being received
        self.spec, self.expected, self.version = None, set(), -1

    # the loaders' view of a model: nothing to copy into, nothing left unloaded
    def parameters(self):
        return iter(())

    def modules(self):
        return iter(())

    def named_parameters(self, remove_duplicate: bool = True):
        return iter(())

    def load_weights(self, weights) -> set[str]:
        names = set()
        for name, tensor in weights:
            if name not in self.expected:
                raise ValueError(f"weights v{self.version}: adapter tensor {name!r} is not in its announcement")
            self.incoming[name] = tensor.detach().to("cpu", copy=True)  # the channel reuses its buffers
            names.add(name)
        return names

    def begin(self, update, served: Served | None = None) -> None:
        """A new version starts arriving: `update`, a WeightUpdate with its `adapter`, checked against
        what the engine serves (`served`; None outside vLLM)."""
        if update.adapter is None:
            raise ValueError(
                f"weights v{update.version} are a whole model, but this engine serves a LoRA adapter "
                "(learner.lora.rank > 0 when it started): its updates must be adapters"
            )
        bad = [s.name for s in update.manifest if not PEFT_NAME.match(s.name)]
        if bad:
            raise ValueError(
                f"weights v{update.version}: {len(bad)} tensors are not a LoRA adapter's "
                f"(base_model.model.<module>.lora_A|lora_B.weight), e.g. {bad[:3]}"
            )
        why = served.problem(update.adapter, update.manifest) if served is not None else None
        if why:
            raise ValueError(f"weights v{update.version}: an adapter this engine cannot serve: {why}")
        self.spec, self.version = update.adapter, update.version
        self.expected, self.incoming = {s.name for s in update.manifest}, {}

    def received(self) -> None:
        """The version arrived whole: it is the one `install` installs from now on."""
        missing = self.expected - set(self.incoming)
        if missing:
            raise ValueError(
                f"weights v{self.version}: {len(missing)} adapter tensors never arrived, e.g. {sorted(missing)[:3]}"
            )
        if self.current is not None:
            self.previous = self.current
        self.current, self.incoming = (self.spec, self.incoming, self.version), {}

    def install(self, worker_lora_manager) -> int:
        """The current version (a zero adapter before the first) into vLLM's LoRA manager under
        ADAPTER_ID, replacing what was there; the version installed (-1: the zero adapter). One that
        fails puts the version before it back, and then raises: the engine is never left without one."""
        try:
            return self._install(worker_lora_manager)
        except Exception as err:
            if self.current is None:
                raise  # the zero adapter: nothing before it
            failed, self.current, self.previous = self.current, self.previous, None
            before = self._install(worker_lora_manager)
            raise RuntimeError(
                f"the adapter of weights v{failed[2]} did not install ({err}); v{before} serves on"
            ) from err

    def _install(self, worker_lora_manager) -> int:
        manager = worker_lora_manager._adapter_manager
        lora = self._zero(worker_lora_manager) if self.current is None else self._lora(worker_lora_manager)
        manager.remove_adapter(ADAPTER_ID)
        manager.add_adapter(lora)
        manager.activate_adapter(ADAPTER_ID)
        return -1 if self.current is None else self.current[2]

    @staticmethod
    def _zero(worker_lora_manager):
        """An adapter of zeros on every module vLLM gives one: the base model's own outputs."""
        rank = worker_lora_manager.lora_config.max_lora_rank
        return worker_lora_manager._adapter_manager.create_dummy_lora(
            ADAPTER_ID, rank, worker_lora_manager.embedding_modules
        )

    def _lora(self, worker_lora_manager):
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        spec, tensors, _ = self.current
        manager = worker_lora_manager._adapter_manager
        check_modules(tensors, manager)
        helper = PEFTHelper.from_dict(
            {
                "r": spec.rank,
                "lora_alpha": spec.alpha,
                "target_modules": list(spec.target_modules),
                "vllm_max_position_embeddings": worker_lora_manager.max_position_embeddings,
            }
        )
        helper.validate_legal(worker_lora_manager.lora_config)  # a rank above the engine's max_lora_rank, ...
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        # copies: vLLM folds alpha / r into B in place, and a version is installed again after any update
        return LoRAModel.from_lora_tensors(
            ADAPTER_ID,
            {name: t.clone() for name, t in tensors.items()},
            helper,
            device="cpu",
            dtype=worker_lora_manager.lora_config.lora_dtype,
            model_vocab_size=worker_lora_manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None),
        )


def check_modules(tensors: dict, manager) -> None:
    """Every tensor is for a module vLLM serves an adapter on (its loader from a folder checks the same)."""
    expected = set()
    for module in manager.supported_lora_modules:
        expected.update(manager.packed_modules_mapping.get(module, [module]))
    unknown = sorted({m["module"].rsplit(".", 1)[-1] for name in tensors if (m := PEFT_NAME.match(name))} - expected)
    if unknown:
        raise ValueError(
            f"the adapter has tensors for {unknown}, which this engine's model serves no LoRA on "
            f"(it does on: {sorted(expected)})"
        )
