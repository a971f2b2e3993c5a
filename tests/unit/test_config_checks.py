"""A config that types and checks itself: every closed set an Enum, every section's rules in its own
check(), the weight channel's mistakes caught at load, and help read from the schema, not its source."""

import dataclasses
import enum
import typing

import pytest

from tidal.config import (
    Attention,
    ConfigError,
    CpuLinear,
    Curve,
    Dtype,
    KernelBackend,
    LmHead,
    MixedPrecision,
    Packing,
    RunConfig,
    Section,
    WeightsConfig,
    WeightTransport,
    choices,
    default_weights_dir,
    explain,
    field_help,
    load_config,
)

# the closed sets that were strings checked by hand
CLOSED_SETS = {
    "model.dtype": Dtype,
    "model.head": LmHead,
    "actor.vllm.cpu_linear": CpuLinear,
    "broker.zmq.curve": Curve,
    "weights.transport": WeightTransport,
    "learner.kernel_backend": KernelBackend,
    "learner.param_dtype": Dtype,
    "learner.mixed_precision": MixedPrecision,
    "learner.attention": Attention,
    "learner.packing": Packing,
}
# what a word needs beside it to load: flash-attn computes in half precision only
NEEDS = {"learner.attention=flash_attention_2": ["learner.mixed_precision=bf16"]}


def hint_of(key: str):
    cls = RunConfig
    *sections, name = key.split(".")
    for part in sections:
        cls = typing.get_type_hints(cls)[part]
    return typing.get_type_hints(cls)[name]


def sections(cls=RunConfig, prefix=""):
    """Every section's dotted path and class, the whole run's ("") first."""
    yield prefix.rstrip("."), cls
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            yield from sections(hint, f"{prefix}{name}.")


@pytest.mark.parametrize("key", sorted(CLOSED_SETS))
def test_every_closed_set_is_an_enum_and_each_word_loads(key):
    kind = CLOSED_SETS[key]
    assert hint_of(key) is kind
    for word in choices(kind):
        override = f"{key}={word}"
        cfg = load_config(None, [override, *NEEDS.get(override, [])])
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        assert value is kind(word) and value == word


@pytest.mark.parametrize("key", sorted(CLOSED_SETS))
def test_a_word_outside_a_closed_set_fails_at_load_naming_the_key(key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=bogus"])
    assert str(err.value) == f"config key '{key}' = 'bogus': expected one of {', '.join(choices(CLOSED_SETS[key]))}"


def test_a_bad_word_in_a_yaml_file_names_the_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learner:\n  packing: sharred\n")
    with pytest.raises(ConfigError, match=r"^config key 'learner\.packing' = 'sharred': expected one of auto, "):
        load_config(path)


def test_the_enums_that_were_strings_are_their_words():
    """Code outside the config compares, formats and looks these up as plain strings."""
    kinds = {kind for kind in CLOSED_SETS.values()}
    for kind in kinds:
        assert issubclass(kind, enum.StrEnum)
        for member in kind:
            assert member.name == member.value == member == f"{member}" == str(member)
            assert {member.value: 1}[member] == 1  # an enum hashes by name: it must be the word


@pytest.mark.parametrize("layer", ["yaml", "override"])
def test_mixed_precision_no_is_the_word_not_a_boolean(tmp_path, layer):
    """YAML 1.1 reads `no` as false; learner.mixed_precision takes it as the word (its default)."""
    path = tmp_path / "run.yaml"
    path.write_text("learner:\n  mixed_precision: no\n")
    cfg = load_config(path) if layer == "yaml" else load_config(None, ["learner.mixed_precision=no"])
    assert cfg.learner.mixed_precision is MixedPrecision.no
    with pytest.raises(ConfigError, match="config key 'learner.mixed_precision' = True: expected one of no, bf16"):
        load_config(None, ["learner.mixed_precision=yes"])


# the weight channel's mistakes that loaded cleanly and failed (or were silently changed) only once a process ran
WEIGHTS_MISTAKES = [
    (["weights.transport=tpc"], "weights.transport", "expected one of file, tcp, gloo, nccl"),
    (["weights.bucket_mib=0"], "weights.bucket_mib", "must be >= 1"),  # the file channel's ranges too
    (["weights.keep=0"], "weights.keep", "must be >= 1"),
    (["weights.transport=tcp", "weights.tcp_port=70000"], "weights.tcp_port", "must be in 0..65535"),
    (["weights.transport=tcp", "weights.tcp_timeout_s=0"], "weights.tcp_timeout_s", "must be > 0"),
    (["weights.transport=gloo", "weights.max_sends=0"], "weights.max_sends", "must be >= 1"),
    (["weights.transport=nccl", "weights.max_connections=0"], "weights.max_connections", "must be >= 1"),
]


@pytest.mark.parametrize("overrides, key, why", WEIGHTS_MISTAKES, ids=[m[1] for m in WEIGHTS_MISTAKES])
def test_weights_mistakes_fail_at_load_naming_the_key(overrides, key, why):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert message.startswith(f"config key '{key}' = ") and why in message and "\n" not in message


def test_the_transport_selects_which_weights_keys_matter():
    """The network channels' keys are not the file channel's: they load, unused, beside it."""
    cfg = load_config(None, ["weights.tcp_port=70000", "weights.max_sends=0", "weights.tcp_timeout_s=0"])
    assert cfg.weights.transport is WeightTransport.file


def test_a_channel_built_from_a_config_made_in_code_meets_the_same_rules():
    from tidal.broker.weights import TRANSPORTS, build_receiver, default_dir

    assert list(TRANSPORTS) == choices(WeightTransport)  # one channel module per word
    with pytest.raises(ConfigError) as at_load:
        load_config(None, ["weights.transport=tcp", "weights.tcp_port=70000"])
    with pytest.raises(ValueError) as at_build:
        build_receiver(WeightsConfig(transport="tcp", tcp_port=70000))
    assert str(at_build.value) == str(at_load.value)
    assert default_dir is default_weights_dir  # the folder rule lives in the config; the channel reads it


def test_every_section_checks_itself_and_the_defaults_pass():
    for path, cls in sections():
        assert issubclass(cls, Section), f"{path or 'RunConfig'} is no Section"
    RunConfig().check()


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.tiny.num_kv_heads=3"], "model.tiny.num_kv_heads"),  # a section inside a section
        (["sampling.interrupt.enabled=true"], "sampling.interrupt.min_tokens"),  # enabled selects the keys checked
        (["actor.vllm.tensor_parallel_size=0"], "actor.vllm.tensor_parallel_size"),
        (["actor.max_inflight=4"], "actor.max_inflight"),  # spans sections: sampling.n = 8 does not fit
        (["actor.colocate=true", "weights.transport=nccl"], "actor.colocate"),  # spans sections
    ],
)
def test_section_and_cross_section_rules_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=rf"^config key '{key}' = "):
        load_config(None, overrides)


