"""framework: DeepSpeed's ZeRO with a functional API.

    import framework
    cfg = framework.compose(["+stage=zero2", "optimizer=adamw", "train.steps=100"])
    with framework.initialize(my_module, my_loss_fn, cfg) as engine:
        state = engine.state                    # the initial state
        for batch in my_batches:                # batch: a list of grad_accum micro batches
            state, metrics = engine.train_step(state, batch)

A model built inside ``with framework.zero_init():`` stays on the meta device until ``initialize``
materialises it, under zero3 one parameter at a time into this rank's shard: a Hugging Face
``PreTrainedModel`` (its own ``_init_weights``), or a module with an ``init_parameter(name, tensor)``
method (as our GPT); ``initialize`` refuses any other module built there in one line (build it on a
real device).

The command line (``python -m framework.train``) composes the same components with Hydra.
"""
import importlib.util
import sys

if importlib.util.find_spec("torch") is None:
    # The likeliest first mistake (a python outside the project's venv): one line, not a traceback from
    # deep in an import. Under ``python -m framework.X`` (argv[0] is "-m" while the package loads) that is
    # the command's error and exit 1; ``import framework`` in a program raises, for that program to handle.
    _why = (f"torch is not installed for {sys.executable}: run `make setup`, then `. .venv/bin/activate` "
            f"(or run .venv/bin/python)")
    if sys.argv[:1] == ["-m"]:
        raise SystemExit(f"error: {_why}")
    raise ImportError(_why)

from framework.engine.build import Engine, initialize
from framework.config import Config, compose
from framework.core.errors import ConfigError, DataError, DistributedError, FrameworkError, TrainingError
from framework.engine.materialize import zero_init
from framework.stages.zero3 import gathered
from framework.engine.state import TrainState
from framework.core.batch import Batch
from framework.persist.weights import load_weights, save_weights

__all__ = ["Batch", "Config", "ConfigError", "DataError", "DistributedError", "Engine", "FrameworkError",
           "TrainState", "TrainingError", "compose", "gathered", "initialize", "load_weights", "save_weights",
           "zero_init"]
