"""The checking accelerator catches every GPU bug class of tests/_mutations.py, injected into a
real (tiny, world-1) training run, and names where it shows; the unmutated runs pass the check."""
import re

import pytest
import torch

import framework
from framework.comm.accelerator import CheckingCpuAccelerator
from framework.comm.distributed import Dist
from framework.models.gpt import gpt_loss
from tests._helpers import build_gpt, tiny_config
from tests._mutations import CORRECT, MUTATIONS

SCENARIOS = sorted({m.scenario for m in MUTATIONS})


def _run(scenario, acc, tmp_path, steps=2):
    nvme = [f"offload.nvme_path={tmp_path}"] if "offload=nvme" in scenario else []
    cfg = tiny_config(*scenario, *nvme, "train.micro_batch=2", "train.grad_accum=2")
    module, data = build_gpt(cfg)
    dist = Dist(0, 1, 0, torch.device("cpu"), None, 60.0, accelerator=acc)
    with framework.initialize(module, gpt_loss, cfg, dist) as engine:
        state = engine.state
        for _ in range(steps):
            batch = data.train_batch(state.data, micro_batch=2, grad_accum=2, rank=0, world=1)
            state, _ = engine.train_step(state, batch)
    acc.verify()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: " ".join(s))
def test_unmutated_runs_pass_the_check(scenario, tmp_path):
    _run(scenario, CheckingCpuAccelerator(), tmp_path)


@pytest.mark.parametrize("name,scenario,accelerator", CORRECT, ids=[c[0] for c in CORRECT])
def test_correct_variants_pass_the_check(name, scenario, accelerator, tmp_path):
    _run(scenario, accelerator(), tmp_path)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_mutation_is_caught_naming_the_place(mutation, monkeypatch, tmp_path):
    if mutation.patch is not None:
        mutation.patch(monkeypatch.setattr)
    with pytest.raises(Exception) as caught:
        _run(mutation.scenario, mutation.accelerator(), tmp_path)
    # The check's error may arrive wrapped (a worker thread's failure re-raised by the step).
    chain, e = [], caught.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    found = [x for x in chain if isinstance(x, mutation.error)]
    assert found, f"{mutation.name}: expected {mutation.error.__name__}, got {caught.value!r}"
    assert re.search(mutation.place, str(found[0])), f"{mutation.name}: the message does not name the place: {found[0]}"