def test_shared_packing_under_flash_attention_fails_at_load():
    """Was the trainer's error as the learner built its model; the explicit pair is known at load."""
    with pytest.raises(ConfigError, match=r"^config key 'learner.packing' = 'shared': shared needs attention"):
        load_config(
            None, ["learner.attention=flash_attention_2", "learner.mixed_precision=bf16", "learner.packing=shared"]
        )


def test_help_lives_in_the_schema_not_its_source(monkeypatch):
    import inspect

    def no_source(*args, **kwargs):
        raise AssertionError("help is read from the schema, never parsed from the source")

    monkeypatch.setattr(inspect, "getsource", no_source)
    for path, cls in sections():
        helps = field_help(cls)
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name]):
                assert f.metadata["help"] == helps[f.name] != "", f"{path}.{f.name}"
    assert explain("learner.optim.lr").startswith("learner.optim.lr (float, default 1e-06): AdamW learning rate")


def test_explain_prints_every_section_as_keys_with_types_defaults_and_help():
    for path, cls in sections():
        lines = explain(path).splitlines()
        header, rows = lines[0], lines[1:]
        assert header.startswith(f"{path or 'the whole run'}: ") and len(header) > len(path) + 10, header
        assert "Config(" not in explain(path)  # never a dataclass's repr
        assert len(rows) == len(dataclasses.fields(cls))
        for row, f in zip(rows, dataclasses.fields(cls)):
            assert row.startswith(f"  {f.name} (") and "): " in row and not row.endswith(": "), row
    transport = explain("weights.transport")
    assert transport.startswith("weights.transport (file | tcp | gloo | nccl, default 'file'): file: a safetensors")


def test_explain_below_a_value_says_so():
    with pytest.raises(ConfigError, match="'learner.optim.lr' is a value, not a section"):
        explain("learner.optim.lr.x")


@pytest.mark.parametrize(
    "override, key, value",
    [
        ("task.pass_on=", "pass_on", ""),  # was "Incompatible value 'None' for field of type 'str'"
        ("task.reward_funcs=", "reward_funcs", []),
    ],
)
def test_an_empty_value_clears_a_string_or_list_key(override, key, value):
    base = load_config(None, ["task.pass_on=accuracy", "task.reward_funcs=[a:accuracy]"])
    assert getattr(base.task, key) != value
    cleared = load_config(
        None,
        [
            "task.pass_on=accuracy",
            "task.reward_funcs=[a:accuracy]",
            override,
            *(["task.pass_on="] if key == "reward_funcs" else []),
        ],
    )
    assert getattr(cleared.task, key) == value


def test_an_empty_value_for_a_number_still_names_the_key():
    with pytest.raises(ConfigError, match="^config key 'learner.max_steps': "):
        load_config(None, ["learner.max_steps="])


def test_explain_lists_every_built_in_task_and_where_the_prompt_template_applies():
    from tidal.ops.preflight import TEMPLATED_TASKS
    from tidal.tasks import BUILTIN

    name = explain("task.name")
    assert f"built-in ({', '.join(sorted(BUILTIN))})" in name
    assert (
        explain("task.prompt_template")
        .split("): ")[1]
        .startswith(f"task {', '.join(TEMPLATED_TASKS)}'s string prompts (the other built-in tasks refuse it")
    )
