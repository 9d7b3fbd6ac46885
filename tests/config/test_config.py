"""Config groups = registries; every YAML composes and builds; strict validation."""
import dataclasses
import importlib.util
import json
import pickle
import re
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from framework import ConfigError, compose
from framework.config import COMPATIBLE, GROUPS, Config, validate
from framework.comm.distributed import connect
from framework.core.paths import conf_dir
from framework.core.registry import closest, closest_hint, components_of, registry
from tests._helpers import TINY

needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs wandb: pip install wandb")


@pytest.mark.parametrize("group", list(GROUPS))
def test_yaml_files_equal_registry_names(group):
    files = {p.stem for p in (conf_dir() / group).glob("*.yaml")}
    assert files == set(registry(group).names()), f"conf/{group}/*.yaml vs registry {group}"


def test_config_fields_cover_every_group():
    assert set(GROUPS) <= {f.name for f in dataclasses.fields(Config)}


def test_every_schema_key_is_in_the_conf_tree():
    """The command line (Hydra, struct mode) can set only the keys the YAML files have: every key of a
    schema must be in its file, or ``KEY=V`` fails there (where ``compose`` forces it in)."""
    import yaml

    from framework.config.schema import CheckpointConfig, DistConfig, RootSchema, TrainLoopConfig

    root = yaml.safe_load((conf_dir() / "train.yaml").read_text())
    missing = [f"train.yaml: {f.name}" for f in dataclasses.fields(RootSchema)
               if f.name not in root and f.name not in ("train", "dist", "checkpoint")]
    for section, schema in (("train", TrainLoopConfig), ("dist", DistConfig), ("checkpoint", CheckpointConfig)):
        missing += [f"train.yaml: {section}.{f.name.rstrip('_')}" for f in dataclasses.fields(schema)
                    if f.name.rstrip("_") not in root[section]]   # (YAML spells async_ async)
    for group in GROUPS:
        for path in sorted((conf_dir() / group).glob("*.yaml")):
            node = yaml.safe_load(path.read_text()) or {}
            missing += [f"{group}/{path.name}: {f.name}" for f in dataclasses.fields(registry(group).get(path.stem).config)
                        if f.init and f.name not in node]
    assert not missing, missing


def test_a_deleted_key_has_the_schema_default_which_is_train_yaml_and_says_so():
    """``~key`` gives the schema's default: the value train.yaml documents, labelled default (not YAML)."""
    import yaml

    from framework.config.schema import CheckpointConfig, DistConfig, TrainLoopConfig

    root = yaml.safe_load((conf_dir() / "train.yaml").read_text())
    differ = [f"{section}.{f.name}" for section, schema in (("train", TrainLoopConfig), ("dist", DistConfig),
                                                             ("checkpoint", CheckpointConfig))
              for f in dataclasses.fields(schema)
              if f.default is not dataclasses.MISSING and root[section][f.name.rstrip("_")] != f.default]
    assert not differ, differ
    cfg = compose(["~train.log_every", "~checkpoint", "~optimizer.weight_decay"])
    assert (cfg.train.log_every, cfg.optimizer.weight_decay) == (25, 0.1)
    assert {k: cfg.sources[k] for k in ("train.log_every", "checkpoint.every", "optimizer.weight_decay",
                                        "train.eval_every", "optimizer.beta2")} == \
        {"train.log_every": "default", "checkpoint.every": "default", "optimizer.weight_decay": "default",
         "train.eval_every": "YAML", "optimizer.beta2": "YAML"}


def _build(cfg, group):
    comp = registry(group).get(cfg.choices[group])
    node = getattr(cfg, group)
    if group == "optimizer":
        return comp.build(node, [True, False])
    if group == "scheduler":
        return comp.build(node, base_lr=0.1, total_steps=100)
    if group == "stage":
        return comp.build(node, dist=connect("gloo"), offload=registry("offload").get("none").build(None))
    if group == "data":
        return comp.build(node, seed=0, context=16)
    if group == "model":
        with torch.device("meta"):
            return comp.build(node)
    if group == "logger":
        from pathlib import Path

        from framework.loggers._base import RunInfo
        return comp.build(node, run=RunInfo(Path("unused"), None, None))
    return comp.build(node)


@pytest.mark.parametrize("group,name", [pytest.param(g, n, marks=needs_wandb) if (g, n) == ("logger", "wandb")
                                        else (g, n) for g in GROUPS for n in registry(g).names()])
def test_every_yaml_composes_and_builds(group, name, tmp_path):
    extra = []
    if group == "data" and name in ("text", "tokens"):
        path = tmp_path / "d.bin"
        ids = b"".join(bytes((i, 0)) for i in range(256)) * 9   # uint16 token ids 0..255
        path.write_bytes(b"hello world, some text " * 200 if name == "text" else ids)
        extra = [f"data.path={path}"] + (["data.vocab_size=256"] if name == "tokens" else [])
    if group == "model" and name == "hf":   # a model from a config.json the test writes (no download)
        from tests._hf import write_config
        extra = [f"model.config={write_config('gpt2', tmp_path)}", "model.context=16"]
    override = f"+stage={name}" if group == "stage" else f"{group}={name}"
    offload = [] if group != "offload" else [f"+stage={next(s for s, o in COMPATIBLE.items() if name in o)}"]
    base = [o for o in TINY if not o.startswith(("model", "data"))]
    cfg = compose([*base, override, *offload, *extra])
    assert cfg.choices[group] == name
    assert _build(cfg, group) is not None


