"""Bad input is one ``error:`` line naming the key to fix and a non-zero exit, never a traceback:
the functions behind each command called directly where they can be."""
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import framework

# A regular file whose read fails (EIO): the code path of an unreadable input without needing to
# drop root's capabilities (root reads a mode-000 file).
UNREADABLE = "/proc/self/mem"
HF_GPT2 = Path(__file__).resolve().parents[2] / "recipes" / "hf_gpt2_zero3" / "gpt2_config.json"


def test_nvme_path_that_is_a_file(tmp_path):
    from framework.comm.distributed import connect
    from framework.models.gpt import gpt_loss
    from framework.offload._swapfolder import agree_swap_room, preflight
    from tests._helpers import build_gpt, tiny_config

    class Store:
        def extents(self):
            return {"0.0": 4096}

    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(framework.ConfigError) as e:
        agree_swap_room(None, str(afile), {"optim": Store()}, check=lambda: preflight(afile, 4096, create=True))
    assert str(e.value).endswith(f"offload.nvme_path={afile} is not a folder; set offload.nvme_path to a folder")
    # zero3's shards on nvme: the folder is checked before construction spills them there, in the same line
    for path, says in ((afile, "is not a folder; set offload.nvme_path to a folder"),
                       (afile / "sub", f"cannot create it ({afile}: exists and is not a folder); set "
                                       "offload.nvme_path to a writable folder")):   # (the parent in the way named)
        cfg = tiny_config("+stage=zero3", "stage.stage3_param_persistence_threshold=0", "offload=nvme",
                          f"offload.nvme_path={path}")
        with pytest.raises(framework.ConfigError) as e:
            framework.initialize(build_gpt(cfg)[0], gpt_loss, cfg, connect("gloo"))
        assert str(e.value) == f"offload.nvme_path={path}{'' if path == afile else ':'} {says}"
    assert os.listdir(tmp_path) == ["afile"] and afile.read_text() == ""


def test_unreadable_ds_config():
    from framework.config import dsconfig

    with pytest.raises(framework.ConfigError) as e:
        dsconfig.load(UNREADABLE)
    assert str(e.value).startswith(f"ds_config: cannot read {UNREADABLE} (") and "\n" not in str(e.value)


def test_unreadable_text_data():
    from framework.core.errors import DataError
    from framework.data.text import encode_file

    with pytest.raises(DataError) as e:
        encode_file(UNREADABLE)
    line = str(e.value)   # (the path as resolved: /proc/<pid>/mem)
    assert line.startswith("data.path=/proc/") and line.endswith("/mem: cannot read it (Input/output error); fix its "
                                                                 "permissions or point data.path at a readable file")


def test_a_data_path_that_is_a_folder_says_so(tmp_path, monkeypatch):
    from framework.core.errors import DataError
    from framework.data import resolve_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    for given in (str(tmp_path / "d"), "d"):
        with pytest.raises(DataError) as e:
            resolve_path(given)
        assert str(e.value) == f"data.path={given}: {tmp_path / 'd'} is a folder; point data.path at the file in it " \
                               "to train on"


def test_run_folder_that_cannot_be_made(tmp_path):
    from omegaconf import OmegaConf

    from framework.cli.train import check_folder

    afile = tmp_path / "afile"
    afile.write_text("")
    for key, folder in (("hydra.run.dir", afile), ("hydra.sweep.dir", afile / "sub")):
        cfg = OmegaConf.create({"hydra": {"run": {"dir": str(folder)}, "sweep": {"dir": str(folder)}}})
        with pytest.raises(framework.ConfigError) as e:
            check_folder(cfg, key)
        assert str(e.value) == f"{key}={folder}: {afile} is not a folder; set {key} to a folder"
    check_folder(OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path / "new" / "run")}}}), "hydra.run.dir")


def test_run_folder_that_is_a_file_from_the_command_line(forkrun, tmp_path):
    (tmp_path / "afile").write_text("")
    p = forkrun.run("framework.train", ["train.steps=2", f"hydra.run.dir={tmp_path / 'afile'}"], cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.splitlines() == [
        f"error: hydra.run.dir={tmp_path / 'afile'}: {tmp_path / 'afile'} is not a folder; set hydra.run.dir to a folder"]


def test_a_folder_key_interpolating_a_missing_key_is_one_line(forkrun, tmp_path):
    """${optimizer.name} in the run folder (the choice is Hydra's: ${hydra:runtime.choices.optimizer}) or the
    sweep's subfolder: one line naming the key and the spelling that works, not Hydra's traceback."""
    hint = "; for the chosen optimizer write ${hydra:runtime.choices.optimizer}"
    for args, key, value in ((["hydra.run.dir=r/${optimizer.name}"], "hydra.run.dir", "r/${optimizer.name}"),
                             (["-m", "hydra.sweep.subdir=${optimizer.name}", "hydra.sweep.dir=s"], "hydra.sweep.subdir",
                              "${optimizer.name}"),
                             (["-m", "hydra.sweep.dir=s/${model.nope}"], "hydra.sweep.dir", "s/${model.nope}")):
        p = forkrun.run("framework.train", [*args, "train.steps=2"], cwd=tmp_path)
        missing = "model.nope" if "nope" in value else "optimizer.name"
        assert p.returncode == 2 and p.stderr.splitlines() == [
            f"error: {key}={value}: the config has no key {missing}{hint if 'optimizer' in missing else ''}"], p.stderr
    assert not list(tmp_path.iterdir())


def test_a_folder_key_interpolating_an_unset_environment_variable_is_one_line(forkrun, tmp_path):
    """${oc.env:VAR} in a run or sweep folder with VAR unset: one line naming the key and the variable,
    not OmegaConf's traceback."""
    assert "NOPE_VAR_X" not in os.environ
    for args, key, value in ((["hydra.run.dir=r/${oc.env:NOPE_VAR_X}"], "hydra.run.dir", "r/${oc.env:NOPE_VAR_X}"),
                             (["-m", "hydra.sweep.subdir=${oc.env:NOPE_VAR_X}", "hydra.sweep.dir=s"],
                              "hydra.sweep.subdir", "${oc.env:NOPE_VAR_X}")):
        p = forkrun.run("framework.train", [*args, "train.steps=2"], cwd=tmp_path)
        assert p.returncode == 2 and p.stderr.splitlines() == [
            f"error: {key}={value}: the environment variable NOPE_VAR_X is not set; set it, or give it a "
            "default: ${oc.env:NOPE_VAR_X,DEFAULT}"], p.stderr
    assert not list(tmp_path.iterdir())


def test_hydra_job_chdir_is_refused(forkrun, tmp_path):
    """Relative paths (checkpoint.resume, data, outputs/ for resume=latest) are the launch directory's:
    a job moved into its run folder would resume nothing, quietly."""
    for mode in ([], ["-m"]):
        p = forkrun.run("framework.train", [*mode, "train.steps=2", "checkpoint.resume=latest", "hydra.job.chdir=true",
                                            "hydra.run.dir=outputs/r", "hydra.sweep.dir=multirun/s"], cwd=tmp_path)
        assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
        assert p.stderr.startswith("error: hydra.job.chdir=true: the job stays in the launch directory"), p.stderr
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


@pytest.mark.parametrize("name,text,says", [
    ("summary.json", "[1, 2]", "not a JSON object but list"),
    ("summary.json", '{"data": 5}', "data is 5, not an object"),
    ("summary.json", '{"steps": "ten"}', "steps is 'ten', not a number"),
    ("summary.json", '{"peak_memory_per_rank": [3]}', "peak_memory_per_rank is not a list of objects"),
    ("metrics.jsonl", '{"step": 1}\n5\n', "line 2 is not a JSON object"),
    ("metrics.jsonl", '{"step": 1}\n\n{"step": 2, lo\n', "line 3: Expecting property name enclosed in double quotes"),
])
def test_report_of_a_summary_of_the_wrong_shape(tmp_path, capsys, name, text, says):
    from framework.cli import report

    job = tmp_path / "0"
    job.mkdir()
    (job / "summary.json").write_text("{}")
    (job / name).write_text(text)
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path), "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"error: report: {job / name} is malformed ({says}); fix or remove it\n"


