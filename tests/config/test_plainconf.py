"""Without Hydra (the GPU image has none) ``compose`` composes with framework.config.plainconf: the same
configs as Hydra for the overrides library and benchmark code use, the same one-line errors."""
import dataclasses
import re
import types
from typing import Union, get_args, get_origin, get_type_hints

import pytest

from framework import ConfigError
from framework.config.plainconf import HYDRA_KEYS, plain_composer, typed, value
from framework.config.schema import RootSchema
from framework.core.registry import GROUPS, registry
from framework.config import compose, validate

CASES = [
    [],
    ["+stage=zero3", "offload=cpu", "offload.params=cpu", "precision=bf16", "model=gpt-1b", "train.micro_batch=16"],
    ["+stage=zero2", "offload=nvme", "offload.sub_group_size=1000000", "offload.aio.queue_depth=4", "logger=none",
     "optimizer=lion", "scheduler=constant", "train.grad_clip=0"],
    ["+stage=zero3", "stage.gather_unit=[Block,Linear]", "dist.backend=gloo", "checkpoint.async=true",
     "checkpoint.every=5", "model.dropout=0.1", "~model.bias", "model.bias=false", "seed=7"],
    ["logger=wandb", "logger.tags=[a,'b c']", "logger.entity=null", "precision=fp16", "precision.loss_scale=128"],
    # booleans spelled as OmegaConf spells them, or a string of 0/1
    ["+stage=zero2", "stage.overlap_comm=y", "stage.contiguous_gradients=N", "model.bias='0'",
     "model.tie_weights='1'"],
    # spaces around a value dropped, escaped ones kept; escapes and the characters Hydra takes unquoted
    ["train.steps=5\\ ", "checkpoint.dir= C:/x-1_+.$%*@?|\\=\\(y\\)\\ "],
]


@pytest.fixture(params=["omegaconf", "plain"])
def typing(request, monkeypatch):
    """Values typed by OmegaConf, or (as without it) by framework.config.plainconf."""
    return lambda: monkeypatch.setattr("framework.config.checks.OmegaConf", None) if request.param == "plain" else None


@pytest.mark.parametrize("overrides", CASES)
def test_the_plain_composer_gives_what_hydra_gives(overrides, typing):
    expected = compose(overrides).to_dict()
    typing()
    assert validate(*plain_composer(overrides)).to_dict() == expected


