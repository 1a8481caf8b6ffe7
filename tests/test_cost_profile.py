"""The cost profile the suite prints at its end (tests/_cost.py): it counts the programs a test
compiles, the subprocesses it starts, and marks what is over its limit."""
import textwrap

from tests._cost import FILE_LIMIT, TEST_LIMIT, CostProfile, report

pytest_plugins = ["pytester"]

INNER = textwrap.dedent("""
    import subprocess
    import sys

    import jax
    import jax.numpy as jnp

    def test_compiles():
        jax.jit(lambda x: jnp.sin(x) * 3.25 + 1)(jnp.arange(5.0)).block_until_ready()

    def test_plain_python():
        assert sorted([3, 1, 2]) == [1, 2, 3]

    def test_starts_a_process():
        subprocess.run([sys.executable, "-c", "pass"], check=True)
""")


def test_the_profile_counts_compiles_and_subprocesses_per_test(pytester):
    pytester.makepyfile(test_inner=INNER)
    plugin = CostProfile(budget={})
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[plugin])
    result.assert_outcomes(passed=3)
    records = plugin.records
    compiles, plain, process = (records[f"test_inner.py::{n}"]
                                for n in ("test_compiles", "test_plain_python", "test_starts_a_process"))
    assert compiles["programs"] >= 1 and compiles["compile_s"] > 0 and compiles["trace_s"] > 0
    assert plain["programs"] == 0 and plain["compile_s"] == 0 and plain["subprocesses"] == 0
    assert process["subprocesses"] == 1 and process["programs"] == 0
    # the table is printed at the end of the run, with the file's totals and the slowest tests
    out = result.stdout.str()
    assert "cost profile" in out and "ten slowest tests" in out
    file_row = next(line for line in out.splitlines() if line.endswith("  test_inner.py"))
    assert int(file_row.split()[1]) == 3  # three tests in the file
    # the listeners are gone after the inner run: another compile is not counted
    import jax
    jax.jit(lambda x: x - 7.5)(1.0)
    assert sum(r["programs"] for r in plugin.records.values()) == compiles["programs"]


def test_the_report_marks_files_and_tests_over_their_limit():
    def rec(seconds):
        return {"seconds": seconds, "programs": 2, "cache_hits": 0, "compile_s": 1.0, "trace_s": 0.5,
                "subprocesses": 0}

    records = {"tests/a.py::test_1": rec(FILE_LIMIT - 1), "tests/a.py::test_2": rec(2.0),  # a.py over 60 s
               "tests/b.py::test_1": rec(FILE_LIMIT + 5),  # over, but budgeted
               "tests/c.py::test_1": rec(TEST_LIMIT + 1)}  # one test over 20 s
    lines = report(records, budget={"tests/b.py": "why"})
    marked = [line for line in lines if "<< over" in line]
    assert len(marked) == 1 and "tests/a.py  <<" in marked[0]
    assert any("over budget: 1 file(s)" in line and "3 test(s)" in line for line in lines)
    assert any("tests/c.py::test_1" in line and "test over" in line for line in lines)
    assert not any("test over" in line and "tests/a.py::test_2" in line for line in lines)