@pytest.mark.parametrize("overrides,needle", [
    (["train.stpes=10"], "unknown key 'train.stpes' (did you mean 'train.steps'?)"),
    (["optimizer.betas1=0.9"], "unknown key 'optimizer.betas1' (did you mean 'optimizer.beta1'?)"),
    (["+train.stpes=10"], "unknown key 'train.stpes' (did you mean 'train.steps'?)"),
    (["sed=1"], "unknown key 'sed' (did you mean 'seed'?)"),
    (["train.steps=abc"], "train.steps"),
    (["optimizer.lr=fast"], "optimizer.lr"),
    (["optimizer=adamww"], "adamw"),
    (["+stage=zero5"], "zero5"),
    (["train.steps=0"], "train.steps must be >= 1"),
    # the optimizer's own values, checked before the scheduler's (which read the lr) and before a run folder
    (["optimizer.lr=-1", "train.steps=200"], "optimizer.lr must be >= 0 for adamw, got -1.0"),
    (["optimizer.lr=-1", "train.steps=2", "scheduler=warmup_lr"], "optimizer.lr must be >= 0 for adamw, got -1.0"),
    (["optimizer=adam", "optimizer.eps=0"], "optimizer.eps must be > 0 for adam, got 0.0 (an eps of 0 makes the update 0/0"),
    (["optimizer=lion", "optimizer.beta1=1"], "optimizer.beta1 must be in [0, 1) for lion, got 1.0"),
    (["optimizer=adam", "optimizer.decay_1d=true"], "optimizer.decay_1d=true has no effect with "
     "optimizer.weight_decay=0 for adam (nothing is decayed); set optimizer.weight_decay > 0 or drop "
     "optimizer.decay_1d"),
    # numpy's seed sequence takes no negative seed: refused here, not as its traceback after a run folder
    (["data.chain_seed=-1"], "data.chain_seed must be >= 0, got -1; give 0 or more"),
    # a group choice read as a number, boolean or null is a name the registry does not know
    (["precision=16"], "unknown precision '16' (did you mean 'bf16' or 'fp16'?)"),
    (["optimizer=null"], "unknown optimizer 'null'"), (["+stage=null"], "unknown stage 'null'"),
    (["optimizer=true"], "unknown optimizer 'true'"), (["data=1.5"], "unknown data '1.5'"),
    (["optimizer=[adamw]"], "optimizer=[adamw]: a config group takes one name, not a list; give optimizer=NAME"),
    (["+stage=[zero1]"], "a config group takes one name, not a list; give +stage=NAME"),
    # Hydra's own advice here (override stage: zero2) is defaults-list syntax, not a command line's
    (["+stage=zero3", "+stage=zero2"], "config: stage given twice (+stage=zero3, +stage=zero2): give +stage=NAME once"),
    # a group train.yaml's defaults choose already, added once: overriding it is the fix, not giving it once
    (["+stage=zero3", "+offload=cpu"], "config: offload is already chosen in the defaults (offload: none): use "
                                       "offload=cpu, without +"),
    (["+logger=none"],
     "config: logger is already chosen in the defaults (logger: console): use logger=none, without +"),
    # the other way round: stage has no choice in the defaults (Hydra's line said so in its own terms)
    (["stage=zero2"], "config: stage has no choice in the defaults (ddp when none is given): use +stage=zero2$"),
    (["=5"], "config: override '=5' has no key: write key=value$"),   # (not the '++=5' the framework passed on)
    # the same mistakes with the name already chosen (Hydra: "appears more than once in the final defaults list")
    (["+stage=zero2", "+stage=zero2"], "config: stage given twice (+stage=zero2, +stage=zero2): give +stage=NAME once"),
    (["+model=gpt-nano"], "config: model is already chosen in the defaults (model: gpt-nano): use model=gpt-nano, "
                          "without +"),
    (["+offload=cpu", "+offload=nvme"], "config: offload given twice (+offload=cpu, +offload=nvme) and already chosen "
                                        "in the defaults (offload: none): give offload=NAME once, without +"),
    # keys as YAML spells them: the schema's field async_ (a Python keyword) is checkpoint.async
    (["checkpoint.foo=1"], "unknown key 'checkpoint.foo'; valid keys under checkpoint: dir, every, keep_last, resume, "
                           "async, timeout_s"),
    (["checkpoint.async_=true"], "unknown key 'checkpoint.async_' (did you mean 'checkpoint.async'?)"),
    # what the key takes and how to give it, in the framework's words (not OmegaConf's or Hydra's internals)
    (["+stage=zero2", "stage.reduce_bucket_size=1.5"], "config: stage.reduce_bucket_size takes an integer (5e8 reads "
                                                        "as 500000000), got 1.5"),
    (["checkpoint.async=2"], "config: checkpoint.async takes true or false (also yes/no, on/off, 1/0), got 2"),
    (["logger=wandb", "logger.tags=foo"], "config: logger.tags takes a list, got 'foo'; give logger.tags=[foo]"),
    (["train.steps=null"], "config: train.steps takes an integer (5e8 reads as 500000000), got null$"),
    (["logger=wandb", "logger.tags=null"], "config: logger.tags takes a list, got null; give logger.tags=[] for none$"),
    (["checkpoint.dir=[a]"], "config: checkpoint.dir takes a string, got ['a']$"),
    (["logger=wandb", "logger.tags={a: 1}"], "config: logger.tags takes a list, got {a: 1}$"),
    (["train=[1]"], "config: train takes a mapping (or its keys one by one: train.NAME=VALUE), got [1]$"),
    # several values: a list or a string offered only where the key takes one (a group takes one name)
    (["optimizer.lr=1e-3,2e-3"], "config: optimizer.lr=1e-3,2e-3 is several values: add -m (--multirun) to run one "
                                 "job each$"),
    (["optimizer=adam,lion"],
     "config: optimizer=adam,lion is several values: add -m (--multirun) to run one job each$"),
    (["+stage=zero1,zero2"], "config: +stage=zero1,zero2 is several values: add -m (--multirun) to run one job each$"),
    (["logger=wandb", "logger.tags=a,b"], "config: logger.tags=a,b is several values: add -m (--multirun) to run one "
                                          "job each, or give a list as logger.tags=[a,b]"),
    (["checkpoint.dir=a,b"], "config: checkpoint.dir=a,b is several values: add -m (--multirun) to run one job each, "
                             "or give a string as checkpoint.dir='a,b'"),
    (["train.steps=${oc.env:NOPE_F30_X}"], "config: train.steps: the environment variable NOPE_F30_X is not set; set "
                                           "it, or give a default: ${oc.env:NOPE_F30_X,VALUE}"),
    (["~train.steps"], "config: train.steps has no value (a missing mandatory value: TrainLoopConfig gives it no "
                       "default); set train.steps in the config file or on the command line"),
])
def test_bad_config_is_one_clear_line(overrides, needle):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    msg = str(e.value)   # (a needle ending in $: the line's end)
    assert "\n" not in msg and (msg.endswith(needle[:-1]) if needle.endswith("$") else needle in msg), msg


def test_a_defaults_list_naming_no_option_is_the_registrys_line(tmp_path):
    """Hydra's line for a config file's ``override optimizer: adamx`` is its whole search path: the registry's
    did-you-mean instead, as for the command line's optimizer=adamx."""
    (tmp_path / "my.yaml").write_text("defaults:\n  - train\n  - override optimizer: adamx\n  - _self_\n")
    with pytest.raises(ConfigError) as e:
        compose([], config_dir=str(tmp_path), config_name="my")
    assert str(e.value) == ("config: unknown optimizer 'adamx' (did you mean 'adam'?); available: adagrad, adam, "
                            "adamw, lion, sgd (chosen in a config file's defaults list)"), str(e.value)


def test_an_unknown_key_set_in_a_groups_yaml_file_names_that_file_and_one_typed_does_not(tmp_path):
    """A key of a component's YAML file its config lacks read as if typed on the command line: the line names the
    file it is in; the same key typed keeps the command line's words."""
    (tmp_path / "scheduler").mkdir()
    mine = tmp_path / "scheduler" / "warmup_cosine.yaml"
    mine.write_text((conf_dir() / "scheduler" / "warmup_cosine.yaml").read_text() + "warmup: 3\n")
    (tmp_path / "my.yaml").write_text("defaults: [train, _self_]\n")
    typed = "unknown key 'scheduler.warmup' (did you mean 'scheduler.warmup_steps'?); valid keys under scheduler: "
    with pytest.raises(ConfigError) as e:
        compose(["scheduler=warmup_cosine"], config_dir=str(tmp_path), config_name="my")
    assert str(e.value).startswith(f"config: unknown key 'scheduler.warmup' in {mine} (did you mean "
                                   "'scheduler.warmup_steps'?); valid keys under scheduler: "), str(e.value)
    with pytest.raises(ConfigError) as e:
        compose(["scheduler=warmup_cosine", "scheduler.warmup=3"])
    assert str(e.value).startswith(f"config: {typed}"), str(e.value)