@pytest.mark.parametrize("overrides,message", [
    (["train.stesp=3"], "unknown key 'train.stesp' (did you mean 'train.steps'?)"),
    (["stage=zero3"], "use +stage=zero3"),
    (["+stage=zero5"], "unknown stage 'zero5' (did you mean 'zero1', 'zero2' or 'zero3'?)"),
    (["train.steps=abc"], "train.steps takes an integer (5e8 reads as 500000000), got 'abc'"),
    (["train.steps=1.5"], "train.steps takes an integer (5e8 reads as 500000000), got 1.5"),
    (["optimizer.decay_1d=2"], "optimizer.decay_1d takes true or false (also yes/no, on/off, 1/0), got 2"),
    (["model.tie_weights=5"], "model.tie_weights takes true or false (also yes/no, on/off, 1/0), got 5"),
    *(([f"model.tie_weights={v}"], f"model.tie_weights takes true or false (also yes/no, on/off, 1/0), got "
                                   f"'{v.strip(chr(39))}'") for v in ("'2'", "'-1'")),   # (OmegaConf: true)
    (["optimizer.lr=abc"], "optimizer.lr takes a number (such as 3e-4), got 'abc'"),
    (["logger=wandb", "logger.tags=foo"], "logger.tags takes a list, got 'foo'; give logger.tags=[foo]"),
    (["steps=5"], "unknown key 'steps' (did you mean 'train.steps'?)"),
    (["lr=1e-3"], "unknown key 'lr' (did you mean 'optimizer.lr'?)"),
    (["trian.steps=5"], "unknown key 'trian' (did you mean 'train'?)"),
    (["modle=gpt-mini"], "unknown key 'modle' (did you mean 'model'?)"),   # (a value: a group's name too)
    (["sead=3"], "unknown key 'sead' (did you mean 'seed'?)"),
    (["train.batch_size=4"], "unknown key 'train.batch_size' (did you mean 'train.micro_batch'?)"),
    (["model.n_embd=256"], "unknown key 'model.n_embd' (did you mean 'model.d_model'?)"),
    (["model.hidden_size=256"], "unknown key 'model.hidden_size' (did you mean 'model.d_model'?)"),
    # a top-level key names a key anywhere by its name or another tool's name for it, never by a near spelling
    *(([key], f"unknown key '{key.split('=')[0]}' (did you mean '{ours}'?)") for key, ours in (
        ("save_steps=10", "checkpoint.every"), ("per_device_train_batch_size=8", "train.micro_batch"),
        ("eval_steps=5", "train.eval_every"), ("logging_steps=5", "train.log_every"), ("world_size=2", "dist.nproc"),
        ("max_steps=5", "train.steps"), ("gradient_accumulation_steps=2", "train.grad_accum"),
        ("learning_rate=1e-3", "optimizer.lr"), ("adam_epsilon=1e-8", "optimizer.eps"),
        ("gradient_checkpointing=true", "model.activation_checkpointing"))),
    (["+stage=zero2", "offload=nvme", "block_size=1024"], "'block_size' (did you mean 'offload.aio.block_size'?)"),
    *((overrides, f"unknown key '{overrides[-1].split('=')[0]}'; valid top-level keys") for overrides in (
        ["device=cpu"], ["report_to=wandb"], ["run_name=x"], ["name=x"], ["model=hf", "hidden_size=64"],
        ["model=hf", "report_to=x"], ["model=hf", "run_name=x"], ["model=hf", "name=x"])),
    (["train.steps=${seed}"], "needs Hydra"),
    (["train.steps=1,2"], "needs Hydra"),
    (["train={steps:5}"], "override 'train={steps:5}' gives a mapping ({...}), which needs Hydra"),
    (["+stage=zero3", "stage.gather_unit=[Block,]"], "the list [Block,] has an empty item; drop the extra comma"),
    (["logger=wandb", "logger.tags=[a,,b]"], "has an empty item"),
    # what Hydra's grammar refuses is refused, not taken for a sweep that needs Hydra
    (["optimizer.lr=1e-3,"], "cannot parse override 'optimizer.lr=1e-3,': it has an empty item; drop the extra comma"),
    (["optimizer.betas=(0.9,0.95)"], "cannot parse override 'optimizer.betas=(0.9,0.95)': parentheses hold only a "
                                     "sweep's choice(), range() or glob(); a list is written [a,b]"),
    # a value quoted in parts (Hydra's grammar refuses it): not taken with its inner quotes
    *(([f"checkpoint.dir={v}"], f"config: the value {v} is quoted in parts; quote it once as a whole") for v in
      ("'a'/'b'", "'it''s'", '"a"-"b"')),
    # a quote that never closes (the last one escaped) is not a value quoted in parts
    (["checkpoint.dir='a\\'"], "config: the value 'a\\' has no closing ' (\\' is a quote inside the value); end it "
                                "with an unescaped '"),
    (["checkpoint.dir=\"abc"], "config: the value \"abc has no closing \"; end it with an unescaped \""),
    # a group added where it is chosen already: the lines Hydra's composer gives (tests/config/test_config.py)
    (["+stage=zero2", "+stage=zero3"], "config: stage given twice (+stage=zero2, +stage=zero3): give +stage=NAME once"),
    (["+model=gpt2-small"], "config: model is already chosen in the defaults (model: gpt-nano): use model=gpt2-small, "
                            "without +"),
    # Hydra's own keys: a typo named as with Hydra (tests/cli/test_cli.py); its search path needs Hydra
    (["hydra.run.dri=x"], "config: unknown key 'hydra.run.dri' of Hydra's config (did you mean 'hydra.run.dir'?)"),
    (["+hydra.foo=1"], "config: unknown key 'hydra.foo' of Hydra's config; --cfg hydra shows its keys"),
    (["hydra.searchpath=[file:///x]"], "config: hydra.searchpath=[file:///x]: a search path for config groups needs "
                                       "Hydra: pip install -e ."),
])
def test_plain_errors_are_one_line(overrides, message, typing):
    typing()
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(*plain_composer(overrides))


