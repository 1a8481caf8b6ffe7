"""The suite's cost profile, printed at the end of every run (a pytest plugin; tests/conftest.py
registers it).

For each test it records the wall seconds of its set-up, call and tear-down, the XLA programs it
compiled and the seconds XLA spent compiling them (JAX's backend-compile monitoring event; a
program read back from the persistent cache counts as a program and a cache hit), the seconds
spent tracing and lowering to MLIR, and the subprocesses it started. The end-of-run table sums
them per test file, lists the ten slowest tests, and marks any file over FILE_LIMIT seconds that
tests/conftest.py's BUDGET does not name, and any test over TEST_LIMIT seconds.

Under pytest-xdist every worker measures its own tests and hands its records to the controller,
which prints one table. ZEROJAX_TEST_PROFILE=path also writes the records as JSON.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import time

import pytest

from zerojax._compat import CACHE_HIT_EVENT, COMPILE_EVENT, TRACE_EVENTS

FILE_LIMIT = 60.0  # seconds a test file may take in the full run unless BUDGET names it
TEST_LIMIT = 20.0  # seconds one test (set-up, call and tear-down) may take

FIELDS = ("seconds", "programs", "cache_hits", "compile_s", "trace_s", "subprocesses")


class _Counters:
    """Running totals of the events this process has seen, read before and after each test."""

    def __init__(self):
        self.programs = 0
        self.cache_hits = 0
        self.compile_s = 0.0
        self.trace_s = 0.0
        self.subprocesses = 0

    def snapshot(self) -> tuple:
        return (self.programs, self.cache_hits, self.compile_s, self.trace_s, self.subprocesses)

    def on_duration(self, event, duration, **kwargs):
        if event == COMPILE_EVENT:
            self.programs += 1
            self.compile_s += duration
        elif event in TRACE_EVENTS:
            self.trace_s += duration

    def on_event(self, event, **kwargs):
        if event == CACHE_HIT_EVENT:
            self.cache_hits += 1


class CostProfile:
    """The plugin. ``budget`` maps a test file to the reason it may take over FILE_LIMIT seconds."""

    def __init__(self, budget: dict | None = None):
        self.config = None
        self.budget = dict(budget or {})
        self.records: dict[str, dict] = {}
        self.counters = _Counters()
        self._listening = False
        self._popen_init = None

    # ------------------------------------------------------------------ listening
    def _listen(self):
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self.counters.on_duration)
        jax.monitoring.register_event_listener(self.counters.on_event)
        counters, original = self.counters, subprocess.Popen.__init__

        def counting_init(popen, *args, **kwargs):
            counters.subprocesses += 1
            return original(popen, *args, **kwargs)

        subprocess.Popen.__init__ = counting_init
        self._popen_init = original
        self._listening = True

    def _stop(self):
        if not self._listening:
            return
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self.counters.on_duration)
        jax.monitoring.unregister_event_listener(self.counters.on_event)
        subprocess.Popen.__init__ = self._popen_init
        self._listening = False

    def pytest_configure(self, config):
        self.config = config

    def pytest_sessionstart(self, session):
        self._listen()

    def pytest_unconfigure(self, config):
        self._stop()

    # ------------------------------------------------------------------ measuring
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before, start = self.counters.snapshot(), time.perf_counter()
        yield
        after = self.counters.snapshot()
        record = {"seconds": time.perf_counter() - start}
        record.update({f: a - b for f, a, b in zip(FIELDS[1:], after, before)})
        self.records[item.nodeid] = record

    def pytest_sessionfinish(self, session):
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: the controller prints the table
            workeroutput["zerojax_cost"] = json.dumps(self.records)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        records = getattr(node, "workeroutput", {}).get("zerojax_cost")
        if records:
            self.records.update(json.loads(records))

    # ------------------------------------------------------------------ reporting
    def pytest_terminal_summary(self, terminalreporter):
        if getattr(self.config, "workeroutput", None) is not None or not self.records:
            return
        for line in report(self.records, self.budget):
            terminalreporter.write_line(line)
        path = os.environ.get("ZEROJAX_TEST_PROFILE")
        if path:
            with open(path, "w") as f:
                json.dump(self.records, f, indent=1, sort_keys=True)


def by_file(records: dict) -> dict:
    files: dict = collections.defaultdict(lambda: dict.fromkeys(("tests",) + FIELDS, 0))
    for nodeid, record in records.items():
        row = files[nodeid.split("::", 1)[0]]
        row["tests"] += 1
        for f in FIELDS:
            row[f] += record[f]
    return dict(files)


def report(records: dict, budget: dict) -> list[str]:
    """The end-of-run table: per file (slowest first), the totals, the ten slowest tests, and what
    is over its limit."""
    files = by_file(records)
    total = by_file({f"all::{k}": v for k, v in records.items()})["all"]
    lines = ["", "=" * 30 + " cost profile " + "=" * 30,
             f"{'seconds':>8} {'tests':>5} {'programs':>8} {'cached':>6} {'compile s':>9} {'trace s':>7} "
             f"{'subproc':>7}  file"]

    def row(r, name, mark=""):
        return (f"{r['seconds']:8.1f} {r['tests']:5d} {r['programs']:8d} {r['cache_hits']:6d} "
                f"{r['compile_s']:9.1f} {r['trace_s']:7.1f} {r['subprocesses']:7d}  {name}{mark}")

    over_files = []
    for name, r in sorted(files.items(), key=lambda kv: -kv[1]["seconds"]):
        over = r["seconds"] > FILE_LIMIT and name not in budget
        if over:
            over_files.append(name)
        lines.append(row(r, name, "  << over %d s, not in BUDGET" % FILE_LIMIT if over else ""))
    lines.append(row(total, "total"))
    slowest = sorted(records.items(), key=lambda kv: -kv[1]["seconds"])[:10]
    lines.append("ten slowest tests (seconds, programs compiled, subprocesses):")
    for nodeid, r in slowest:
        lines.append(f"{r['seconds']:8.1f} {r['programs']:8d} {r['subprocesses']:7d}  {nodeid}")
    over_tests = [n for n, r in records.items() if r["seconds"] > TEST_LIMIT]
    if over_files or over_tests:
        lines.append(f"over budget: {len(over_files)} file(s) over {FILE_LIMIT:.0f} s not in BUDGET, "
                     f"{len(over_tests)} test(s) over {TEST_LIMIT:.0f} s")
        lines.extend(f"  test over {TEST_LIMIT:.0f} s: {n} ({records[n]['seconds']:.1f} s)" for n in over_tests)
    return lines