def test_a_config_dir_file_of_a_conf_name_is_used_with_a_note_or_refused_where_conf_hides_it(tmp_path):
    """A --config-dir folder holding the primary config comes before conf/: its optimizer/adamw.yaml is used, with
    a note naming both files. One without it (and a hydra.searchpath folder) comes after conf/, which hides the
    file: refused in one line (it was silently ignored)."""
    from framework.core.paths import conf_dir

    (tmp_path / "optimizer").mkdir()
    (tmp_path / "optimizer" / "adamw.yaml").write_text((conf_dir() / "optimizer" / "adamw.yaml").read_text()
                                                       .replace("lr: 1.0e-3", "lr: 5.0e-2"))
    (tmp_path / "my.yaml").write_text("defaults: [train, _self_]\n")
    mine, conf = tmp_path / "optimizer" / "adamw.yaml", conf_dir() / "optimizer" / "adamw.yaml"
    cfg = compose([], config_dir=str(tmp_path), config_name="my")
    assert cfg.optimizer.lr == 5e-2
    assert f"note: config: {mine} is used in place of {conf} (a --config-dir folder holding the primary config " \
           "comes before conf/)" in cfg.notices, cfg.notices
    for overrides, where in (([], {"config_dir": str(tmp_path)}), ([f"hydra.searchpath=[file://{tmp_path}]"], {})):
        with pytest.raises(ConfigError) as e:
            compose(overrides, **where)
        assert str(e.value).startswith(f"config: {mine} is hidden by {conf}, which comes first on the search path ("
                                       ) and "\n" not in str(e.value), str(e.value)
    # a root config the primary's defaults list pulls in (train), where Hydra records no choice: the same
    for d in ("t", "o"):
        (tmp_path / d).mkdir()
        (tmp_path / d / ("my.yaml" if d == "t" else "other.yaml")).write_text("defaults: [train, _self_]\n")
    mine, conf = tmp_path / "t" / "train.yaml", conf_dir() / "train.yaml"
    mine.write_text(conf.read_text().replace("  steps: 300", "  steps: 2", 1))
    cfg = compose([], config_dir=str(tmp_path / "t"), config_name="my")
    assert cfg.train.steps == 2 and f"note: config: {mine} is used in place of {conf} (" in " ".join(cfg.notices)
    hidden = f"^config: {re.escape(str(mine))} is hidden by {re.escape(str(conf))}, which comes first"
    with pytest.raises(ConfigError, match=hidden):
        compose([f"hydra.searchpath=[file://{tmp_path / 't'}]"], config_dir=str(tmp_path / "o"), config_name="other")
    # a deletion (~) of hydra.searchpath adds no folder: it stays an override of its own, as Hydra reads it
    from framework.config import search_order

    delete = f"~hydra.searchpath=[file://{tmp_path / 't'}]"
    assert search_order(str(tmp_path / "o"), "other", [delete]) == (
        str(tmp_path / "o"), [delete], [f"hydra.searchpath=['file://{conf_dir()}']"])
    # a quoted entry (a comma and a space in it) reaches Hydra as given
    quoted = f"'file://{tmp_path}/a, b',\"file://{tmp_path / 't'}\""
    assert search_order(str(tmp_path / "o"), "other", [f"hydra.searchpath=[{quoted}]"])[2] == [
        f"hydra.searchpath=['file://{conf_dir()}',{quoted}]"]


