"""``ucp.save`` of a tensor subclass it does not store (a Partial DTensor, any other torch.Tensor subclass) raises an
UnsupportedStateError naming the key, before anything is written; nn.Parameter is saved as before."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ucp


class Tagged(torch.Tensor):
    """A user subclass, as quantization or tracing libraries make them."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_partial_dtensor_is_refused_naming_its_key(tmp_path: Path, one_process_group: None) -> None:
    """DTensors are saved (tests/ucp/test_fsdp_resume.py), but not Partial ones: their local values
    are unreduced partial sums, not the tensor's."""
    from torch.distributed.tensor import DeviceMesh, DTensor, Partial

    mesh = DeviceMesh("cpu", [0])
    dt = DTensor.from_local(torch.randn(4, 4), mesh, [Partial()])
    with pytest.raises(ucp.UnsupportedStateError) as info:
        ucp.save({"model": {"layer.weight": dt}}, tmp_path / "c")
    msg = str(info.value)
    assert "state_dict['model']['layer.weight']" in msg and "Partial(sum)" in msg and "redistribute" in msg
    assert ".numpy()" not in msg
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_a_tensor_subclass_is_refused_naming_its_key(tmp_path: Path) -> None:
    t = torch.arange(6.0).as_subclass(Tagged)
    with pytest.raises(ucp.UnsupportedStateError, match=r"state_dict\['opt'\]\[0\] \(tensor 'opt.0'\).*Tagged"):
        ucp.save({"opt": [t]}, tmp_path / "c")
    with ucp.AsyncSaver() as saver, pytest.raises(ucp.UnsupportedStateError, match=r"Tagged"):
        saver.save({"x": t}, tmp_path / "a").result()


def test_parameters_and_plain_tensors_still_save(tmp_path: Path) -> None:
    p = torch.nn.Parameter(torch.arange(4.0))
    ucp.save({"p": p, "t": torch.ones(2)}, tmp_path / "c")
    out = ucp.load(tmp_path / "c")
    assert type(out["p"]) is torch.Tensor and torch.equal(out["p"], torch.arange(4.0))
