"""ZeRO data parallelism (stages 0-3) with Adam/AdamW over flat fp32 partitions."""

from .groups import GroupPlan, Slice
from .loss_scale import DynamicLossScaler, LossScaleConfig
from .optimizer import STATE_KEYS, ZeroOptimizer
from .stage3 import ParamGatherer

__all__ = ["GroupPlan", "Slice", "DynamicLossScaler", "LossScaleConfig", "STATE_KEYS", "ZeroOptimizer", "ParamGatherer"]
