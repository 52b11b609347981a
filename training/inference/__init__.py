"""Offloaded inference: run a model larger than memory by streaming its weights from disk, layer by layer.

Modules, one concern each: ``sources`` (where each tensor's bytes lie: safetensors directories, UCP
checkpoints), ``layout`` (a group's tensors in a ring buffer), ``executor`` (the ring, the reader
thread, the budget), ``model`` / ``llama`` / ``gpt`` (the models' arithmetic), ``generate`` (prefill,
decode, sampling), ``metrics`` (what a run reports), ``tokens`` and ``api`` (:func:`infer`).
"""