def test_report_into_a_folder_it_cannot_write(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from framework.cli import report

    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "summary.json").write_text("{}")
    (tmp_path / "0" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    out = "/proc/self"   # a folder where no file can be made, even by root
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path), "--out", out])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: report: cannot write in {out} (") and err.endswith(
        "); fix its permissions or pass a writable folder with --out\n"), err


SYNTAX = "(overrides are key=value; the syntax: https://hydra.cc/docs/advanced/override_grammar/basic)"


@pytest.mark.parametrize("override,why", [
    ("train.steps", "missing EQUAL at '<EOF>'"),
    ("optimizer.lr=[1,", "no viable alternative at input '[1,'"),
    # the lexer's caret (a line of its own) named as the character to quote
    ("checkpoint.dir=~/ck", "an unquoted value may not hold '~'; quote the value (inside the shell's quotes): "
                            "checkpoint.dir='~/ck'"),
    ("hydra.run.dir=/r/it's ü", "an unquoted value may not hold \"'\"; quote the value (inside the shell's quotes): "
                                "hydra.run.dir=\"/r/it's ü\""),
    # both quote kinds: the chosen one escaped inside (the form parses back to the value), or no form at all
    ("data.path=x'é\"", "an unquoted value may not hold \"'\"; quote the value (inside the shell's quotes): "
                        "data.path=\"x'é\\\"\""),
    ("data.path=x'é\"\\", "an unquoted value may not hold \"'\"; quote the value (inside the shell's quotes), a "
                          "quote inside it escaped with \\"),
])
def test_override_syntax_mistake(override, why):
    from framework.cli.train import _jobs

    line = f"cannot parse override {override!r}: {why} {SYNTAX}"
    with pytest.raises(framework.ConfigError) as e:
        framework.compose([override])
    assert str(e.value) == line
    with pytest.raises(framework.ConfigError) as e:   # a multirun parses its sweeps first
        _jobs(["-m", override])
    assert str(e.value) == line


def test_recipe_misspelt_action(capsys):
    from framework.cli import recipe

    assert recipe.main(["shakespeare_char_cpu", "prepar", "data.path=README.md"]) == 2
    assert capsys.readouterr().err == ("error: unknown action 'prepar' (did you mean 'prepare'?): give one of run, "
                                       "prepare, check (or none: run), then key=value overrides\n")


def test_recipe_prepare_reads_data_path_as_train_does(tmp_path, capsys, monkeypatch):
    """Hydra's quoting (a path with a non-ASCII letter must be quoted for train) is read by prepare too."""
    from framework.cli import recipe

    src = tmp_path / "sp ace ü" / "in.txt"
    src.parent.mkdir()
    src.write_text("to be or not to be\n" * 40)   # (each split longer than the recipe's context)
    out = tmp_path / "tok.bin"
    assert recipe.main(["shakespeare_char_cpu", "prepare", f"data.path='{src}'", "--out", str(out)]) == 0, \
        capsys.readouterr().err
    assert out.is_file()
    capsys.readouterr()
    # Not one file (before: its Python repr taken as a file name), and an interpolation resolved on its own.
    for given in ("data.path=a,b", "data.path=null", "data.path=[a]"):
        assert recipe.main(["shakespeare_char_cpu", "prepare", given, "--out", str(out)]) == 2
        assert capsys.readouterr().err == (f"error: {given}: prepare takes one file: data.path=FILE (quote a path "
                                           "with a comma: data.path='a,b'; a sweep, -m, is not run here)\n")
    monkeypatch.setenv("PREP_SRC", str(src.parent))
    assert recipe.main(["shakespeare_char_cpu", "prepare", "data.path='${oc.env:PREP_SRC}/in.txt'", "--out",
                        str(out)]) == 0, capsys.readouterr().err


