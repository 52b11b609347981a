"""Tensor and pipeline parallelism for the reference GPT."""

from .gpt import ParallelGPT, build_stage, fill_from_global
from .pipeline import SCHEDULES, gpipe, one_f_one_b
from .tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    copy_to_tp,
    reduce_from_tp,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ParallelGPT",
    "build_stage",
    "fill_from_global",
    "SCHEDULES",
    "gpipe",
    "one_f_one_b",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "copy_to_tp",
    "reduce_from_tp",
    "vocab_parallel_cross_entropy",
]
