"""cpu: DeepSpeed's offload_optimizer (and, for zero3, offload_param) to host memory.

The fp32 master partition and the optimizer state live in host memory (pinned when CUDA is
present); gradients of the owned partition are copied to the host after reduction, the
optimizer step runs there (the C++ CPU kernels when built), and updated values go back to
the device in the working dtype before the stage gathers them; copies run on their own stream
(``offload._pipeline``). With ``ratio`` < 1 only the
first ``ratio`` of every partition is stepped on the host and the rest stays on the device
(DeepSpeed's partial offload).
"""
from dataclasses import dataclass

from framework.comm.accelerator import Accelerator
from framework.core.errors import ConfigError
from framework.offload.base import Placement
from framework.core.registry import Component


@dataclass(kw_only=True)
class CPUOffloadConfig:
    params: str = "none"        # zero3 parameter shards: none (device) | cpu (host memory between gathers)
    ratio: float = 1.0          # fraction of each partition whose optimizer step runs on the host
    pin_memory: bool = True     # page-locked host buffers (CUDA; without them copies cannot be asynchronous)
    # Gradients always reach the host per bucket during zero2's backward, and the host step is
    # always pipelined with the copy back. overlap_step also starts each piece's step during
    # backward, speculatively (identical results); it costs host memory for undo copies of
    # those pieces (master + optimizer state: 12 bytes/param with Adam).
    overlap_step: bool = False


def build(cfg: CPUOffloadConfig, accelerator: Accelerator | None = None) -> Placement:
    """``accelerator``: the compute device's (``initialize`` passes it; default: the stage's device's)."""
    if not 0.0 <= cfg.ratio <= 1.0:
        raise ConfigError(f"offload.ratio must be in [0, 1], got {cfg.ratio}")
    return Placement(host_fraction=cfg.ratio, pin=cfg.pin_memory, params_on_host=cfg.params == "cpu",
                     overlap_step=cfg.overlap_step, accelerator=accelerator)


def check(node: CPUOffloadConfig, stage: str) -> CPUOffloadConfig:
    """``offload.params`` against the stage (the configuration's check for this target)."""
    if node.params not in ("none", "cpu"):
        hint = {"nvme": " (parameter shards on disk: offload=nvme)",
                "True": " (the former offload.params=true is offload.params=cpu)",
                "False": " (the former offload.params=false is offload.params=none)"}.get(str(node.params), "")
        raise ConfigError(f"config: offload.params must be none or cpu with offload=cpu, got "
                          f"{node.params!r}{hint}")
    if node.params == "cpu" and stage != "zero3":
        raise ConfigError(f"config: offload.params=cpu (parameter offload) needs +stage=zero3, got "
                          f"stage={stage}; use offload.params=none or +stage=zero3")
    return node


COMPONENT = Component(config=CPUOffloadConfig, build=build, check=check)
