"""Without Hydra (the GPU image has none) ``compose`` composes with framework.config.plainconf: the same
configs as Hydra for the overrides library and benchmark code use, the same one-line errors."""
import re

import pytest

from framework import ConfigError
from framework.config.plainconf import plain_composer, value
from framework.config import compose, validate

CASES = [
    [],
    ["+stage=zero3", "offload=cpu", "offload.params=cpu", "precision=bf16", "model=gpt-1b", "train.micro_batch=16"],
    ["+stage=zero2", "offload=nvme", "offload.sub_group_size=1000000", "offload.aio.queue_depth=4", "logger=none",
     "optimizer=lion", "scheduler=constant", "train.grad_clip=0"],
    ["+stage=zero3", "stage.gather_unit=[Block,Linear]", "dist.backend=gloo", "checkpoint.async=true",
     "checkpoint.every=5", "model.dropout=0.1", "~model.bias", "model.bias=false", "seed=7"],
    ["logger=wandb", "logger.tags=[a,'b c']", "logger.entity=null", "precision=fp16", "precision.loss_scale=128"],
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
    (["+stage=zero5"], "unknown stage 'zero5' (did you mean 'zero3'?)"),
    (["train.steps=abc"], "train.steps: Value 'abc'"),
    (["train.steps=1e3"], "train.steps: Value '1000.0'"),
    (["train.steps=${seed}"], "needs Hydra"),
    (["train.steps=1,2"], "needs Hydra"),
])
def test_plain_errors_are_one_line(overrides, message, typing):
    typing()
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(*plain_composer(overrides))


def test_values_read_as_hydra_reads_them():
    assert [value(v) for v in ("1e9", "12", "0.5", "null", "true", "abc", "'x y'", "[1,'a,b',c]", "")] == \
        [1e9, 12, 0.5, None, True, "abc", "x y", [1, "a,b", "c"], ""]
