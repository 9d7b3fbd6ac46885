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