def test_a_bad_model_file_is_named(tmp_path):
    """A model is any conf/model/gpt*.yaml file: a refusal of its values names the file (here one of a --config-dir
    folder used in its place), not only the key."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "gpt-nano.yaml").write_text((conf_dir() / "model" / "gpt-nano.yaml").read_text()
                                                      .replace("n_head: 4", "n_head: 3"))
    (tmp_path / "my.yaml").write_text("defaults: [train, _self_]\n")
    with pytest.raises(ConfigError, match=r"^model.d_model \(128\) must be divisible by model.n_head \(3\) "
                                          r"\(model=gpt-nano: its YAML file model/gpt-nano.yaml, or a model.\* "
                                          r"override\)$"):
        compose([], config_dir=str(tmp_path), config_name="my")


def test_hydra_refusing_a_group_value_is_one_line():
    from framework.config.composition import standalone_composer

    with pytest.raises(ConfigError, match="^config: Config group override must be a string or a list. Got int$"):
        standalone_composer(["precision=16"])


def test_validate_rejects_unknown_root_key_directly():
    with pytest.raises(ConfigError, match="did you mean 'train'"):
        validate({"trian": {}, "train": {"steps": 1, "micro_batch": 1}}, {})


def test_default_stage_is_ddp_and_plus_stage_selects():
    assert compose([]).choices["stage"] == "ddp"
    assert compose(["+stage=ddp", "stage.reduce_bucket_size=10"]).stage.reduce_bucket_size == 10
    # ddp's bucket key is spelled as zero1's, zero2's and DeepSpeed's (a stage-0 file's lands under that name)
    assert compose(["+stage=ddp"], ds_config={"zero_optimization": {"stage": 0, "reduce_bucket_size": 7}}
                   ).stage.reduce_bucket_size == 7
    with pytest.raises(ConfigError, match=r"unknown key 'stage.bucket_size' \(did you mean 'stage.reduce_bucket_size'"):
        compose(["+stage=ddp", "stage.bucket_size=10"])


def test_compatibility_table_rejects_unknown_combination():
    from framework.config import check_compatible
    with pytest.raises(ConfigError, match="valid: stage ddp with offload none"):
        check_compatible("ddp", "cpu")


def test_nvme_schema_resolves_params_auto_per_stage():
    for stage, params in (("zero1", "none"), ("zero2", "none"), ("zero3", "nvme")):
        cfg = compose([f"+stage={stage}", "offload=nvme"])
        assert cfg.offload.params == params and cfg.offload.optimizer == "nvme"
        assert cfg.to_dict()["offload"]["params"] == params
    cfg = compose(["+stage=zero3", "offload=nvme", "offload.optimizer=cpu", "offload.params=nvme",
                   "offload.aio.queue_depth=4", "offload.nvme_path=/tmp/x"])
    assert (cfg.offload.optimizer, cfg.offload.aio.queue_depth, cfg.offload.nvme_path) == ("cpu", 4, "/tmp/x")


@pytest.mark.parametrize("overrides,needle", [
    (["offload=nvme"], "offload=nvme is not supported with stage=ddp"),
    # no stage chosen: the fix is choosing one, as +stage= (stage=zero3 is a second error)
    (["offload=cpu"], "stage zero3 with offload none|cpu|nvme; add +stage=zero1, +stage=zero2 or +stage=zero3"),
    (["+stage=zero2", "offload=nvme", "offload.params=nvme"], "offload.params=nvme (parameter offload) needs +stage=zero3"),
    (["+stage=zero2", "offload=nvme", "offload.optimizer=cpu"], "puts nothing on NVMe; use offload=cpu"),
    (["+stage=zero3", "offload=nvme", "offload.optimizer=disk"], "offload.optimizer must be cpu or nvme"),
    (["+stage=zero3", "offload=nvme", "offload.params=gpu"], "offload.params must be none, cpu, nvme or auto"),
    (["+stage=zero2", "offload=nvme", "offload.pipeline_read=true", "offload.pipeline_write=true",
      "offload.buffer_count=2"], "set offload.buffer_count>=3"),
    (["+stage=zero2", "offload=nvme", "offload.sub_group_size=0"], "offload.sub_group_size must be >= 1,"),
    # every tile is padded to a 4 KiB page: one element a tile would take 1024 times its memory and disk
    (["+stage=zero2", "offload=nvme", "offload.sub_group_size=1023"], "config: offload.sub_group_size=1023 is "
     "smaller than one 4096-byte O_DIRECT page of fp32 elements, to which every tile is padded; set "
     "offload.sub_group_size>=1024"),
    (["+stage=zero2", "offload=nvme", "offload.aio.block_size=1000"], "offload.aio.block_size must be a positive multiple of 4096"),
    # absurd values: per-thread bounce buffers of 64 GiB, 20000 IO threads
    (["+stage=zero2", "offload=nvme", "offload.aio.block_size=68719476736"], "of at most 67108864"),
    (["+stage=zero2", "offload=nvme", "offload.aio.queue_depth=20000"],
     "offload.aio.queue_depth=20000 x offload.aio.intra_op_parallelism=1 IO threads is more than 1024"),
    (["+stage=zero2", "offload=nvme", "offload.aio.single_submit=true"], "offload.aio.single_submit=true has no effect"),
    (["+stage=zero2", "offload=nvme", "offload.aio.overlap_events=false"], "offload.aio.overlap_events=false has no effect"),
    (["+stage=zero2", "offload=nvme", "offload.overlap_step=true"], "offload.overlap_step=true needs whole optimizer pieces"),
    (["+stage=zero1", "offload=cpu", "offload.overlap_step=true"],
     "offload.overlap_step=true has no effect with stage=zero1 (its gradients are final only after backward"),
    (["+stage=zero2", "offload=nvme", "offload.aio.blok_size=4096"], "did you mean 'offload.aio.block_size'?"),
    # a nested key run together, or without its node, is suggested as the nested key
    (["+stage=zero2", "offload=nvme", "offload.aio_block_size=4096"], "did you mean 'offload.aio.block_size'?"),
    (["+stage=zero2", "offload=nvme", "offload.queue_depth=4"], "did you mean 'offload.aio.queue_depth'?"),
    (["+stage=zero3", "offload=cpu", "offload.params=nvme"], "offload.params must be none or cpu with offload=cpu"),
    (["+stage=zero3", "offload=cpu", "offload.params=true"], "offload.params must be none or cpu"),
    (["+stage=zero2", "offload=cpu", "offload.params=cpu"], "offload.params=cpu (parameter offload) needs +stage=zero3"),
    (["+stage=zero3", "offload=cpu", "offload.params=cpu", "offload.ratio=0.5"],
     "offload.ratio<1 keeps part of each partition's step on the device, which zero3 parameter shards in host memory"),
    (["+stage=zero3", "offload=nvme", "offload.params=cpu", "offload.ratio=0.5"],
     "which zero3 parameter shards in host memory (offload.params=cpu) cannot share"),
    # offload.ratio=0: every optimizer step and its state on the device, as offload=none
    (["+stage=zero2", "offload=cpu", "offload.ratio=0"], "config: offload=cpu with offload.ratio=0 (every optimizer "
     "step on the device) and offload.params=none puts nothing in host memory; set offload.ratio>0, or use offload=none"),
    (["+stage=zero1", "offload=cpu", "offload.ratio=0", "offload.pin_memory=false"], "puts nothing in host memory"),
    (["+stage=zero2", "offload=cpu", "offload.ratio=0", "offload.overlap_step=true"], "puts nothing in host memory"),
    # refused by the config, before the CLI makes a run folder (not when the engine is built)
    (["+stage=zero2", "offload=cpu", "offload.ratio=1.5"], "config: offload.ratio must be in [0, 1], got 1.5"),
    (["+stage=zero2", "offload=cpu", "offload.ratio=-0.5"], "offload.ratio must be in [0, 1], got -0.5"),
    # keys of a tier that is off would do nothing
    (["+stage=zero2", "offload=nvme", "offload.param_buffer_size=1"],
     "offload.param_buffer_size has no effect unless offload.params=nvme; remove it"),
    (["+stage=zero2", "offload=nvme", "offload.max_in_cpu=0", "offload.param_buffer_count=1"],
     "offload.param_buffer_count has no effect unless offload.params=nvme; remove it"),
    (["+stage=zero3", "offload=nvme", "offload.params=cpu", "offload.max_in_cpu=0"],
     "offload.max_in_cpu has no effect unless offload.params=nvme; remove it"),
    (["+stage=zero3", "offload=nvme", "offload.optimizer=cpu", "offload.buffer_count=2"],
     "offload.buffer_count has no effect unless offload.optimizer=nvme; remove it"),
    (["+stage=zero3", "offload=nvme", "offload.optimizer=cpu", "offload.pipeline_write=true"],
     "offload.pipeline_write has no effect unless offload.optimizer=nvme; remove it"),
    (["+stage=zero3", "offload=nvme", "offload.optimizer=cpu", "offload.pipeline_read=true"],
     "offload.pipeline_read has no effect unless offload.optimizer=nvme; remove it"),
    (["+stage=zero3", "offload=nvme", "offload.optimizer=cpu", "offload.sub_group_size=7"],
     "offload.sub_group_size has no effect unless offload.optimizer=nvme; remove it"),
    # offload.ratio=0: every optimizer step on the device, no tile ever on disk (the tile keys with it)
    (["+stage=zero2", "offload=nvme", "offload.ratio=0"], "offload=nvme with offload.ratio=0 (every optimizer step "
     "on the device) and offload.params=none puts nothing on NVMe; set offload.ratio>0, or use offload=none"),
    (["+stage=zero3", "offload=nvme", "offload.ratio=0", "offload.params=cpu"],
     "offload.ratio=0 (every optimizer step on the device) and offload.params=cpu puts nothing on NVMe"),
    (["+stage=zero2", "offload=nvme", "offload.ratio=0", "offload.sub_group_size=700", "offload.buffer_count=7",
      "offload.pipeline_read=true"], "offload.params=none puts nothing on NVMe"),
    (["+stage=zero3", "offload=nvme", "offload.ratio=0"], "offload.ratio<1 keeps part of each partition on the device"),
    # an empty folder name would swap into the working directory, named nowhere
    (["+stage=zero3", "offload=nvme", "offload.nvme_path="], "offload.nvme_path is empty: give a folder, or leave it "
     "unset for <run dir>/nvme"),
    (["+stage=zero2", "offload=nvme", "offload.nvme_path=' '"], "offload.nvme_path is empty"),
])
def test_offload_schema_errors_are_one_line(overrides, needle):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg, msg


@pytest.mark.parametrize("group", list(GROUPS))
def test_a_wrong_group_name_is_one_line_with_the_closest(group):
    """Every group: a misspelt choice names the closest component and the valid ones (not Hydra's
    search path), as a misspelt key does."""
    name = registry(group).names()[-1]
    wrong = name[:-1] + ("x" if name[-1] != "x" else "y")
    override = f"+stage={wrong}" if group == "stage" else f"{group}={wrong}"
    with pytest.raises(ConfigError) as e:
        compose([override])
    msg = str(e.value)
    assert "\n" not in msg and "search path" not in msg, msg
    # (zero3 -> zerox: zero1, zero2 and zero3 are as close, and all named)
    assert re.search(f"unknown {group} '{wrong}' \\(did you mean [^)]*'{re.escape(name)}'\\?\\); available: ", msg), msg
    assert ", ".join(registry(group).names()) in msg


def test_a_public_helper_module_in_a_registry_package_is_one_line_saying_to_prefix_it():
    """A helper module without COMPONENT in a component package: every command once ended in a TypeError
    traceback from the registry; one ConfigError line naming the _ prefix instead."""
    with pytest.raises(ConfigError) as e:
        components_of(types.ModuleType("framework.optimizers.helpers"), "helpers")
    assert str(e.value) == ("framework.optimizers.helpers is in a registry package but defines no COMPONENT (or "
                            "COMPONENTS): if it is a helper, not a component, prefix its file name with _ (helpers.py "
                            "-> _helpers.py)"), str(e.value)


_PLUGIN = """
from dataclasses import dataclass

from framework.core.registry import Component
from framework.optimizers import lion


@dataclass(frozen=True, kw_only=True)
class ULionConfig(lion.LionConfig):
    pass


COMPONENT = Component(config=ULionConfig, build=lion.build)


@dataclass(kw_only=True)
class LooseConfig:   # (not frozen: refused when the registry is read)
    lr: float = 1.0


LOOSE = Component(config=LooseConfig, build=lion.build)


@dataclass(frozen=True, kw_only=True)
class BareConfig:
    lr: float = 1.0


