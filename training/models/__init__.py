"""Reference models shared by UCP's tests, benchmarks and peer harnesses."""

from training.models.gpt import (
    GPT,
    PRESETS,
    GPTConfig,
    batch_for_step,
    expected_param_shapes,
    rows_for_step,
)

__all__ = ["GPT", "GPTConfig", "PRESETS", "batch_for_step", "expected_param_shapes", "rows_for_step"]
