"""Benchmarks behind ``ucp bench``: library code the CLI and tools/ call.

``ucp.bench.io`` compares UCP's aio engines with the device limit (fio or dd),
torch.save/torch.load and safetensors. Import the submodules directly; this
package imports nothing heavy on purpose, so ``ucp --help`` stays fast.
"""
