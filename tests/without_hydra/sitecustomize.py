"""Put this folder on PYTHONPATH to run Python as on the GPU image: without Hydra, OmegaConf and
W&B, in this process and every process it starts (tests only). They look not installed: importing one
fails with the ordinary ModuleNotFoundError and ``importlib.util.find_spec`` returns None, as for a
package that is missing (a finder that raised instead would break code probing with find_spec)."""
import sys

BLOCKED = ("hydra", "omegaconf", "antlr4", "wandb")


class _Hiding:
    """One of sys.meta_path's finders, blind to the blocked packages."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, name):   # the rest of the finder's interface (invalidate_caches, ...)
        return getattr(self.finder, name)


sys.meta_path[:] = [_Hiding(f) for f in sys.meta_path]
