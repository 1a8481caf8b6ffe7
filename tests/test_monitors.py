"""DeepSpeed's monitors (zerojax.monitor): what the files hold equals what the step returned.

The CSV files, the TensorBoard event file and the wandb offline run are each read back with a
reader of the format (the TFRecord framing tensorboardX writes, checked with its CRC; the
record log wandb writes, decoded with wandb's own protobufs), not with zerojax code. The comms
and FLOPs reports are compared with zj.comm_report and XLA's cost analysis of the same step.
"""
from __future__ import annotations

import csv
import glob
import importlib
import json
import os
import struct
import time

import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from tests.helpers import batches, init_params, loss_fn, run_benchmark
from zerojax._compat import cost_analysis
from zerojax.config._deepspeed import key_report
from zerojax._errors import ConfigError
from zerojax.monitor import (
    CommsLogger,
    CSVMonitor,
    FlopsProfiler,
    MonitoredStep,
    Monitors,
    TensorBoardMonitor,
    WandbMonitor,
)

TB = 16  # train_batch_size: 8 devices x 2


def params():
    """The tiny model's params as host arrays (zj.initialize then compiles no init function)."""
    return jax.tree_util.tree_map(np.asarray, init_params(jax.random.PRNGKey(0)))


def ds_config(out, **extra):
    return {"train_batch_size": TB, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 4}},
            "fp16": {"enabled": True, "initial_scale_power": 4},
            "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": "csv_job"},
            "tensorboard": {"enabled": True, "output_path": str(out), "job_name": "tb_job"}, **extra}


# --------------------------------------------------------------------------- readers of the formats
def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(s), float(v)) for s, v in rows[1:]]


def tensorboard_scalars(log_dir):
    """{tag: [(step, value)]} from the event files of ``log_dir`` (TFRecord: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    out = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        data, pos = open(path, "rb").read(), 0
        while pos < len(data):
            header = data[pos:pos + 8]
            (n,) = struct.unpack("Q", header)
            assert struct.unpack("I", data[pos + 8:pos + 12])[0] == masked_crc32c(header)
            body = data[pos + 12:pos + 12 + n]
            assert struct.unpack("I", data[pos + 12 + n:pos + 16 + n])[0] == masked_crc32c(body)
            pos += 16 + n
            event = event_pb2.Event.FromString(body)
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def wandb_history(run_file, block=32768):
    """The history rows of a wandb run file: a record log (":W&B" header, then blocks of
    records, each crc32 / length / type) of wandb's Record protobufs. wandb's own process
    writes the file, and may still be writing it (or not yet have begun) after ``finish``
    returns: this waits (up to a minute) for the run's exit record."""
    for _ in range(600):
        rows, ended = _wandb_records(run_file, block)
        if ended:
            return rows
        time.sleep(0.1)
    raise AssertionError(f"{run_file} has no exit record")


def _wandb_records(run_file, block):
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(run_file, "rb").read()
    if len(data) < 7:  # wandb's process has created the file but not yet written its header
        return [], False
    assert data[:4] == b":W&B"
    pos, chunks, rows = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        chunks += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record.FromString(chunks)
            chunks = b""
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
            elif kind == "exit":
                return rows, True
    return rows, False


def run_steps(step, state, n=6):
    metrics = []
    for b in batches(n, TB):
        state, m = step(state, b)
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics


# --------------------------------------------------------------------------- the writers
@pytest.mark.slow  # wandb starts its own process; about 30 s on a loaded 2-core machine
def test_initialize_writes_csv_tensorboard_and_wandb_as_the_step_returned(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    cfg = ds_config(tmp_path, wandb={"enabled": True, "project": "zj-test", "group": "g"})
    state, step = zj.initialize(params(), loss_fn, cfg)
    assert isinstance(step.step, MonitoredStep)
    loss_csv = tmp_path / "csv_job" / "Train_Samples_train_loss.csv"
    metrics = []
    for b in batches(6, TB):
        state, m = step(state, b)
        metrics.append({key: float(x) for key, x in m.items()})
    state = step.finish(state)  # waits until every step is written
    assert len(read_csv(loss_csv)[1]) == 6
    step.close()
    losses = [m["loss"] for m in metrics]
    samples = [TB * (k + 1) for k in range(6)]
    assert len(set(losses)) == 6

    # CSV: DeepSpeed's file names and header, one row per step, in order (close wrote nothing twice)
    header, rows = read_csv(loss_csv)
    assert header == ["step", "train_loss"] and rows == list(zip(samples, losses))
    assert read_csv(tmp_path / "csv_job" / "Train_Samples_lr.csv")[1] == [
        (s, m["learning_rate"]) for s, m in zip(samples, metrics)]
    assert read_csv(tmp_path / "csv_job" / "Train_Samples_loss_scale.csv")[1] == [
        (s, m["loss_scale"]) for s, m in zip(samples, metrics)]
    assert len({m["learning_rate"] for m in metrics}) > 1  # warmup: the rows are per step, not one value

    # TensorBoard: the scalars, keyed by samples seen (stored as float32)
    scalars = tensorboard_scalars(tmp_path / "tb_job")
    assert scalars["Train/Samples/train_loss"] == [(s, np.float32(x)) for s, x in zip(samples, losses)]
    assert [v for _, v in scalars["Train/Samples/lr"]] == [np.float32(m["learning_rate"]) for m in metrics]

    # wandb offline: the run's history, the same rows at the same steps
    (run_file,) = glob.glob(str(tmp_path / "wandb_dir" / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = wandb_history(run_file)
    assert [h["_step"] for h in history] == samples
    assert [h["Train/Samples/train_loss"] for h in history] == losses
    assert [h["Train/Samples/loss_scale"] for h in history] == [m["loss_scale"] for m in metrics]


@pytest.mark.parametrize("path", ["nvme", "zenflow"])
def test_monitors_from_python_on_the_host_paths(tmp_path, path):
    """The wrapper works on every path alike; here the host loop of offload_optimizer='nvme' and ZenFlow."""
    config = zj.ZeroConfig(stage=1, offload_optimizer="nvme", nvme_path=str(tmp_path), sub_group_size=100) \
        if path == "nvme" else zj.ZeroConfig(stage=2, offload_optimizer="cpu", zenflow={"update_interval": 2})
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)  # the host update reads its settings
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), tx, config=config)
    lines = []
    monitors = Monitors(csv=CSVMonitor(str(tmp_path), "py"), steps_per_print=2, print_fn=lines.append)
    with zj.make_train_step(loss_fn, state, monitors=monitors) as step:
        assert isinstance(step, MonitoredStep) and isinstance(step, zj.Step)
        _, metrics = run_steps(step, state, 4)
    losses = [m["loss"] for m in metrics]
    assert read_csv(tmp_path / "py" / "Train_Samples_train_loss.csv")[1] == [(TB * (k + 1), x)
                                                                               for k, x in enumerate(losses)]
    assert [p.split(",")[0] for p in lines] == ["step=2", "step=4"]


def test_progress_lines_and_wall_clock_breakdown(tmp_path):
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), optax.sgd(1e-2), config=zj.ZeroConfig(stage=1))
    lines = []
    monitors = Monitors(csv=CSVMonitor(str(tmp_path), "t"), wall_clock_breakdown=True, steps_per_print=2,
                        print_fn=lines.append)
    with zj.make_train_step(loss_fn, state, monitors=monitors) as step:
        assert isinstance(step, MonitoredStep) and isinstance(step, zj.Step)
        _, metrics = run_steps(step, state, 4)
    progress = [line for line in lines if line.startswith("step=")]
    assert [p.split(",")[0] for p in progress] == ["step=2", "step=4"]
    assert f"loss={metrics[3]['loss']:.4f}" in progress[1] and "skipped=0" in progress[1]
    assert f"lr=[{metrics[3]['learning_rate']}]" in progress[1]
    times = [line for line in lines if line.startswith("time (ms) | train_batch: ")]
    assert len(times) == 4
    batch_ms = [float(t.split("train_batch: ")[1].split(" |")[0]) for t in times]
    dispatch_ms = [float(t.split("dispatch: ")[1]) for t in times]
    assert all(0 < d <= b for d, b in zip(dispatch_ms, batch_ms))
    rows = read_csv(tmp_path / "t" / "Train_Samples_elapsed_time_ms_train_batch.csv")[1]
    assert [round(v, 2) for _, v in rows] == batch_ms
    assert read_csv(tmp_path / "t" / "Train_Samples_train_loss.csv")[1] == [(TB * (k + 1), m["loss"])
                                                                           for k, m in enumerate(metrics)]


