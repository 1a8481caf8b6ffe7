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


# --------------------------------------------------------------------------- the two tiers
# `pytest -m "not slow"` is the quick tier. A test is slow when it is marked in its file or listed
# here (file::name, every parametrisation of it), with the seconds it took on a loaded 2-core
# machine. The quick tier keeps at least one test of every file, so every feature is still touched.
SLOW = {
}


def pytest_collection_modifyitems(config, items):
    import pytest

    seen = set()
    for item in items:
        name = item.nodeid.split("[", 1)[0]
        if name in SLOW:
            item.add_marker(pytest.mark.slow)
            seen.add(name)
    collected_files = {item.nodeid.split("::", 1)[0] for item in items}
    whole_files = not any("::" in str(a) for a in config.args)
    stale = [n for n in SLOW if whole_files and n.split("::", 1)[0] in collected_files and n not in seen]
    if stale:  # a renamed or deleted test would silently leave the slow tier
        raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {stale}")