def test_a_stage_key_without_a_stage():
    """Hydra's run composes the command line as given, with the DeepSpeed file's group choices that
    all jobs share: a stage's key needs the stage chosen there."""
    from framework.cli.train import check_groups_chosen
    from framework.config import compose_layers

    overrides = ["stage.reduce_bucket_size=5"]
    cfg, config = compose_layers(overrides)
    with pytest.raises(framework.ConfigError) as e:
        check_groups_chosen(overrides, cfg, config, {})
    assert str(e.value) == ("config: stage.reduce_bucket_size=5 sets a key of the stage, which the command line does not "
                            "choose; choose it first: +stage=ddp stage.reduce_bucket_size=5")
    for overrides in (["+stage=ddp", "stage.reduce_bucket_size=5"], ["++stage.reduce_bucket_size=5"]):
        check_groups_chosen(overrides, *compose_layers(overrides), {})
    # the file's stage (optimizer) goes to Hydra's run, unless a sweep's files choose differently: then a
    # stage key is one line (no stage is chosen by default), another group's is Hydra's to judge (its
    # default group may have the key: optimizer.lr in adamw, in a sweep over files of two optimizers)
    for overrides, ds, group in ((["stage.overlap_comm=true"], {"zero_optimization": {"stage": 2}}, "stage"),
                                 (["optimizer.momentum=0.5"], {"optimizer": {"type": "SGD", "params": {}}}, "optimizer"),
                                 (["optimizer.lr=0.01"], {"optimizer": {"type": "SGD", "params": {}}}, "optimizer")):
        cfg, config = compose_layers(overrides, ds_config=ds)
        check_groups_chosen(overrides, cfg, config, {group: config.choices[group]})
        if group != "stage":
            check_groups_chosen(overrides, cfg, config, {})
            continue
        with pytest.raises(framework.ConfigError) as e:
            check_groups_chosen(overrides, cfg, config, {})
        assert str(e.value) == (f"config: {overrides[0]} sets a key of the {group} group, which the DeepSpeed files "
                                f"of the sweep's jobs choose differently; set it as ++{overrides[0]}")