def test_the_caller_never_waits_on_the_writers_and_their_errors_reach_it(tmp_path):
    """A slow writer runs beside the steps; an error in it is raised by the next call."""
    import threading

    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), optax.sgd(1e-2), config=zj.ZeroConfig(stage=0))
    step = zj.make_train_step(loss_fn, state, monitors=Monitors(csv=CSVMonitor(str(tmp_path), "slow")))
    gate, written = threading.Event(), []

    class Slow:
        def write(self, events):
            gate.wait(30)
            written.append(events)

        def close(self):
            pass

    step.writers.append(Slow())
    state, _ = run_steps(step, state, 3)  # returns although no step's metrics could be written yet
    assert written == []
    gate.set()
    state = step.finish(state)
    assert [e[0][2] for e in written] == [TB, 2 * TB, 3 * TB]

    class Broken(Slow):
        def write(self, events):
            raise OSError("disk full")

    step.writers.append(Broken())
    state, _ = run_steps(step, state, 1)
    with pytest.raises(OSError, match="disk full"):
        step.finish(state)
    step.close()


# --------------------------------------------------------------------------- comms and FLOPs
def test_comms_logger_and_flops_profiler_equal_comm_report_and_cost_analysis(tmp_path):
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), optax.sgd(1e-2), config=zj.ZeroConfig(stage=2))
    inner = zj.make_train_step(loss_fn, state, donate=False)
    data = batches(3, TB)
    want_comm = zj.comm_report(inner, state, data[0])
    want_cost = cost_analysis(inner.lower(state, data[0]).compile())
    lines = []
    monitors = Monitors(comms_logger=CommsLogger(verbose=True), flops_profiler=FlopsProfiler(profile_step=1),
                        print_fn=lines.append)
    step = MonitoredStep(inner, monitors)
    for b in data:
        state, _ = step(state, b)
    step.close()
    assert step.comms.kinds == want_comm.kinds and want_comm.count("reduce-scatter") >= 1
    assert str(want_comm) in lines[0]
    f = step.flops
    assert f.step_index == 1 and f.flops == want_cost["flops"] > 0
    assert f.bytes_accessed == want_cost["bytes accessed"]
    assert f.flops_per_second == pytest.approx(f.flops / f.seconds) and 0 < f.seconds < 60
    assert f.params == sum(x.size for x in jax.tree_util.tree_leaves(init_params(jax.random.PRNGKey(0))))
    assert any("Profile Summary at step 1:" in line for line in lines)

    # prof_ops keeps only the named collectives; not verbose: printed once, at close
    lines.clear()
    only = Monitors(comms_logger=CommsLogger(prof_all=False, prof_ops=["reduce_scatter_tensor"]),
                    print_fn=lines.append)
    step = MonitoredStep(inner, only)
    step(state, data[0])
    assert lines == []
    step.close()
    (text,) = lines
    assert "reduce-scatter" in text and "all-gather" not in text


def test_flops_profiler_output_file(tmp_path):
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), optax.sgd(1e-2), config=zj.ZeroConfig(stage=0))
    out = tmp_path / "flops.txt"
    step = zj.make_train_step(loss_fn, state, monitors=Monitors(flops_profiler=FlopsProfiler(0, str(out))))
    run_steps(step, state, 1)
    step.close()
    assert "flops per device (fwd + bwd + update):" in out.read_text()


