"""Precision policies (conf/precision): fp32, bf16, fp16 with dynamic loss scaling."""
from framework.precision.policies import Policy, PrecisionState, ScalerConfig, next_scale

__all__ = ["Policy", "PrecisionState", "ScalerConfig", "next_scale"]