def test_hydra_keys_compose_as_with_hydra():
    """A valid hydra.* key composes to the config it leaves out, with Hydra or without; the keys known without
    Hydra are Hydra's own config's."""
    import typing as t
    from hydra.conf import HydraConf

    def keys(schema, prefix=""):
        for name, kind in t.get_type_hints(schema).items():
            yield prefix + name
            if dataclasses.is_dataclass(kind):
                yield from keys(kind, f"{prefix}{name}.")
    assert HYDRA_KEYS == frozenset(keys(HydraConf))
    given = ["hydra.run.dir=x", "+hydra.job.env_set.A=1", "hydra.sweep.subdir=s", "train.steps=3"]
    assert validate(*plain_composer(given)).to_dict() == compose(given).to_dict()


@pytest.mark.parametrize("override", ["checkpoint.dir=~/ckpt", "checkpoint.dir=a=b", "checkpoint.dir=a#b",
                                      "checkpoint.dir=a;b", "checkpoint.dir=a&b", "checkpoint.dir=a'b",
                                      "checkpoint.dir=(a)", "checkpoint.dir=a(b)", "logger.tags=[a;b]",
                                      " train.micro_batch=4", "train.micro_batch =4"])
def test_what_hydra_cannot_parse_is_refused_without_it(override):
    with pytest.raises(ConfigError, match="cannot parse override"):
        compose([override])
    with pytest.raises(ConfigError, match=r"holds only quoted; quote it \(|a key holds no spaces"):
        plain_composer([override])


@pytest.mark.parametrize("given", ["\"a\"'b'", "a'b", "it's \"x\"", "a\\'b"])
def test_the_quoting_advised_is_taken_as_the_value(given):
    """The value a refusal suggests quoting is one the check takes, and it is the value given."""
    with pytest.raises(ConfigError, match="holds only quoted; quote it") as e:
        plain_composer([f"checkpoint.dir={given}"])
    advised = re.search(r"quote it \((.*)\)$", str(e.value)).group(1)
    assert plain_composer([f"checkpoint.dir={advised}"])[0]["checkpoint"]["dir"] == given


def test_integral_floats_are_integers(typing):
    typing()   # (Hydra's grammar reads 5e8 as a float)
    cfg = validate(*plain_composer(["+stage=zero2", "stage.reduce_bucket_size=5e8", "train.steps=1e3"]))
    assert (cfg.train.steps, cfg.stage.reduce_bucket_size) == (1000, 500_000_000)
    assert type(cfg.train.steps) is int and type(cfg.stage.reduce_bucket_size) is int


def test_values_read_as_hydra_reads_them():
    assert [value(v) for v in ("1e9", "12", "0.5", "null", "true", "abc", "'x y'", "[1,'a,b',c]", "")] == \
        [1e9, 12, 0.5, None, True, "abc", "x y", [1, "a,b", "c"], ""]
    # Only backslashes before a quote (or the closing one) escape, as in Hydra's grammar (a Windows path kept both)
    quoted = [r"'C:\\data\\x'", r"'a\\b'", r"'a\'b'", r"'C:\\'", r"'a\\\'b'", r"'a\b'", r'"x\\y\"z"']
    from framework.config.composition import parse_overrides
    assert [value(v) for v in quoted] == [parse_overrides([f"x={t}"])[0].value() for t in quoted]


# Numbers as Hydra's grammar has them (ASCII digits, '_' only between digits, no leading zeros, inf/nan);
# the rest stays the string given.
NUMBERS = ["007", "00", "0_1", "Infinity", "inf", "-INF", "+nan", "1_", "1__0", "1_000", "0", "-0", "+5", "1e9",
           "1E-3", "1.", "1.e5", ".5", "00.5", "1_0.5_1", "1e1_0", "1.5.3", "5_", "_5", "0x10", "1e", "12abc"]


def test_numbers_read_as_hydra_reads_them():
    from framework.config.composition import parse_overrides

    def same(v):
        return (type(v).__name__, "nan" if v != v else v)
    hydra = [same(parse_overrides([f"x={t}"])[0].value()) for t in NUMBERS]
    assert [same(value(t)) for t in NUMBERS] == hydra
    with pytest.raises(ConfigError, match="other than ASCII; quote it"):   # (Hydra refuses these unquoted)
        plain_composer(["seed=\u0661\u0662"])
    assert value("'\u0661'") == "\u0661"