# --------------------------------------------------------------------------- the DeepSpeed keys
def test_monitor_keys_are_honoured_in_config_check(tmp_path):
    rows = {r.path: r for r in key_report(ds_config(tmp_path, steps_per_print=5, wall_clock_breakdown=True,
                                                    wandb={"enabled": False, "team": "t"},
                                                    comms_logger={"enabled": True, "verbose": True},
                                                    flops_profiler={"enabled": True, "profile_step": 2}),
                                          world_size=8)}
    for key in ("steps_per_print", "wall_clock_breakdown", "csv_monitor.enabled", "csv_monitor.output_path",
                "tensorboard.job_name", "wandb.team", "comms_logger.verbose", "flops_profiler.profile_step"):
        assert rows[key].kind == "honoured", rows[key]
    m = Monitors.from_deepspeed(ds_config(tmp_path, steps_per_print=5, flops_profiler={"enabled": True}))
    assert m.csv == CSVMonitor(str(tmp_path), "csv_job")
    assert m.tensorboard == TensorBoardMonitor(str(tmp_path), "tb_job")
    assert m.steps_per_print == 5 and m.flops_profiler == FlopsProfiler(1) and m.wandb is None


@pytest.mark.parametrize("cfg, match", [
    ({"comet": {"enabled": True, "project": "p"}}, "zerojax has no Comet monitor"),
    ({"tensorboard": {"enabled": True, "output_dir": "x"}}, 'Unknown key "tensorboard.output_dir".*"output_path"'),
    ({"csv_monitor": {"enabled": "yes"}}, "csv_monitor.enabled='yes' is invalid"),
    ({"steps_per_print": 0}, "steps_per_print=0 is invalid"),
    ({"comms_logger": {"enabled": True, "prof_ops": "all_reduce"}}, "comms_logger.prof_ops"),
])
def test_bad_monitor_keys_are_refused_by_name(cfg, match):
    with pytest.raises(ConfigError, match=match):
        zj.ZeroConfig.from_deepspeed({"train_batch_size": TB, **cfg}, world_size=8)
    with pytest.raises(ConfigError, match=match):
        Monitors.from_deepspeed(cfg)


def test_comet_off_is_fine_and_monitors_given_twice_are_refused(tmp_path):
    assert not Monitors.from_deepspeed({"comet": {"enabled": False}}).active
    with pytest.raises(ConfigError, match="monitors= was passed and the DeepSpeed config"):
        zj.initialize(params(), loss_fn, ds_config(tmp_path), monitors=Monitors(steps_per_print=1))
    with pytest.raises(ConfigError, match="prof_ops"):
        CommsLogger(prof_all=False, prof_ops=("allreduce",))


@pytest.mark.parametrize("block, module, extra", [("tensorboard", "tensorboardX", "tensorboard"),
                                                  ("wandb", "wandb", "wandb")])
def test_a_missing_package_is_a_config_error_naming_the_extra(tmp_path, monkeypatch, block, module, extra):
    real = importlib.import_module

    def fake(name, *a, **kw):
        if name == module:
            raise ImportError(f"No module named {module!r}")
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib, "import_module", fake)
    cfg = ds_config(tmp_path, **{block: {"enabled": True}})
    with pytest.raises(ConfigError, match=rf"needs the {module} package.*pip install 'zerojax\[{extra}\]'"):
        zj.initialize(params(), loss_fn, cfg)  # before the state is built
    assert not (tmp_path / "csv_job").exists()  # nothing opened


def test_nothing_on_returns_the_step_itself():
    state = zj.shard_train_state(init_params(jax.random.PRNGKey(0)), optax.sgd(1e-2), config=zj.ZeroConfig(stage=0))
    assert not isinstance(zj.make_train_step(loss_fn, state, monitors=Monitors()), MonitoredStep)
    assert Monitors.from_deepspeed({"tensorboard": {"enabled": False}, "wall_clock_breakdown": False}) == Monitors()
    with pytest.raises(ConfigError, match="Monitors.csv"):
        Monitors(csv="runs")
    assert WandbMonitor().project == "deepspeed"


def test_the_docs_snippets_run():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "monitors.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "docs/monitors.md", "exec"), {"__name__": "__docs__"})


@pytest.mark.slow  # compiles a small GPT twice over, with wandb's process: about 9 s alone
def test_benchmark_smoke_prints_the_ratio_and_the_costs():
    out = run_benchmark("monitors.py", "--smoke")  # with the suite's compile flags
    assert "monitors on / off: " in out and "caller us/step" in out and "writer cpu us" in out
