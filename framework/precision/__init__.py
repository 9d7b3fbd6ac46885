"""Precision policies (conf/precision): fp32, bf16, fp16 with dynamic loss scaling. ``check_entry`` refuses a
config without a ``grad_accum_dtype`` field (the config checks and a DeepSpeed file's data_types read it)."""
import dataclasses

from framework.core.errors import ConfigError
from framework.precision.policies import DTYPES, Policy, PrecisionState, ScalerConfig, next_scale, scale_power

__all__ = ["DTYPES", "Policy", "PrecisionState", "ScalerConfig", "next_scale", "scale_power"]


def check_entry(module_name: str, name: str, component) -> None:
    """What training reads of every precision's config: ``grad_accum_dtype``, the dtype micro-batch gradients are
    summed in (its name, as in ``DTYPES``)."""
    config = component.config
    if not dataclasses.is_dataclass(config) or \
            "grad_accum_dtype" not in {f.name for f in dataclasses.fields(config)}:
        raise ConfigError(f"precision {name!r} ({module_name}): its config {config.__name__} has no field "
                          f"grad_accum_dtype (the dtype micro-batch gradients are summed in, read from every "
                          f"precision's config); add grad_accum_dtype: str = \"fp32\" to it (its YAML file may set it)")
