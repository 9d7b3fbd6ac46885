"""Put this folder on PYTHONPATH to run Python as on the GPU image: without Hydra, OmegaConf and
W&B (importing them fails), in this process and every process it starts (tests only)."""
import importlib.abc
import sys

BLOCKED = ("hydra", "omegaconf", "antlr4", "wandb")


class _Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: as on the GPU image)", name=name)
        return None


sys.meta_path.insert(0, _Missing())