def test_a_stage_key_without_a_stage_from_the_command_line(forkrun, tmp_path):
    p = forkrun.run("framework.train", ["stage.reduce_bucket_size=5", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.splitlines() == [
        "error: config: stage.reduce_bucket_size=5 sets a key of the stage, which the command line does not choose; "
        "choose it first: +stage=ddp stage.reduce_bucket_size=5"]
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None,
                    reason="as root, needs setpriv (util-linux) to drop root's file access")
def test_unreadable_token_data(tmp_path):
    """A mode-000 token file (root reads any file: its capabilities are dropped for the check)."""
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--inh-caps",
            "-dac_override,-dac_read_search,-fowner"] if os.geteuid() == 0 else []
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(b"ab")
    tokens.chmod(0)
    code = ("from framework.data.tokens import TokensConfig, TokensSource\n"
            f"TokensSource(TokensConfig(path={str(tokens)!r}, vocab_size=256), seed=0, context=1)")
    p = subprocess.run([*drop, sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and p.stderr.splitlines()[-1] == (
        f"framework.core.errors.DataError: data.path={tokens}: cannot read it (Permission denied); "
        "fix its permissions or point data.path at a readable file"), p.stderr


def test_a_model_vocab_size_that_the_data_overrides_is_refused(tmp_path):
    from framework.cli.launch import launch
    from framework.loggers import RunInfo
    from tests._helpers import tiny_config

    cfg = tiny_config("model.vocab_size=512", "train.steps=1", "train.eval_batches=1")
    with pytest.raises(framework.ConfigError) as e:
        launch(cfg, RunInfo(tmp_path / "run", None, None))
    assert str(e.value).startswith("model.vocab_size=512 differs from the 24 token ids of the data") and \
        "data.vocab_size" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run" / "summary.json").exists()


def test_auto_cast_under_the_command_lines_token_data_is_noted(tmp_path, capfd):
    """The built-in data sources give token ids, which precision.auto_cast never casts: said once at start-up."""
    from framework.cli.launch import launch
    from framework.loggers import RunInfo
    from tests._helpers import tiny_config

    for auto_cast in (True, False):
        cfg = tiny_config("precision=fp16", f"precision.auto_cast={auto_cast}", "train.steps=1", "train.eval_batches=1",
                          "logger=none")
        launch(cfg, RunInfo(tmp_path / f"run{auto_cast}", None, None))
        assert capfd.readouterr().err.count("note: precision.auto_cast=true changes nothing here: data=synthetic gives "
                                            "the model integer token ids") == auto_cast


@pytest.mark.parametrize("override,says", [
    ("offload.ratio=0.5", "config: offload.ratio is a key of offload=cpu, offload=nvme, not of offload=none (chosen); "
                          "choose such an option (offload=cpu offload.ratio=0.5) or drop offload.ratio"),
    ("data.path=a.bin", "config: data.path is a key of data=text, data=tokens, not of data=synthetic (chosen); "
                        "choose such an option (data=text data.path=a.bin) or drop data.path"),
    ("stage.reduce_scatter=false", "config: stage.reduce_scatter is a key of stage=zero1, stage=zero2, stage=zero3, "
                                   "not of stage=ddp (chosen); choose such an option (+stage=zero1 "
                                   "stage.reduce_scatter=false) or drop stage.reduce_scatter"),
    ("offload.nothing=1", "config: unknown key 'offload.nothing'; offload=none has no keys"),
])
def test_a_key_of_a_group_option_not_chosen(override, says, monkeypatch):
    """With Hydra and without (framework.config.plainconf composes and types, as on the GPU image)."""
    from framework.config import compose, validate
    from framework.config.plainconf import plain_composer

    overrides = [override] if not override.startswith("stage.") else ["+stage=ddp", override]
    with pytest.raises(framework.ConfigError) as e:
        compose(overrides)
    assert str(e.value) == says
    monkeypatch.setattr("framework.config.checks.OmegaConf", None)
    with pytest.raises(framework.ConfigError) as e:
        validate(*plain_composer(overrides))
    assert str(e.value) == says


def test_a_null_for_a_key_of_another_option_suggests_one_that_takes_null():
    """data=synthetic's vocab_size takes no null, data=tokens's does: the command suggested runs."""
    from framework.config import compose

    with pytest.raises(framework.ConfigError) as e:
        compose(["data=text", "data.vocab_size=null", "data.path=a.txt"])
    assert str(e.value).endswith("choose such an option (data=tokens data.vocab_size=null) or drop data.vocab_size")


@pytest.mark.parametrize("overrides,says", [
    (["dist.backend=ncl"], "config: dist.backend must be auto, gloo or nccl, got 'ncl' (did you mean 'nccl'?)"),
    (["scheduler=warmup_decay_lr", "scheduler.warmup_type=lienar"],
     "config: scheduler.warmup_type must be log or linear, got 'lienar' (did you mean 'linear'?)"),
    (["optimizer.lr=5e-5", "scheduler.min_lr=1e-4"],
     "config: scheduler.min_lr=0.0001 must be in [0, optimizer.lr=5e-05]; set scheduler.min_lr <= optimizer.lr or "
     "scheduler=constant (min_lr: null is lr / 10)"),
    (["optimizer.lr=-1"], "optimizer.lr must be >= 0 for adamw, got -1.0"),   # not the scheduler's min_lr
    (["optimizer.eps=0"], "optimizer.eps must be > 0 for adamw, got 0.0 (an eps of 0 makes the update 0/0 = NaN wherever a "
     "gradient and its running state are 0, as in the flat buffers' padding); give a small positive value such as "
     "1e-8"),
    # a Hub name is not on disk (nothing is downloaded): refused with the config, not after the header
    (["model=hf", "model.config=gpt2"], "model.config=gpt2: no such file (a Hub name? nothing is downloaded; give a "
     "local folder: a config.json or a folder holding one)"),
    (["model=hf", "model.pretrained=gpt2"], "model.pretrained=gpt2: no such file (a Hub name? nothing is downloaded; "
     "give a local folder: a save_pretrained folder)"),
    # what the config.json alone decides: refused with the config, not by each rank after the header
    (["model=hf", f"model.config={HF_GPT2}", "model.context=256", "dist.nproc=2"],
     "model.context=256 exceeds the model's max_position_embeddings (128); set model.context <= 128"),
    # the loop saves no checkpoint (compose accepts it: one's own loop may call ckpt.save)
    (["checkpoint.async=true"], "config: checkpoint.async=true does nothing with checkpoint.every=0 (no saves); set "
     "checkpoint.every=N or remove checkpoint.async=true from the command line or config file that sets it"),
    (["checkpoint.keep_last=5"], "config: checkpoint.keep_last=5 does nothing with checkpoint.every=0 (no saves, so "
     "none are pruned); set checkpoint.every=N or remove checkpoint.keep_last=5 from the command line or config "
     "file that sets it"),
])
def test_a_closed_choice_is_checked_before_the_run_folder(forkrun, tmp_path, overrides, says):
    p = forkrun.run("framework.train", [*overrides, "train.steps=2", f"hydra.run.dir={tmp_path / 'run'}"],
                    cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.splitlines() == [f"error: {says}"]
    assert not (tmp_path / "run").exists()


def test_keep_last_with_no_saves_is_refused_from_a_config_file_too(forkrun, tmp_path):
    """As checkpoint.async=true is: the value does nothing wherever it is set; the line says where to remove it."""
    (tmp_path / "mine.yaml").write_text("defaults:\n  - train\n  - _self_\ncheckpoint:\n  keep_last: 5\n")
    p = forkrun.run("framework.train", ["--config-dir", str(tmp_path), "--config-name", "mine", "train.steps=2",
                                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.splitlines() == [
        "error: config: checkpoint.keep_last=5 does nothing with checkpoint.every=0 (no saves, so none are pruned); "
        "set checkpoint.every=N or remove checkpoint.keep_last=5 from the command line or config file that sets it"]
    assert not (tmp_path / "run").exists()


def test_a_token_file_without_metadata_says_what_it_is_read_as(tmp_path):
    """No <stem>.meta.json: the default vocabulary is a stated assumption, and a file of text is
    named as such with the group that reads text."""
    import numpy as np

    from framework.config import compose

    text, ids = tmp_path / "a.txt", tmp_path / "t.bin"
    text.write_text("hello world, some text\n" * 8)
    np.arange(100, 2100, dtype="<u2").tofile(ids)

    def notes(*overrides):
        return [n for n in compose(["data=tokens", *overrides]).notices if "data.path" in n]

    assert notes(f"data.path={text}") == [
        f"note: data.path={text} looks like text (its first 184 bytes are printable characters) and has no "
        f"a.meta.json, so its bytes are read as uint16 token ids of a 50304-token vocabulary; for a text file use "
        f"data=text data.path={text}"]
    assert notes(f"data.path={ids}") == [
        f"note: data.path={ids} has no t.meta.json: its uint16 token ids are taken to be of the default "
        "vocabulary (data.vocab_size=50304, GPT-2's padded); set data.vocab_size to the tokenizer's size"]
    assert notes(f"data.path={ids}", "data.vocab_size=4096") == []
    (tmp_path / "t.meta.json").write_text('{"vocab_size": 2100}')
    assert notes(f"data.path={ids}", "data.vocab_size=2100") == notes(f"data.path={ids}") == []


def test_a_recipe_name_near_one_gets_a_did_you_mean():
    from framework.cli import recipe

    with pytest.raises(framework.FrameworkError) as e:
        recipe.find("shakespeare_char")
    assert str(e.value).startswith("no recipe 'shakespeare_char' (did you mean 'shakespeare_char_")
    assert "; available: " in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flag", ["--config-path", "-cp"])
def test_config_path_is_refused_naming_config_dir(flag, tmp_path):
    """The config was composed from conf/ and checked while Hydra's run read the folder given: the job
    trained the default config, its record said the folder's."""
    from framework.cli.train import _jobs

    (tmp_path / "train.yaml").write_text("defaults:\n  - train\n  - _self_\ntrain:\n  steps: 3\n")
    for argv in ([flag, str(tmp_path), "train.micro_batch=2"], ["--cfg", "job", flag, str(tmp_path)]):
        with pytest.raises(framework.ConfigError) as e:
            _jobs(argv)
        assert str(e.value).startswith(f"--config-path {tmp_path}: not supported") and str(e.value).endswith(
            f"use --config-dir {tmp_path} (with --config-name NAME for a file other than train.yaml)")


HYDRA_ONE = "Hydra takes one of --run, -m, --cfg, --info and --shell-completion at a time"


@pytest.mark.parametrize("argv,line", [
    (["-m", "optimizer=adamw,lion", "--cfg", "job"],
     f"-m with --cfg job: {HYDRA_ONE}; drop -m to print one job's config (give each swept key one of its values)"),
    (["-m", "optimizer=adamw,lion", "--info"],
     f"-m with --info: {HYDRA_ONE}; drop -m to print one job's info (give each swept key one of its values)"),
    (["--run", "--info", "defaults"], f"--run with --info defaults: {HYDRA_ONE}; keep one"),
    *[(argv, "--resolve: only with --cfg job|hydra|all (or --help); add --cfg job to print the resolved config")
      for argv in (["logger=none", "--resolve"], ["-m", "optimizer=adamw,lion", "--resolve"])],
    # A flag between overrides: Hydra's parser would print its usage and blame the valid override after it.
    *[(argv, f"{flags} between the overrides {a} and {b}: Hydra reads the overrides as one run of words; put {flags} "
             "before or after all of them")
      for argv, flags, a, b in (
          (["optimizer=adamw", "-m", "train.steps=2,3"], "-m", "optimizer=adamw", "train.steps=2,3"),
          (["-m", "a=1", "--cfg", "job", "b=2"], "--cfg job", "a=1", "b=2"))],
])
def test_hydra_commands_given_together_are_one_line(argv, line):
    """Hydra refuses them with a traceback (--help advertises --cfg job; a sweep's user tries it with -m)."""
    from framework.cli.train import _jobs

    with pytest.raises(framework.ConfigError) as e:
        _jobs(argv)
    assert str(e.value) == line
    assert _jobs(["--cfg", "hydra"])[0] is None   # one command: Hydra prints it
    flags_after = _jobs(["-cn", "train", "optimizer=adamw", "train.steps=2", "-m"])[0]
    assert flags_after == [["optimizer=adamw", "train.steps=2"]]


def test_cfg_job_package_of_a_null_key_shows_null(capsys):
    from framework.cli.train import _print_resolved

    primary = {"config_dir": None, "config_name": "train"}
    _print_resolved([], False, primary, "checkpoint.dir")   # null: the run folder's checkpoints/
    assert capsys.readouterr().out == "null\n"
    with pytest.raises(framework.ConfigError) as e:
        _print_resolved([], False, primary, "checkpoint.dirr")
    assert str(e.value) == "--package checkpoint.dirr: the config has no such key"


def test_compose_refuses_a_string_and_a_world_below_one():
    from framework.config import compose_layers

    for call in (lambda: framework.compose("train.steps=5"), lambda: compose_layers("train.steps=5")):
        with pytest.raises(framework.ConfigError) as e:
            call()
        assert str(e.value) == ("config: overrides must be a list of strings, not the string 'train.steps=5'; "
                                "pass ['train.steps=5']")
    for world in (0, -2):
        with pytest.raises(framework.ConfigError) as e:
            framework.compose(["train.steps=5"], world=world, ds_config={"train_batch_size": 16})
        assert str(e.value) == f"config: world={world}: the number of ranks must be >= 1"


OWN_MODEL = '''
from dataclasses import dataclass

from torch import nn

from framework.core.registry import Component
from framework.models._base import ModelComponent, next_token_loss


@dataclass(frozen=True, kw_only=True)
class TinyConfig:   # (no vocab_size: the data's)
    d_model: int = 8
    {context}


class Tiny(nn.Module):
    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.emb(x))
{init}

def loss(module, batch):
    x, y = batch
    return next_token_loss(module(x), y)


COMPONENT = {kind}(config=TinyConfig, build=lambda cfg, vocab_size=None: Tiny(vocab_size, cfg.d_model){loss})
'''
INIT = '''
    def init_parameter(self, name, t):
        nn.init.normal_(t, std=0.02)
'''


@pytest.fixture
def own_model(own_component):
    """``use(**parts)``: a model ``tiny`` of OWN_MODEL's ``parts`` (``own_component``)."""
    def use(kind="ModelComponent", context="context: int = 8", init=INIT, loss=", loss=loss"):
        return own_component("model", "tiny", OWN_MODEL.format(kind=kind, context=context, init=init, loss=loss),
                             "d_model: 8\n")

    return use


def test_a_model_of_ones_own_is_refused_in_one_line_until_it_has_what_training_needs(own_model, tmp_path, capsys):
    """A module in framework/models/ plus its YAML file (docs/architecture.md): a plain Component (no loss), a
    config without context and a module without init_parameter (training builds on meta) are one line each;
    with all three it trains, and estimate counts it at the data's vocabulary where its config states none."""
    from framework.cli.estimate import main as estimate
    from framework.cli.launch import launch
    from framework.core.registry import registry
    from framework.loggers import RunInfo

    for parts, says in (({"kind": "Component", "loss": ""}, "model 'tiny' (framework.models.tiny) is a Component, "
                                                            "not a ModelComponent, so training has no loss for it"),
                        ({"context": ""}, "model 'tiny' (framework.models.tiny): its config TinyConfig has no field "
                                          "context (the sequence length training feeds the model)")):
        own_model(**parts)
        with pytest.raises(framework.ConfigError) as e:
            registry("model")
        assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)
    run = ["model=tiny", "train.steps=2", "train.micro_batch=2", "train.eval_batches=1", "logger=none"]
    search = own_model(init="")
    with pytest.raises(framework.ConfigError) as e:
        launch(framework.compose([*run, search]), RunInfo(tmp_path / "run", None, None))
    assert str(e.value).startswith("parameter 'emb.weight' is on the meta device but Tiny has no init_parameter(name, "
                                   "tensor) method to initialise it; add that method (the training command always "
                                   "builds its model on the meta device)") and "\n" not in str(e.value), str(e.value)
    search = own_model()
    summary = launch(framework.compose([*run, search]), RunInfo(tmp_path / "run2", None, None))
    assert summary["steps"] == 2 and math.isfinite(summary["val_loss"])
    estimate(["model=tiny", search])
    assert "; vocab 64 (from data=synthetic)." in capsys.readouterr().out
    estimate(["model=tiny", own_model(context="context: int = 8\n    vocab_size: int = 50")])   # (its module: no cfg)
    assert "; vocab 50 (from model)." in capsys.readouterr().out


OWN_OPTIMIZER = '''
from dataclasses import dataclass

from framework.core.registry import Component
from framework.optimizers import GradientTransformation


@dataclass(frozen=True, kw_only=True)
class SignConfig:
    {fields}


def build(cfg, decay_mask):
    return GradientTransformation(lambda params: (), lambda grads, state, params, lr: ([-lr * g.sign() for g in grads],
                                                                                       state))


COMPONENT = Component(config=SignConfig, build=build)
'''


def test_an_optimizer_of_ones_own_is_refused_in_one_line_without_lr_and_decay_1d(own_component, tmp_path):
    """A module in framework/optimizers/ plus its YAML file (docs/architecture.md): training reads ``lr`` (the
    schedule's base lr) and ``decay_1d`` from every optimizer's config, so a config without either is one line when
    the registry is read (not an AttributeError mid-build); with both it trains."""
    from framework.cli.launch import launch
    from framework.core.registry import registry
    from framework.loggers import RunInfo

    start = "optimizer 'sign' (framework.optimizers.sign): its config SignConfig has no field "
    for fields, says in (("lr: float = 1e-3", "decay_1d (training reads lr, the schedule's base learning rate, and "
                                              "decay_1d, whether 1-D params are decayed too, from every optimizer's "
                                              "config); add decay_1d: bool = False to it (its YAML file may set it)"),
                         ("decay_1d: bool = False", "lr ("),
                         ("step_size: float = 1e-3", "lr and no field decay_1d (")):
        own_component("optimizer", "sign", OWN_OPTIMIZER.format(fields=fields), "")
        with pytest.raises(framework.ConfigError) as e:
            registry("optimizer")
        assert str(e.value).startswith(start + says) and "\n" not in str(e.value), str(e.value)
    search = own_component("optimizer", "sign", OWN_OPTIMIZER.format(fields="lr: float = 1e-3\n    decay_1d: bool = "
                                                                            "False"), "lr: 1.0e-2\n")
    cfg = framework.compose(["optimizer=sign", "train.steps=2", "train.micro_batch=2", "train.eval_batches=1",
                             "logger=none", search])
    assert cfg.optimizer.lr == 1e-2
    summary = launch(cfg, RunInfo(tmp_path / "run", None, None))
    assert summary["steps"] == 2 and math.isfinite(summary["val_loss"])


OWN_PRECISION = '''
from dataclasses import dataclass

import torch

from framework.core.registry import Component
from framework.precision import Policy


@dataclass(frozen=True, kw_only=True)
class PureConfig:
    {fields}


COMPONENT = Component(config=PureConfig, build=lambda cfg: Policy("pure", torch.float32, torch.float32, torch.float32,
                                                                  None))
'''


def test_a_precision_of_ones_own_without_grad_accum_dtype_is_refused_in_one_line(own_component, tmp_path):
    """The config checks read precision.grad_accum_dtype of every precision: a config without the field is one line
    when the registry is read (not an AttributeError in the checks); with it, it trains."""
    from framework.cli.launch import launch
    from framework.core.registry import registry
    from framework.loggers import RunInfo

    own_component("precision", "pure", OWN_PRECISION.format(fields="pass"), "{}\n")
    with pytest.raises(framework.ConfigError) as e:
        registry("precision")
    assert str(e.value).startswith("precision 'pure' (framework.precision.pure): its config PureConfig has no field "
                                   "grad_accum_dtype (") and "\n" not in str(e.value), str(e.value)
    assert "add grad_accum_dtype: str = \"fp32\" to it" in str(e.value), str(e.value)
    search = own_component("precision", "pure", OWN_PRECISION.format(fields="grad_accum_dtype: str = \"fp32\""),
                           "{}\n")
    cfg = framework.compose(["precision=pure", "train.steps=2", "train.micro_batch=2", "train.eval_batches=1",
                             "logger=none", search])
    summary = launch(cfg, RunInfo(tmp_path / "run", None, None))
    assert summary["steps"] == 2 and math.isfinite(summary["val_loss"])


def test_a_python_without_torch_is_one_line():
    """The likeliest first mistake, a python outside the venv: the command says how to fix it in one line and
    exits 1 (not an import traceback); ``import framework`` raises the same words for its program to handle.
    -S hides site-packages, so this python sees no torch."""
    root, env = Path(framework.__file__).parents[1], {**os.environ, "PYTHONPATH": ""}
    fix = f"torch is not installed for {sys.executable}: run `make setup`, then `. .venv/bin/activate`"
    p = subprocess.run([sys.executable, "-S", "-m", "framework.train"], cwd=root, env=env, capture_output=True,
                       text=True)
    assert p.returncode == 1 and p.stderr.startswith(f"error: {fix}") and len(p.stderr.splitlines()) == 1, p.stderr
    p = subprocess.run([sys.executable, "-S", "-c", "import framework"], cwd=root, env=env, capture_output=True,
                       text=True)
    assert p.returncode == 1 and p.stderr.splitlines()[-1].startswith(f"ImportError: {fix}"), p.stderr


_WITHOUT_HYDRA = r'''
import json, pathlib, runpy, sys
HERE = pathlib.Path(sys.argv[1]).parent   # (run() sets sys.argv)
def run(*argv):
    sys.argv = ["-m", *argv[1:]]
    try:
        runpy.run_module(f"framework.{argv[0]}", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, (int, str)) else 0
    return 0
sys.modules["matplotlib"] = None   # (nor matplotlib, as on the GPU image: Hydra, which a run needs, is named first)
out = {"train": run("train", "train.steps=1"),
       "recipe": run("recipe", "zero_equivalence", "--quick", "--out", sys.argv[1])}
(HERE / "text.txt").write_text("to be, or not to be: that is the question\n" * 50)   # prepare composes nothing
out["prepare"] = run("recipe", "shakespeare_char_cpu", "prepare", f"data.path='{HERE / 'text.txt'}'",
                     "--out", str(HERE / "tokens.bin"))
out["estimate"] = run("estimate", "model=conf/model/gpt-nano.yaml", "model.n_layer=3", "--json")
out["estimate_bad"] = run("estimate", "model=conf/model/gpt-nano.yaml", "model.n_layer=2.5")
for name, text in (("bad", "n_layer: two\nbias: false"), ("nobias", "n_layer: 2")):   # errors in the model YAML
    path = HERE / f"{name}.yaml"
    path.write_text("vocab_size: 65\ncontext: 64\nn_head: 4\nd_model: 128\n" + text + "\n")
    out[f"estimate_{name}"] = run("estimate", f"model={path}")
import framework   # W&B hidden as a missing package is (find_spec None): its config check is one line
try:
    framework.compose(["logger=wandb"])
except framework.ConfigError as e:
    out["wandb"] = str(e)
print("\n" + json.dumps(out))
'''


def test_the_commands_without_hydra_say_what_to_install_and_estimate_runs(tmp_path):
    """Where Hydra, OmegaConf and W&B are not installed (the GPU image): train and recipe, which compose with Hydra,
    are one line naming the package and how to install it, exit 2 both (before matplotlib, which the image lacks
    too); recipe's prepare, which composes nothing, runs; estimate reads a model YAML without OmegaConf;
    logger=wandb is refused in one line."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests' / 'without_hydra'}"}
    p = subprocess.run([sys.executable, "-c", _WITHOUT_HYDRA, str(tmp_path / "out")], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout[-2000:] + p.stderr[-3000:]
    import json
    out = json.loads(p.stdout.splitlines()[-1])
    for command in ("train", "recipe"):
        line = f"python -m framework.{command} needs Hydra, and hydra is not installed for {sys.executable}: pip " \
               f"install -e . (from the checkout; or pip install 'hydra-core>=1.3.2,<1.4')"
        assert f"error: {line}" in p.stderr, (command, out, p.stderr)
    assert out["train"] == out["recipe"] == 2 and out["estimate"] == 0 and out["estimate_bad"] == 2, out
    assert out["prepare"] == 0 and f"wrote {tmp_path / 'tokens.bin'} (2,100 tokens, vocab" in p.stdout, p.stdout[-2000:]
    # an error in the model YAML names the file, as with OmegaConf (tests/cli/test_estimate.py)
    assert out["estimate_bad"] == out["estimate_nobias"] == 2, out
    assert (f"error: estimate: {tmp_path / 'bad.yaml'} is not a GPT model config: model.n_layer takes an integer (5e8 "
            "reads as 500000000), got 'two'") in p.stderr
    assert f"Missing mandatory value: model.bias (model={tmp_path / 'nobias.yaml'})" in p.stderr, p.stderr
    assert '"params": 607232,' in p.stdout, p.stdout[-2000:]   # gpt-nano's 804,096 less one layer (n_layer=3)
    # (a command line's value is not blamed on the file, as with OmegaConf)
    assert "error: config: model.n_layer takes an integer (5e8 reads as 500000000), got 2.5\n" in p.stderr
    assert out["wandb"] == "logger=wandb needs wandb, which is not installed: pip install wandb, or logger=console"


def test_a_component_under_a_taken_name_or_with_another_build_signature_is_one_line(own_component):
    """A second module defining a name the registry has (it silently replaced the built-in one for every run
    choosing that name) and a build the engine cannot call (a TypeError traceback inside engine/build.py): one
    line each when the registry is read, naming both modules / the call."""
    from framework.core.registry import registry

    clash = "from framework.optimizers import sgd\n\nCOMPONENTS = {'adamw': sgd.COMPONENT}\n"
    own_component("optimizer", "zz_mine", clash, "")
    with pytest.raises(framework.ConfigError) as e:
        registry("optimizer")
    assert str(e.value) == ("optimizer 'adamw' is defined by both framework.optimizers.adamw and "
                            "framework.optimizers.zz_mine: rename one (and its YAML file conf/optimizer/adamw.yaml)")
    own_component("optimizer", "sign", OWN_OPTIMIZER.format(fields="lr: float = 1e-3\n    decay_1d: bool = False")
                  .replace("def build(cfg, decay_mask):", "def build(cfg):"), "")
    with pytest.raises(framework.ConfigError) as e:
        registry("optimizer")
    assert str(e.value).startswith("optimizer 'sign' (framework.optimizers.sign): its build(cfg) cannot be called as "
                                   "the framework calls it, build(cfg, decay_mask) (") and "\n" not in str(e.value)
    # a config that is not frozen: cfg.optimizer.lr = -3.0 after compose trained unchecked (library.md)
    own_component("optimizer", "sign", OWN_OPTIMIZER.format(fields="lr: float = 1e-3\n    decay_1d: bool = False")
                  .replace("@dataclass(frozen=True, kw_only=True)", "@dataclass"), "")
    with pytest.raises(framework.ConfigError) as e:
        registry("optimizer")
    assert str(e.value) == ("optimizer 'sign' (framework.optimizers.sign): its config SignConfig is not frozen (a "
                            "composed config is checked once and cannot change after); declare it "
                            "@dataclass(frozen=True, kw_only=True)")


def test_a_field_of_ones_own_config_without_a_value_names_the_yaml_file_and_the_plus_override(own_component):
    """A config field without a default that its YAML file leaves out: the line names both ways to give it (the
    YAML file's key, or +key=V: without the +, Hydra refuses a key the file lacks), not OmegaConf's words."""
    fields = "lr: float = 1e-3\n    decay_1d: bool = False\n    alpha: float"
    search = own_component("optimizer", "sign", OWN_OPTIMIZER.format(fields=fields), "lr: 1.0e-2\n")
    with pytest.raises(framework.ConfigError) as e:
        framework.compose(["optimizer=sign", search])
    assert str(e.value) == ("config: optimizer.alpha has no value (a missing mandatory value: SignConfig gives it no "
                            "default); set alpha in its YAML file (optimizer/sign.yaml), or give +optimizer.alpha=VALUE")
    assert framework.compose(["optimizer=sign", "+optimizer.alpha=1", search]).optimizer.alpha == 1
    # Without the + (a field the YAML file leaves out, default or not): one line naming +key, not accepted here to
    # fail later in Hydra's app with its multi-line refusal; so is it without Hydra (plainconf refuses it as Hydra).
    for given, line in (([], "optimizer.alpha=1"), (["+optimizer.alpha=1"], "optimizer.decay_1d=true")):
        with pytest.raises(framework.ConfigError) as e:
            framework.compose(["optimizer=sign", *given, line, search])
        key = line.partition('=')[0]
        assert str(e.value) == (f"config: {key} is a field of its config but not in its YAML file, so Hydra adds it "
                                f"only with +: add + before {key} on the command line (or set it in the YAML file)")
    from framework.config import compose_layers, plainconf

    def without_hydra(overrides):   # (plainconf: conf/ alone; adamw.yaml as if it left bias_correction out)
        tree, choices = plainconf.plain_composer([o for o in overrides if "bias_correction" not in o])
        del tree["optimizer"]["bias_correction"]
        for o in overrides:
            if "bias_correction" in o:
                plainconf.set_key(tree, plainconf.parse(o))
        return tree, choices

    with pytest.raises(framework.ConfigError, match=r"^config: optimizer.bias_correction is .* add \+ before optim"):
        compose_layers(["optimizer.bias_correction=false"], composer=without_hydra)
    assert not compose_layers(["+optimizer.bias_correction=false"], composer=without_hydra)[1].optimizer.bias_correction


def test_a_config_dirs_group_file_is_what_the_run_trains_and_hydra_records(forkrun, tmp_path):
    """--config-dir with its own optimizer/adamw.yaml: the run trained with it while Hydra's app (conf/ first)
    recorded conf/'s values in .hydra/config.yaml. Both now search the folder first."""
    import json

    from omegaconf import OmegaConf

    from framework.core.paths import conf_dir

    (tmp_path / "c" / "optimizer").mkdir(parents=True)
    (tmp_path / "c" / "optimizer" / "adamw.yaml").write_text(
        (conf_dir() / "optimizer" / "adamw.yaml").read_text().replace("lr: 1.0e-3", "lr: 5.0e-2"))
    (tmp_path / "c" / "my.yaml").write_text("defaults: [train, _self_]\n")
    p = forkrun.run("framework.train", ["--config-dir", str(tmp_path / "c"), "--config-name", "my", "train.steps=1",
                                        "train.eval_every=0", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert f"note: config: {tmp_path / 'c' / 'optimizer' / 'adamw.yaml'} is used in place of" in p.stderr, p.stderr
    recorded = OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml")
    trained = json.loads((tmp_path / "run" / "summary.json").read_text())["config"]
    assert recorded.optimizer.lr == trained["optimizer"]["lr"] == 5e-2, (recorded.optimizer, trained["optimizer"])


def test_a_run_refused_in_the_checkpoint_pre_flight_leaves_no_run_folder(forkrun, tmp_path):
    """The run folder made (and locked) before the checkpoint checks goes with their refusal: no folder
    holding only run.lock per attempt, and no note about a folder the run never named."""
    p = forkrun.run("framework.train", ["train.steps=2", f"checkpoint.resume={tmp_path / 'nope' / 'step-3'}"],
                    cwd=tmp_path)
    assert p.returncode == 1 and p.stderr.splitlines() == [
        f"error: checkpoint.resume={tmp_path / 'nope' / 'step-3'}: no checkpoint there (expected a step-<N> folder "
        "with manifest.json, or a directory holding them); use checkpoint.resume=auto or off"], p.stderr
    assert not list(tmp_path.iterdir())
    # a sweep's job: its folder gone too, and the job named without a stray comma where nothing was swept
    p = forkrun.run("framework.train", ["-m", "train.steps=2", "checkpoint.resume=nope", "hydra.sweep.dir=s"],
                    cwd=tmp_path)
    assert p.returncode == 1 and p.stderr.splitlines()[-1] == ("error: 1 job of the sweep failed (its error is "
                                                               "above): job 0 (no folder)"), p.stderr
    assert os.listdir(tmp_path / "s") == ["multirun.yaml"]


def test_a_leading_tilde_is_the_home_folder_for_every_path_setting(tmp_path, monkeypatch, capsys):
    """The shell leaves ``key=~/x`` and ``--to=~/x`` as typed: each path setting expands it (one helper), and
    Hydra's run and sweep folders, which the framework does not make, are refused in one line naming the
    expanded path (never a folder named ~ in the working folder)."""
    from omegaconf import OmegaConf

    from framework.cli import export
    from framework.cli.train import check_folder
    from framework.config import dsconfig, search_order

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 2}')
    assert dsconfig.load("~/ds.json") == {"train_micro_batch_size_per_gpu": 2}
    cfg = framework.compose(["+stage=zero3", "offload=nvme", "offload.nvme_path='~/swap'"])
    assert cfg.offload.nvme_path == str(tmp_path / "swap")
    (tmp_path / "cfgs").mkdir()
    _, rest, _ = search_order("~/cfgs", "mine", ["--config-dir=~/cfgs", "-cd", "~/cfgs", "a=~/b"])
    assert rest == [f"--config-dir={tmp_path / 'cfgs'}", "-cd", str(tmp_path / "cfgs"), "a=~/b"]   # (Hydra's read)
    for key in ("hydra.run.dir", "hydra.sweep.dir"):
        with pytest.raises(framework.ConfigError) as e:
            check_folder(OmegaConf.create({"hydra": {"run": {"dir": "~/r"}, "sweep": {"dir": "~/r"}}}), key)
        assert str(e.value) == (f"{key}=~/r: a leading ~ is not expanded there; write the home folder's path: "
                                f"{key}={tmp_path / 'r'}")
    assert export.main(["~/ck", "--to=~/out"]) == 2   # (a refused argument)
    assert capsys.readouterr().err == f"error: export: {tmp_path / 'ck'} does not exist\n"
    assert sorted(os.listdir(tmp_path)) == ["cfgs", "ds.json"]


def test_a_file_where_hydras_record_goes_is_one_line_before_the_run(tmp_path):
    """Looked at as the job starts (``record_job``, before the run is launched), not when it is written."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from framework.cli._hydra import Passed, record_job

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".hydra").write_text("x")
    for mode, key in ((RunMode.RUN, "hydra.run.dir"), (RunMode.MULTIRUN, "hydra.sweep.dir")):
        hc = OmegaConf.create({"mode": mode, "runtime": {"output_dir": str(tmp_path / "run")}})
        with pytest.raises(framework.ConfigError) as e:
            record_job(OmegaConf.create({}), hc, ".hydra", Passed())
        assert str(e.value) == (f"cannot write Hydra's record of the job (hydra.output_subdir=.hydra) in "
                                f"{tmp_path / 'run' / '.hydra'}: it is not a folder; move it away, or give this run a "
                                f"folder of its own: {key}=PATH")
    assert os.listdir(tmp_path / "run") == [".hydra"]


def test_an_optimizer_of_ones_own_with_a_norm_over_its_group_is_refused_by_initialize(own_component):
    """A LAMB/LARS-style norm over a group trained, with no error, another model at each stage, offload and
    bucket size (a group is a shard or piece, not a parameter): initialize refuses it in one line."""
    import torch

    fields = "lr: float = 1e-3\n    decay_1d: bool = False"
    code = OWN_OPTIMIZER.format(fields=fields).replace("g.sign()", "g / g.norm()")
    search = own_component("optimizer", "sign", code, "")
    cfg = framework.compose(["optimizer=sign", "logger=none", search])
    with pytest.raises(framework.ConfigError, match=r"^optimizer 'sign': its update is not elementwise \("):
        framework.initialize(torch.nn.Linear(4, 2), lambda m, b: m(b).sum(), cfg)
