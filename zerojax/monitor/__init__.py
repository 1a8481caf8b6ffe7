"""DeepSpeed's monitors: CSV, TensorBoard, Weights & Biases, progress lines, step timings, the
comms logger and the FLOPs profiler, around any step.

    import zerojax as zj
    from zerojax.monitor import CSVMonitor, Monitors

    step = zj.make_train_step(loss_fn, state, monitors=Monitors(csv=CSVMonitor("runs", "exp1"),
                                                                steps_per_print=10))
    state, step = zj.initialize(init_fn, loss_fn, "ds_config.json")   # the file's monitor blocks

See docs/monitors.md.
"""
from zerojax.monitor._config import CommsLogger as CommsLogger
from zerojax.monitor._config import CSVMonitor as CSVMonitor
from zerojax.monitor._config import FlopsProfiler as FlopsProfiler
from zerojax.monitor._config import Monitors as Monitors
from zerojax.monitor._config import TensorBoardMonitor as TensorBoardMonitor
from zerojax.monitor._config import WandbMonitor as WandbMonitor
from zerojax.monitor._config import monitors_for as monitors_for
from zerojax.monitor._reports import FlopsProfile as FlopsProfile
from zerojax.monitor._reports import comms_summary as comms_summary
from zerojax.monitor._step import MonitoredStep as MonitoredStep
from zerojax.monitor._step import monitored as monitored

__all__ = ["CSVMonitor", "CommsLogger", "FlopsProfile", "FlopsProfiler", "MonitoredStep", "Monitors",
           "TensorBoardMonitor", "WandbMonitor", "comms_summary", "monitored", "monitors_for"]
