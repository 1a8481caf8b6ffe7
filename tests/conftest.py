"""Every test runs on 8 simulated CPU devices (set before jax is first imported).

Within one run, compiled programs are kept in JAX's persistent compilation cache, in a
temporary directory removed at the end: many tests build the same step for the same model and
config, and the subprocesses the suite starts (benchmark smoke runs, multi-process workers,
the docs snippets) inherit the directory through the environment. ZEROJAX_TEST_JIT_CACHE=0
turns it off; a directory given in JAX_COMPILATION_CACHE_DIR is used and kept.
"""
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_OWN_CACHE = None
if os.environ.get("ZEROJAX_TEST_JIT_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="zerojax-test-jit-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    # every program is worth keeping: the suite's programs are small and compile in well under a second
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
