"""tools/bench_offload.py's own logic: the /proc parsers, the worker protocol, the arguments, and the offload
keys it gives both engines (no timings)."""

from __future__ import annotations

import io
import json

import pytest

from tools.bench_offload import ds_offload, hidden, parse, proc_io, proc_status, serve
from training.offload import OffloadConfig

STATUS = "Name:\tpython\nVmPeak:\t  900 kB\nVmLck:\t      12 kB\nVmHWM:\t  123456 kB\nVmRSS:\t  100 kB\n"
IO = "rchar: 10\nwchar: 20\nsyscr: 1\nsyscw: 2\nread_bytes: 4096\nwrite_bytes: 8192\ncancelled_write_bytes: 0\n"


def test_proc_status_reads_peak_rss_and_locked_bytes() -> None:
    assert proc_status(STATUS) == {"hwm": 123456 * 1024, "locked": 12 * 1024}
    with pytest.raises(ValueError, match="VmHWM in 'MB'"):
        proc_status("VmHWM:\t 1 MB\n")


def test_proc_io_reads_device_bytes_and_names_a_missing_field() -> None:
    assert proc_io(IO) == (4096, 8192)
    with pytest.raises(ValueError, match="no write_bytes field"):
        proc_io("read_bytes: 1\n")


def test_serve_answers_each_turn_with_its_losses_and_times_only_the_last_step() -> None:
    done: list[str] = []

    def step(s: int) -> float:
        done.append(f"step {s}")
        return float(s) / 2

    inp = io.StringIO(json.dumps({"steps": [4, 5]}) + "\n\n" + json.dumps({"steps": [6]}) + "\n")
    out = io.StringIO()
    serve(step, lambda: done.append("drain"), lambda: {"seconds": 1.0}, {"state_bytes": 7}, inp=inp, out=out)
    ready, first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert ready == {"ready": {"state_bytes": 7}}
    assert first["losses"] == [2.0, 2.5] and second["losses"] == [3.0]
    assert first["parts"] == {"seconds": 1.0} and first["seconds"] >= 0 and first["hwm"] > 0
    assert {"read_bytes", "written_bytes", "locked"} <= first.keys()
    assert done == ["step 4", "step 5", "drain", "step 6", "drain"]  # the I/O is waited for after the timed step


def test_arguments_refuse_an_unknown_method_and_parse_the_budget(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["--nvme-path", "/tmp", "--swap-budget", "1GiB", "--methods", "nvme,deepspeed-nvme"])
    assert args.swap_budget == 1 << 30 and args.method_list == ["nvme", "deepspeed-nvme"]
    with pytest.raises(SystemExit):
        parse(["--nvme-path", "/tmp", "--methods", "nvme,zero-infinity"])
    assert "unknown method(s) ['zero-infinity']" in capsys.readouterr().err


def test_both_engines_get_the_same_deepspeed_keys_and_ours_parse_them() -> None:
    args = parse(["--nvme-path", "/tmp", "--sub-group-size", "1000", "--buffer-count", "16"])
    nvme = ds_offload("nvme", args, "/tmp")
    assert nvme["offload_optimizer"] == {
        "device": "nvme", "pin_memory": True, "nvme_path": "/tmp", "buffer_count": 16,
        "pipeline_read": True, "pipeline_write": True,
    }  # fmt: skip
    serial = OffloadConfig.from_deepspeed(ds_offload("nvme-serial", args, "/tmp"), swap_budget=1 << 20)
    assert serial.offload_optimizer.device == "nvme" and not serial.offload_optimizer.pipeline_read
    assert serial.sub_group_size == 1000 and serial.offload_optimizer.buffer_count == 16
    assert "offload_optimizer" not in ds_offload("memory", args, "/tmp")
    assert OffloadConfig.from_deepspeed(ds_offload("cpu", args, "/tmp")).offload_optimizer.device == "cpu"


def test_the_parameter_method_gives_both_engines_the_same_offload_param_keys() -> None:
    args = parse(["--nvme-path", "/tmp", "--param-buffer-count", "7", "--param-buffer-size", "4096"])
    zero = ds_offload("nvme-param", args, "/tmp")
    want = {"device": "nvme", "nvme_path": "/tmp", "pin_memory": True, "buffer_count": 7, "buffer_size": 4096}
    assert zero["offload_param"] == want | {"max_in_cpu": 0}  # on NVMe in both engines, not kept in host memory
    ours = OffloadConfig.from_deepspeed(zero).offload_param
    assert (ours.device, ours.buffer_count, ours.buffer_size, ours.max_in_cpu) == ("nvme", 7, 4096, 0)
    assert zero["offload_optimizer"]["device"] == "nvme" and "offload_param" not in ds_offload("nvme", args, "/x")
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    theirs = config.DeepSpeedZeroConfig(**zero).offload_param
    assert (theirs.buffer_count, theirs.buffer_size, theirs.max_in_cpu) == (7, 4096, 0)


def test_hidden_is_the_share_of_io_time_nobody_waited_for() -> None:
    assert hidden({"io_read": 1.0, "io_write": 1.0, "read_wait": 0.5, "write_wait": 0.0}) == 0.75
    assert hidden({"io_read": 0.0, "io_write": 0.0}) is None