def _unions(schema: type, prefix: str = "") -> list[tuple[str, object]]:
    """(key, hint) of every union in ``schema`` and the dataclasses under it."""
    out = []
    for name, hint in get_type_hints(schema).items():
        for h in (hint, *get_args(hint)):
            if get_origin(h) in (Union, types.UnionType):
                out.append((prefix + name, h))
            if dataclasses.is_dataclass(h):
                out += _unions(h, f"{prefix}{name}.")
    return out


def test_every_schema_union_is_x_or_none():
    """The plain composer (like OmegaConf) converts ``X | None`` only; a wider union would be refused
    on first use, so catch one when it is written."""
    schemas = [("", RootSchema)] + [(f"{g}.{n}.", registry(g).get(n).config) for g in GROUPS
                                     for n in registry(g).names()]
    found = [(p + k, h) for p, s in schemas for k, h in _unions(s)]
    assert found, "the walk found no union at all: it is not looking"
    wide = [(k, h) for k, h in found if len([a for a in get_args(h) if a is not type(None)]) != 1
            or type(None) not in get_args(h)]
    assert not wide, wide


def test_a_wider_union_is_a_schema_error_naming_the_key():
    @dataclasses.dataclass
    class Bad:
        size: int | str = 1

    with pytest.raises(TypeError, match=r"schema of x\.size: .* is not 'X \| None'"):
        typed({"size": 2}, Bad, "x.")


# Hydra's +, ++ and ~ overrides (of keys and of groups) and its escapes: the plain composer gives Hydra's
# config, or refuses as Hydra does (one line; the same words where Hydra's are clear).
SAME_AS_HYDRA = [
    (["+train.steps=5"], "An item is already at 'train.steps'"), (["+optimizer.lr=1"], "'++optimizer.lr=1'"),
    (["++optimizer=lion"], "force-add of config groups is not supported"), (["++stage=zero1"], "force-add"),
    (["+optimizer=lion"], None), (["~stage"], "Could not delete 'stage'. No match in the defaults list"),
    (["+stage=zero1", "~stage"], ""), (["~optimizer=adamw"], "no optimizer chosen"),
    (["~optimizer=lion"], "Could not delete 'optimizer=lion'. No match in the defaults list"),
    (["~train.steps=300"], "train.steps has no value (a missing mandatory value"),
    (["~train.steps=5"], "is 300 and not 5."),
    (["~train.stepz"], "'train.stepz' does not exist. (did you mean 'train.steps'?)"),
    (["~scheduler.min_lr"], "'scheduler.min_lr' does not exist."), (["+stage=zero3", "~stage.stage3_max_reuse_distance=1000000000"], ""),
    (["train.steps=5", "~train"], "missing mandatory value"), (["model@model=gpt-mini"], None),
    (["checkpoint.dir=a\\ b"], ""), (["checkpoint.dir=a\\:b\\=c\\\\d\\e"], ""),
    # commas in quotes or escaped are no sweep; a list item cannot be empty
    (["checkpoint.dir='a,b'"], ""), (["checkpoint.dir=a\\,b"], ""), (["logger=wandb", "logger.tags=[a,'b,c',d\\,e]"], ""),
    (["+stage=zero3", "stage.gather_unit=[Block,]"], None), (["logger=wandb", "logger.tags=[a,,b]"], None),
]


@pytest.mark.parametrize("overrides,says", SAME_AS_HYDRA)
def test_plus_and_delete_overrides_as_hydra(overrides, says):
    from framework.config.composition import CommandLine

    def run(plain):
        try:
            if plain:
                return validate(*plain_composer(list(CommandLine.parse(overrides).forced))).to_dict()
            return compose(overrides).to_dict()
        except ConfigError as e:
            assert "\n" not in str(e)
            return "refused: " + str(e)
    hydra, plain = run(False), run(True)
    if says == "":
        assert plain == hydra and isinstance(hydra, dict)
    else:
        assert isinstance(hydra, str) and isinstance(plain, str), (hydra, plain)
        assert says is None or says in plain, plain


def test_a_keyword_field_is_named_as_yaml_spells_it():
    # (the schema's async_ is checkpoint.async in every message, with Hydra or without it)
    from framework.config.schema import CheckpointConfig

    with pytest.raises(ConfigError, match=r"^config: checkpoint\.async takes true or false \(.*\), got null$"):
        typed({"async_": None}, CheckpointConfig, "checkpoint.")
    assert typed({"async_": True}, CheckpointConfig, "checkpoint.").async_ is True
