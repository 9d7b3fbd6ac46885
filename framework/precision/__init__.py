"""Precision policies (conf/precision): fp32, bf16, fp16 with dynamic loss scaling."""
from framework.precision.policies import DTYPES, Policy, PrecisionState, ScalerConfig, next_scale, scale_power

__all__ = ["DTYPES", "Policy", "PrecisionState", "ScalerConfig", "next_scale", "scale_power"]