INSTANCE = Component(config=BareConfig(), build=lion.build)   # (an instance, not the class)
"""


def test_an_installed_packages_entry_point_adds_a_component(tmp_path, monkeypatch):
    """Another package's component, with no file in framework/: an entry point in group framework.<group> (a module,
    or module:attribute naming a Component), its YAML in the user's folder; a name taken twice is one line."""
    (tmp_path / "uplug.py").write_text(_PLUGIN)
    (tmp_path / "uplug-0.1.dist-info").mkdir()
    (tmp_path / "uplug-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: uplug\nVersion: 0.1\n")
    points = tmp_path / "uplug-0.1.dist-info" / "entry_points.txt"
    points.write_text("[framework.optimizer]\nulion = uplug\nulion2 = uplug:COMPONENT\n")
    (tmp_path / "conf" / "optimizer").mkdir(parents=True)
    (tmp_path / "conf" / "optimizer" / "ulion.yaml").write_text("lr: 3.0e-4\nbeta1: 0.9\nbeta2: 0.99\n"
                                                               "weight_decay: 0.0\ndecay_1d: false\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.cache_clear()   # (discovery reads sys.path once per group)
    try:
        assert {"ulion", "ulion2", "adamw"} <= set(registry("optimizer").names())
        cfg = compose(["optimizer=ulion", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"])
        assert type(cfg.optimizer).__name__ == "ULionConfig" and cfg.optimizer.lr == 3e-4
        # Code without a YAML file, a YAML file without code: one line each (not Hydra's search path, nor "did
        # you mean 'lion'")
        with pytest.raises(ConfigError) as e:
            compose(["optimizer=ulion2", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"])
        assert str(e.value) == ("config: optimizer 'ulion2' (uplug) has no YAML file; add conf/optimizer/ulion2.yaml "
                                "(or optimizer/ulion2.yaml in a --config-dir or hydra.searchpath folder) with its fields "
                                "(lr, beta1, beta2, weight_decay, decay_1d)")
        (tmp_path / "conf" / "optimizer" / "ulion3.yaml").write_text("lr: 1.0\n")
        with pytest.raises(ConfigError) as e:
            compose(["optimizer=ulion3", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"])
        assert str(e.value) == (f"config: optimizer 'ulion3': {tmp_path / 'conf' / 'optimizer' / 'ulion3.yaml'} has "
                                "no code; a component is a module of framework/optimizers/ or a `framework.optimizer` "
                                "entry point of an installed package (docs/architecture.md#where-a-new-piece-goes)")
        points.write_text("[framework.optimizer]\nadamw = uplug\n")
        registry.cache_clear()
        with pytest.raises(ConfigError) as e:
            registry("optimizer")
        assert str(e.value) == ("optimizer 'adamw' is defined by both framework.optimizers.adamw and uplug (entry "
                                "point of package uplug): rename one (and its YAML file optimizer/adamw.yaml)")
        # The registry's own refusal, not "has no code", where the group is named on the command line: for the
        # broken entry itself (its YAML found) and for a built-in beside it, naming the package and the way out
        points.write_text("[framework.optimizer]\nulion3 = uplug:LOOSE\n")
        registry.cache_clear()
        for choice in ("ulion3", "adamw"):
            with pytest.raises(ConfigError) as e:
                compose([f"optimizer={choice}", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"])
            assert str(e.value) == ("optimizer 'ulion3' (uplug:LOOSE): its config LooseConfig is not frozen (a "
                                    "composed config is checked once and cannot change after); declare it "
                                    "@dataclass(frozen=True, kw_only=True) ('ulion3' is an entry point of package "
                                    "uplug, read by every run: fix it there, or pip uninstall uplug)"), str(e.value)
        points.write_text("[framework.optimizer]\nbare = uplug:INSTANCE\n")
        registry.cache_clear()
        with pytest.raises(ConfigError) as e:
            registry("optimizer")
        assert str(e.value).startswith("optimizer 'bare' (uplug:INSTANCE): its config is an instance of BareConfig, "
                                       "not the class; give the class: Component(config=BareConfig, ...) ("), e.value
    finally:
        monkeypatch.undo()
        sys.modules.pop("uplug", None)
        registry.cache_clear()
    assert "ulion" not in registry("optimizer").names()


@pytest.mark.parametrize("override,name", [
    ("optimizer=AdamW", "adamw"), ("optimizer=SGD", "sgd"), ("precision=BF16", "bf16"), ("offload=CPU", "cpu"),
    ("scheduler=WarmupCosineLR", "warmup_cosine_lr"), ("+stage=Zero3", "zero3")])
def test_a_group_name_in_another_case_is_refused_naming_ours(override, name):
    """Other tools' spellings (torch's class names, upper case): still an error, naming the one meant (a
    case-sensitive spelling distance names adam for AdamW, fp16 for BF16, or nothing)."""
    with pytest.raises(ConfigError, match=f"\\(did you mean '{name}'\\?\\)"):
        compose([override])


def test_a_name_that_begins_a_close_one_names_it_and_an_unknown_model_names_hf():
    """gpt2 (a GPT-2 user): gpt2-small, not the nearer spelling gpt-1b; and how a Hugging Face model is named.
    Only among the close names: an exact-only lookup (cutoff 1.0) stays exact."""
    with pytest.raises(ConfigError) as e:
        compose(["model=gpt2"])
    msg = str(e.value)
    assert msg.startswith("config: unknown model 'gpt2' (did you mean 'gpt2-small'?); available: "), msg
    assert msg.endswith("; a Hugging Face model is model=hf model.config=path/to/config.json (or its folder; local "
                        "files: nothing is downloaded)"), msg
    assert "Hugging Face" not in str(pytest.raises(ConfigError, compose, ["optimizer=adamx"]).value)
    # a model YAML's path (training takes a model by name): how to make it one
    assert str(pytest.raises(ConfigError, compose, ["model=/x/my.yaml"]).value).endswith(
        "; a GPT model YAML of your own: copy it into conf/model/ as gpt-NAME.yaml (a GPT model there is a file named "
        "gpt*.yaml) and give model=gpt-NAME")
    assert closest("adamw", ["adam", "adamw_8bit"]) == "adamw_8bit" and closest("ad", ["adamw", "adam"]) == "adam"
    assert closest("lr", ["lr_decay"], 1.0) is None and closest("zero", ["zero3"], 0.95) is None


def test_names_equally_close_are_all_named():
    """A tie names them all: picking one named whichever sorts last (shakespeare_char: the GPU recipe, for a
    CPU user as much)."""
    assert closest_hint("shakespeare_char", ["shakespeare_char_cpu", "shakespeare_char_gpu", "memory_scaling"]) \
        == " (did you mean 'shakespeare_char_cpu' or 'shakespeare_char_gpu'?)"
    assert closest_hint("zero4", ["zero1", "zero2", "zero3", "ddp"]) == " (did you mean 'zero1', 'zero2' or 'zero3'?)"
    assert closest_hint("adamw2", ["adamw", "adam"]) == " (did you mean 'adamw'?)" and closest_hint("x", ["abc"]) == ""


@pytest.mark.parametrize("override,key", [
    ("checkpoint.dir=${hydra:runtime.output_dir}/ck", "checkpoint.dir"),
    ("logger.tags=[a,'${hydra:job.name}']", "logger.tags[1]"),
])
def test_a_hydra_resolver_value_is_one_line_naming_the_alternatives(override, key):
    """Composed and checked before Hydra runs, where only a job resolves ``${hydra:...}``."""
    with pytest.raises(ConfigError) as e:
        compose([override] if key == "checkpoint.dir" else ["logger=wandb", override])
    msg = str(e.value)
    assert msg.startswith(f"config: {key}=${{hydra:") and "\n" not in msg, msg
    assert msg.endswith("hydra: interpolations are not supported in framework keys (they resolve only inside "
                        "Hydra's job, after the config is checked); checkpoint.dir defaults to the run folder's "
                        "checkpoints/, else use ${oc.env:...} or an explicit path"), msg


def test_the_composed_config_and_its_groups_are_frozen():
    """A field set after compose was taken unchecked before initialize and ignored after it: refused at once."""
    cfg = compose(["train.steps=10"])
    for node, key in ((cfg.optimizer, "lr"), (cfg.train, "grad_accum"), (cfg.stage, "overlap_comm"),
                      (cfg.checkpoint, "dir")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(node, key, getattr(node, key))
    assert dataclasses.replace(cfg.optimizer, lr=0.5).lr == 0.5


@needs_wandb   # (logger.tags: the list field given on the command line)
def test_the_composed_configs_mappings_and_lists_are_frozen_too():
    """``initialize`` picks each component by ``cfg.choices``: a write into it (or ``sources``, or a list field)
    was taken unchecked (zero2+offload=cpu ran as ddp without its offload). Refused; the config still pickles (a
    spawned rank's: test_cli.py's test_zero_stages_from_the_command_line) and hashes."""
    cfg = compose(["train.steps=2", "+stage=zero3", "offload=cpu", "logger=wandb", "+logger.tags=[a,b]"])
    for write in (lambda: cfg.choices.__setitem__("stage", "ddp"), lambda: cfg.sources.pop("seed"),
                  lambda: cfg.choices.update(stage="ddp"), lambda: cfg.sources.clear()):
        with pytest.raises(TypeError, match="^the composed config is read-only"):
            write()
    assert cfg.stage.gather_unit == ("Block",) and cfg.logger.tags == ("a", "b")
    assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(pickle.loads(pickle.dumps(cfg))) == hash(cfg)
    assert cfg.to_dict()["logger"]["tags"] == ["a", "b"]   # plain lists again (YAML, JSON, W&B)
    # A group swapped in with dataclasses.replace (its lists given as lists) is frozen alike, and still hashes.
    swapped = dataclasses.replace(cfg, stage=dataclasses.replace(cfg.stage, gather_unit=["Block", "MLP"]))
    assert swapped.stage.gather_unit == ("Block", "MLP") and hash(swapped) != hash(cfg)


def _alias_bomb(levels: int) -> str:
    """YAML whose nested anchors each repeat the one before ten times: 10**levels nodes once expanded."""
    return "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, levels))


BOMB_S = 30   # (a refused bomb composes in well under a second; Hydra's read of one goes on for hours)


def _compose_errors(*calls: tuple[list[str], dict]) -> list[str]:
    """The ConfigError line of each ``compose(args, **kwargs)`` of ``calls`` ('composed' where none), in a child
    process that SIGALRM ends ``BOMB_S`` s after its imports: a bomb let through to Hydra fails the test then, not
    at pytest's timeout."""
    code = ("import json, signal, sys\nfrom framework import ConfigError, compose\nsignal.alarm(int(sys.argv[2]))\n"
            "for args, kwargs in json.loads(sys.argv[1]):\n    try:\n        compose(args, **kwargs)\n"
            "        print(json.dumps('composed'))\n    except ConfigError as e:\n        print(json.dumps(str(e)))\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(calls), str(BOMB_S)], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[2], check=False)
    assert out.returncode != -signal.SIGALRM, f"compose ran on for {BOMB_S} s: an alias bomb got through to Hydra"
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_a_yaml_alias_bomb_is_one_line_before_hydra_expands_it(tmp_path):
    """Hydra's read (OmegaConf) would expand it for ever: the search path's folders are read first, conf/ aside."""
    from framework.config.plainconf import load_yaml
    from framework.core.files import YAML_ALIAS_NODES, parse_yaml

    (tmp_path / "top").mkdir()
    (tmp_path / "top" / "bomb.yaml").write_text("defaults:\n  - train\n  - _self_\n" + _alias_bomb(5))
    says = (rf"its aliases expand to 1\.\d+e\+05 more nodes \(over {YAML_ALIAS_NODES:,}: an alias bomb\?\); "
            r"write the repeated values out")
    sgd = tmp_path / "search" / "optimizer" / "sgd.yaml"   # and in a group folder of a hydra.searchpath folder
    sgd.parent.mkdir(parents=True)
    sgd.write_text(_alias_bomb(5))
    top, group = _compose_errors(([], {"config_dir": str(tmp_path / "top"), "config_name": "bomb"}),
                                 ([f"hydra.searchpath=[file://{sgd.parents[1]}]", "optimizer=sgd"], {}))
    assert re.match(f"config: {re.escape(str(tmp_path / 'top' / 'bomb.yaml'))}: {says}", top), top
    assert re.match(f"config: {re.escape(str(sgd))}: {says}", group), group
    with pytest.raises(ConfigError, match=f"^config: {re.escape(str(sgd))}: {says}"):
        load_yaml(sgd)   # the composer without Hydra
    # Aliases that add few nodes read as before; an alias inside its own anchor is refused.
    assert parse_yaml("a: &x {b: 1}\nc: *x\ne: {<<: *x, f: 2}\n") == {
        "a": {"b": 1}, "c": {"b": 1}, "e": {"b": 1, "f": 2}}
    assert parse_yaml(_alias_bomb(3))["a2"][9][9][9] == "x"
    base = "b: &b {" + ", ".join(f"k{i}: {i}" for i in range(100)) + "}\n"   # a plain use of merge keys: 2.03e4
    merged = parse_yaml(base + "".join(f"e{j}: {{<<: *b, z: {j}}}\n" for j in range(101)))
    assert len(merged) == 102 and merged["e100"]["k99"] == 99 and merged["e100"]["z"] == 100
    with pytest.raises(ValueError, match="^an alias names a node that holds it"):
        parse_yaml("a: &x [1, *x]")


def test_the_alias_bomb_check_reads_quoted_search_paths_and_nested_group_folders(tmp_path):
    """A quoted hydra.searchpath entry (Hydra's grammar takes one) and a group file below a group folder
    (optimizer=sub/x) are checked as an unquoted entry and a group folder's own file are."""
    from framework.config.plainconf import check_aliases
    from framework.core.paths import conf_dir

    (tmp_path / "optimizer" / "sub").mkdir(parents=True)
    bomb = tmp_path / "optimizer" / "sub" / "x.yaml"
    bomb.write_text(_alias_bomb(5))
    for entry in (f"file://{tmp_path}", f"'file://{tmp_path}'", f'"file://{tmp_path}"', f"file://{tmp_path}/"):
        with pytest.raises(ConfigError, match=f"^config: {re.escape(str(bomb))}: its aliases expand to 1.23e"):
            check_aliases(str(conf_dir()), [f"hydra.searchpath=[file:///nowhere,{entry}]"])
    bomb.rename(tmp_path / "optimizer" / "sgd.yaml")
    nested = re.escape(str(tmp_path / "optimizer" / "sgd.yaml"))
    [said] = _compose_errors(([f"hydra.searchpath=['file://{tmp_path}']", "optimizer=sgd"], {}))
    assert re.match(f"config: {nested}: its aliases expand", said), said


def test_the_alias_bomb_check_skips_tools_folders_only(tmp_path):
    """A tool's folder (a project root's .git, a virtual environment: thousands of files) is no config group: its
    YAML is not read on each compose; a group folder beside it still is, and so is a dot folder a defaults list
    names (Hydra composes it: ``.local@_global_: mine``)."""
    from framework.config.plainconf import check_aliases
    from framework.core.paths import conf_dir

    top = tmp_path / "top"
    (top / ".local").mkdir(parents=True)
    (top / "exp.yaml").write_text("defaults:\n  - train\n  - .local@_global_: mine\n  - _self_\n")
    (top / ".local" / "mine.yaml").write_text("seed: 4242\n")
    assert compose([], config_dir=str(top), config_name="exp").seed == 4242
    (top / ".local" / "mine.yaml").write_text(_alias_bomb(7))
    [said] = _compose_errors(([], {"config_dir": str(top), "config_name": "exp"}))
    assert re.match(f"config: {re.escape(str(top / '.local' / 'mine.yaml'))}: its aliases expand", said), said
    root = tmp_path / "root"   # a project root given as the config folder
    for folder in (".git", "env/lib", "__pycache__", ".mypy_cache", "node_modules", "outputs/1/.hydra"):
        (root / folder).mkdir(parents=True)
        (root / folder / "x.yaml").write_text(_alias_bomb(5))
    (root / "env" / "pyvenv.cfg").write_text("home = /usr/bin\n")   # (a venv by any name)
    (root / ".conda" / "conda-meta").mkdir(parents=True)   # (a conda env: no pyvenv.cfg)
    (root / ".conda" / "lib").mkdir()
    (root / ".conda" / "lib" / "x.yaml").write_text(_alias_bomb(5))
    check_aliases(str(conf_dir()), [f"hydra.searchpath=[file://{root}]"])
    check_aliases(str(root), [])
    (root / "optimizer").mkdir()
    bomb = root / "optimizer" / "x.yaml"
    bomb.write_text(_alias_bomb(5))
    with pytest.raises(ConfigError, match=f"^config: {re.escape(str(bomb))}: its aliases expand to 1.23e"):
        check_aliases(str(root), [])


def test_the_alias_bomb_check_does_not_follow_a_link_to_a_folder(tmp_path):
    """A link to a folder (a project root's ``data -> /datasets``, a link to a folder above: a loop) is not walked:
    an alias-heavy YAML in a data tree Hydra never reads does not refuse the compose (a linked group folder is then
    not checked either: a known limit)."""
    from framework.config.plainconf import check_aliases
    from framework.core.files import config_files

    (tmp_path / "datasets" / "wiki").mkdir(parents=True)
    (tmp_path / "datasets" / "wiki" / "manifest.yaml").write_text(_alias_bomb(7))
    search = tmp_path / "search"
    search.mkdir()
    (search / "mine.yaml").write_text("defaults: [train, _self_]\nseed: 7\n")
    (search / "data").symlink_to(tmp_path / "datasets")
    (search / "loop").symlink_to(search)
    assert config_files(search) == [search / "mine.yaml"]
    check_aliases(str(search), [f"hydra.searchpath=[file://{search}]"])
    assert compose([], config_dir=str(search), config_name="mine").seed == 7


def test_the_alias_bomb_check_reads_a_group_folder_of_the_users_own(tmp_path):
    """A group folder no component registers (Hydra's ``+experiment=big`` pattern) is searched by Hydra alike: its
    files are checked too, not expanded for ever."""
    (tmp_path / "experiment").mkdir()
    bomb = tmp_path / "experiment" / "big.yaml"
    bomb.write_text("# @package _global_\n" + _alias_bomb(8))
    (tmp_path / "mine.yaml").write_text("defaults:\n  - train\n  - _self_\n")
    [said] = _compose_errors((["+experiment=big"], {"config_dir": str(tmp_path), "config_name": "mine"}))
    assert re.match(f"config: {re.escape(str(bomb))}: its aliases expand to 1\\.23e\\+08 ", said), said
    bomb.write_text("# @package _global_\nseed: 7\n")
    assert compose(["+experiment=big"], config_dir=str(tmp_path), config_name="mine").seed == 7


def test_a_config_dir_whose_name_holds_a_comma_or_a_quote_is_searched_whole(tmp_path):
    """The --config-dir folder goes into hydra.searchpath quoted: a comma in its name does not split it in two."""
    for name in ("a,b", "it's"):
        cd = tmp_path / name
        (cd / "experiment").mkdir(parents=True)
        (cd / "experiment" / "x.yaml").write_text("# @package _global_\nseed: 7\n")
        assert compose(["+experiment=x"], config_dir=str(cd)).seed == 7


def test_the_primary_configs_own_searchpath_is_kept_with_a_config_dir(tmp_path):
    """A --config-dir primary config's own ``hydra: searchpath:`` folders are searched (the search path the
    framework gives Hydra replaces the file's: they are merged into it, quoted: a comma in a name)."""
    from framework.config import search_order

    (tmp_path / "d").mkdir()
    (tmp_path / "x,y" / "experiment").mkdir(parents=True)
    (tmp_path / "x,y" / "experiment" / "x.yaml").write_text("# @package _global_\nseed: 7\n")
    (tmp_path / "d" / "mine.yaml").write_text(
        f"defaults: [train, _self_]\nhydra:\n  searchpath: ['file://{tmp_path / 'x,y'}']\n")
    assert compose(["+experiment=x"], config_dir=str(tmp_path / "d"), config_name="mine").seed == 7
    assert search_order(str(tmp_path / "d"), "mine", ["hydra.searchpath=[pkg://a]"])[2] == [
        f"hydra.searchpath=['file://{conf_dir()}','file://{tmp_path / 'x,y'}',pkg://a]"]


def test_a_config_folders_file_that_is_not_yaml_is_one_line_naming_it(tmp_path):
    """Hydra reads a searched folder's file with PyYAML, unguarded: its error (a 28-frame traceback from the
    command) is one ConfigError line naming the file and where in it the parser stopped."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "bad.yaml").write_text("defaults: [train, _self_]\nseed: [1, 2\n")
    (tmp_path / "mine.yaml").write_text("defaults: [train, _self_]\n")
    (tmp_path / "experiment" / "bad.yaml").write_text("# @package _global_\nseed: {a: 1\n")
    for name, overrides, path, at in (("bad", [], tmp_path / "bad.yaml", "line 2, column 7"),
                                      ("mine", ["+experiment=bad"], tmp_path / "experiment" / "bad.yaml",
                                       "line 2, column 7")):
        with pytest.raises(ConfigError) as e:
            compose(overrides, config_dir=str(tmp_path), config_name=name)
        said = str(e.value)
        assert said.startswith(f"config: {path} is not YAML: while parsing a flow ") and f"({at})" in said, said
        assert "\n" not in said and said.endswith("; fix the file"), said


def test_a_searched_folders_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    """Hydra reads each file as UTF-8 and its error names none: the file of the search path is found and named."""
    (tmp_path / "s" / "experiment").mkdir(parents=True)
    (tmp_path / "s" / "experiment" / "fine.yaml").write_text("# @package _global_\nseed: 7\n")
    (tmp_path / "s" / "experiment" / "latin.yaml").write_bytes(b"# @package _global_\nseed: 7 # caf\xe9\n")
    with pytest.raises(ConfigError) as e:
        compose(["+experiment=latin", f"hydra.searchpath=[file://{tmp_path / 's'}]"])
    assert str(e.value) == (f"config: {tmp_path / 's' / 'experiment' / 'latin.yaml'} is not UTF-8 (byte 0xe9 on "
                            "line 2); save it as UTF-8 and run again"), e.value


def test_a_not_utf8_file_in_a_tools_folder_of_the_search_path_is_not_named(tmp_path):
    """The same bytes in .git (not a config Hydra reads, and sorted first) leave the searched file named."""
    latin = b"# @package _global_\nseed: 7 # caf\xe9\n"
    for folder in ("experiment", ".git"):
        (tmp_path / "s" / folder).mkdir(parents=True)
        (tmp_path / "s" / folder / "latin.yaml").write_bytes(latin)
    with pytest.raises(ConfigError) as e:
        compose(["+experiment=latin", f"hydra.searchpath=[file://{tmp_path / 's'}]"])
    assert str(e.value).startswith(f"config: {tmp_path / 's' / 'experiment' / 'latin.yaml'} is not UTF-8"), e.value


def test_the_primary_configs_own_searchpath_is_read_as_hydra_reads_it(tmp_path, monkeypatch):
    """Its entries resolved (``file://${oc.env:X}``, a usual way to write one) and refused in one line unless a list
    of strings, as Hydra's own read does."""
    (tmp_path / "d").mkdir()
    (tmp_path / "x" / "experiment").mkdir(parents=True)
    (tmp_path / "x" / "experiment" / "x.yaml").write_text("# @package _global_\nseed: 7\n")
    mine = tmp_path / "d" / "mine.yaml"
    mine.write_text("defaults: [train, _self_]\nhydra:\n  searchpath: ['file://${oc.env:FC2_X}']\n")
    monkeypatch.setenv("FC2_X", str(tmp_path / "x"))
    assert compose(["+experiment=x"], config_dir=str(tmp_path / "d"), config_name="mine").seed == 7
    monkeypatch.delenv("FC2_X")
    with pytest.raises(ConfigError, match=f"^config: {re.escape(str(mine))}: hydra.searchpath: .*'FC2_X' not found"):
        compose([], config_dir=str(tmp_path / "d"), config_name="mine")
    for bad, said in (("[3]", "[3]"), ("file:///a", "'file:///a'"), ("[[a]]", "[['a']]")):
        mine.write_text(f"defaults: [train, _self_]\nhydra:\n  searchpath: {bad}\n")
        with pytest.raises(ConfigError, match=f"^config: {re.escape(str(mine))}: hydra.searchpath must be a list of "
                                              f"strings \\(as Hydra's\\), not {re.escape(said)}; give searchpath: "):
            compose([], config_dir=str(tmp_path / "d"), config_name="mine")


def test_the_package_primary_configs_own_searchpath_is_merged_and_checked(tmp_path, monkeypatch):
    """Without --config-dir, a conf/ primary config's own ``hydra: searchpath:`` is merged with the command line's
    too (Hydra's own rule would drop it), and its folders are read for an alias bomb."""
    import shutil

    from framework.config import search_order
    from framework.config.plainconf import check_aliases

    conf = shutil.copytree(conf_dir(), tmp_path / "conf")
    monkeypatch.setattr("framework.config.searchpath.conf_dir", lambda: conf)   # (a file in the package's conf/)
    for name in ("x", "y", "other"):
        (tmp_path / name / "experiment").mkdir(parents=True)
    (tmp_path / "x" / "experiment" / "x.yaml").write_text("# @package _global_\nseed: 7\n")
    (conf / "mine.yaml").write_text(f"defaults: [train, _self_]\nhydra:\n  searchpath: ['file://{tmp_path / 'x'}']\n")
    assert compose(["+experiment=x", f"hydra.searchpath=[file://{tmp_path / 'other'}]"],
                   config_name="mine").seed == 7
    assert search_order(None, "mine", ["a=1", "hydra.searchpath=[pkg://a]"]) == (
        str(conf), ["a=1"], [f"hydra.searchpath=['file://{tmp_path / 'x'}',pkg://a]"])
    assert search_order(None, "train", ["hydra.searchpath=[pkg://a]"]) == (   # (none of its own: as given)
        str(conf), ["hydra.searchpath=[pkg://a]"], [])
    (conf / "bomb.yaml").write_text(f"defaults: [train, _self_]\nhydra:\n  searchpath: ['file://{tmp_path / 'y'}']\n")
    bomb = tmp_path / "y" / "experiment" / "big.yaml"
    bomb.write_text("# @package _global_\n" + _alias_bomb(8))
    primary, rest, merged = search_order(None, "bomb", ["+experiment=big"])   # (what compose reads before Hydra)
    with pytest.raises(ConfigError, match=f"^config: {re.escape(str(bomb))}: its aliases expand to 1\\.23e\\+08 "):
        check_aliases(primary, rest + merged)


def test_a_sweep_jobs_composer_gives_the_search_path_quoted(tmp_path):
    """Inside the running Hydra app (a job a non-basic sweeper makes), the app's search path is given again: each
    folder quoted, so a comma in a name does not split it."""
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from framework.config import app_composer, search_order, standalone_composer

    cd = tmp_path / "a,b"
    (cd / "experiment").mkdir(parents=True)
    (cd / "experiment" / "x.yaml").write_text("# @package _global_\nseed: 7\n")
    cfg, _ = standalone_composer(["+experiment=x"], config_dir=str(cd))
    with initialize_config_dir(config_dir=search_order(str(cd), "train", [])[0], version_base="1.3"):
        HydraConfig.instance().set_config(cfg)
        try:
            assert app_composer(["+experiment=x"])[0].seed == 7
        finally:
            HydraConfig.instance().cfg = None


def test_the_alias_bomb_check_parses_only_files_with_an_anchor(tmp_path, monkeypatch):
    """Every YAML file of the search path's folders is checked on each compose, used or not: one without an anchor
    (no alias can name anything) is not parsed, and one with an anchor by libyaml's parser where PyYAML has it (the
    pure-Python one takes seconds a megabyte); a YAML error in it is left to Hydra's read, as before."""
    import yaml

    from framework.config.plainconf import check_aliases
    from framework.core.files import parse_yaml
    from framework.core.paths import conf_dir

    parsed = []

    def parse(text, Loader):   # noqa: N803 - yaml.parse's own name
        parsed.append((text.partition(":")[0], Loader))
        return real(text, Loader=Loader)

    real = yaml.parse
    monkeypatch.setattr(yaml, "parse", parse)
    monkeypatch.setattr(yaml, "compose", None)   # (the node graph: slower, and not needed to count)
    (tmp_path / "results.yaml").write_text("".join(f"run{i}: {{loss: {i}, tag: 'a & b'}}\n" for i in range(3000)))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("quoted: 'R&D'\n")   # (a false positive: parsed, refuses nothing)
    (tmp_path / "model" / "bad.yaml").write_text("anchored: &a [1\n")
    check_aliases(str(conf_dir()), [f"hydra.searchpath=[file://{tmp_path}]"])
    fast = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    assert [p for p in parsed if p[0] != "anchored"] == [("quoted", fast)]
    assert ("anchored", yaml.SafeLoader) in parsed or fast is yaml.SafeLoader   # (libyaml's error: PyYAML's word)
    with pytest.raises(ValueError, match="^its aliases expand to 1.23e"):   # deeper than libyaml's nesting limit
        parse_yaml(_alias_bomb(5) + "deep: " + "[" * 1100 + "]" * 1100 + "\n")


def test_a_yaml_value_nested_too_deeply_is_one_line(tmp_path):
    (tmp_path / "deep.yaml").write_text("defaults:\n  - train\n  - _self_\nx: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError) as e:
        compose([], config_dir=str(tmp_path), config_name="deep")
    assert str(e.value) == (f"config: a value in the YAML of {tmp_path} (deep.yaml or a file its defaults list names) "
                            f"is nested too deeply to compose; flatten it"), str(e.value)


def test_an_offload_tier_in_no_compatible_row_is_refused_naming_the_table():
    """A tier of one's own without its name in a row: the line says so and where the table is (not the valid
    combinations, none of which names it)."""
    from framework.config import check_compatible

    with pytest.raises(ConfigError) as e:
        check_compatible("zero2", "mytier")
    assert str(e.value) == ("config: offload mytier is in no row of config.COMPATIBLE (framework/config/schema.py); "
                            "add it to the rows of the stages that support it")


@pytest.mark.parametrize("path", ["/a/b-1.x", "/x/c,k", "/x/c k", "/x/it's", "/x/$HOME", '/x/a"b', "/x/~z\\"])
def test_a_pasted_override_reads_back_as_the_path_in_the_shell_and_in_hydra(path):
    """An override a message names for pasting: one shell word, and Hydra's value is the path as given."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from framework.config.searchpath import pasted
    words = shlex.split(pasted("checkpoint.resume", path))
    assert len(words) == 1, words
    assert OverridesParser.create().parse_override(words[0]).value() == path
    assert (pasted("checkpoint.resume", path) == f"checkpoint.resume={path}") == (path == "/a/b-1.x")
