"""The slow-tier table in tests/conftest.py: a dict literal keeps only the last of two entries of
one name, so a name written twice (with two different reasons or kept cases) is refused here."""
import ast
import collections
import pathlib

CONFTEST = pathlib.Path(__file__).resolve().parent / "conftest.py"


def slow_keys(source: str) -> list:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SLOW" for t in node.targets):
            return [ast.literal_eval(k) for k in node.value.keys]
    raise AssertionError("no SLOW table in tests/conftest.py")


def repeated(keys) -> list:
    return sorted(k for k, n in collections.Counter(keys).items() if n > 1)


def test_every_slow_entry_is_named_once():
    assert repeated(slow_keys(CONFTEST.read_text())) == []


def test_the_check_sees_a_name_written_twice():
    source = 'SLOW = {"tests/a.py::test_x": "1 s", "tests/b.py::test_y": "2 s", "tests/a.py::test_x": "3 s"}'
    assert repeated(slow_keys(source)) == ["tests/a.py::test_x"]
