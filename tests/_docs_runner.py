"""Run the ```python blocks of markdown files, each file's blocks in order in one namespace.

    python tests/_docs_runner.py README.md docs/stages.md ...

Prints one JSON line per file: {"file", "ok", "seconds", "error"}. The caller sets XLA_FLAGS
(8 simulated devices). Each file runs in a fresh temporary working directory, so a block may
write files; blocks opened with ```py (or any other language) are shown, not run.
"""
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
import traceback

BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def blocks(text: str) -> list:
    return [m.group(1) for m in BLOCK.finditer(text)]


def run_file(path: str) -> dict:
    with open(path) as f:
        code = blocks(f.read())
    start, error = time.perf_counter(), None
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        namespace = {"__name__": "__docs__"}
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # stdout carries the JSON lines
                for i, source in enumerate(code):
                    exec(compile(source, f"{path} (python block {i + 1})", "exec"), namespace)
        except BaseException:  # noqa: BLE001 - reported to the test, which fails
            error = traceback.format_exc()[-4000:]
        finally:
            os.chdir(here)
    return {"file": path, "ok": error is None, "blocks": len(code), "seconds": time.perf_counter() - start,
            "error": error}


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(json.dumps(run_file(p)), flush=True)
