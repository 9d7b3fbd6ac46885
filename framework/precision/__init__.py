"""Precision policies (conf/precision): fp32, bf16, fp16 with dynamic loss scaling. ``check_entry`` refuses a
config without a ``grad_accum_dtype`` field (the config checks and a DeepSpeed file's data_types read it)."""
from framework.core.registry import require_fields
from framework.precision.policies import DTYPES, Policy, PrecisionState, ScalerConfig, next_scale, scale_power

__all__ = ["DTYPES", "Policy", "PrecisionState", "ScalerConfig", "next_scale", "scale_power"]


def check_entry(module_name: str, name: str, component) -> None:
    """What training reads of every precision's config: ``grad_accum_dtype``, the dtype micro-batch gradients are
    summed in (its name, as in ``DTYPES``)."""
    require_fields("precision", module_name, name, component.config,
                   (("grad_accum_dtype", 'grad_accum_dtype: str = "fp32"'),),
                   "the dtype micro-batch gradients are summed in, read from every precision's config")
