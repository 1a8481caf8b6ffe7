"""The README and the guides under docs/ cannot rot: their ```python blocks run, the DeepSpeed key
table is regenerated from the code and compared, and the site builds in strict mode."""
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _docs_runner import blocks  # noqa: E402

PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
RUNNABLE = [p for p in PAGES if blocks(p.read_text())]


def _env():
    return child_env(8, NO_MKDOCS_2_WARNING="1")


@pytest.fixture(scope="module")
def snippet_results():
    """Every page's blocks, one fresh process for all of them (JAX starts once), one
    namespace and working directory per page."""
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "_docs_runner.py"), *map(str, RUNNABLE)],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith('{"file"'):
            row = json.loads(line)
            results[row["file"]] = row
    if not results:
        pytest.fail(f"the docs runner reported nothing:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return results, out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE])
def test_python_blocks_run(page, snippet_results):
    results, stderr = snippet_results
    row = results.get(str(page))
    assert row is not None, f"{page} did not finish (an earlier page may have crashed the process):\n{stderr[-3000:]}"
    assert row["ok"], f"{page.relative_to(ROOT)}: a ```python block failed:\n{row['error']}"


FEATURE_GUIDES = ("stages.md", "precision.md", "offload.md", "zenflow.md", "zeropp.md", "deepspeed.md",
                  "checkpoints.md", "tools.md", "multihost.md")


def test_every_guide_has_a_runnable_block():
    """Each feature guide carries a snippet that runs (every page's blocks run, whatever its name)."""
    missing = [name for name in FEATURE_GUIDES if not blocks((DOCS / name).read_text())]
    assert not missing, f"guides without a ```python block: {missing}"
    assert blocks((ROOT / "README.md").read_text()), "the README's example must be a ```python block"


def test_block_extraction_takes_python_only():
    text = "```python\na = 1\n```\n\n```py\nb = 2\n```\n```bash\nc\n```\n```python\nd = 4\n```\n"
    assert blocks(text) == ["a = 1\n", "d = 4\n"]


def test_runner_reports_a_failing_block(tmp_path):
    """The snippet test bites: a page whose block raises is reported failed, with the page named."""
    page = tmp_path / "bad.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'x is not 2'\n```\n")
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "_docs_runner.py"), str(page)], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=120)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert not row["ok"] and "x is not 2" in row["error"] and "python block 2" in row["error"]


def test_deepspeed_key_table_is_generated_from_the_code():
    spec = importlib.util.spec_from_file_location("gen_deepspeed_keys", DOCS / "gen_deepspeed_keys.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.render()
    assert (DOCS / "deepspeed-keys.md").read_text() == text, \
        "docs/deepspeed-keys.md is out of date: run python docs/gen_deepspeed_keys.py"
    from zerojax.config import _keys as keys
    for table in (keys.TOP, keys.ZERO, keys.OFFLOAD_OPTIMIZER, keys.OFFLOAD_PARAM, keys.ZENFLOW, keys.FP16, keys.BF16,
                  keys.ACTIVATION_CHECKPOINTING):
        missing = [k for k in table if f"| `{k}` |" not in text]
        assert not missing, f"keys missing from the generated table: {missing}"


def test_readme_is_short_and_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    import re
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_docs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "stages" / "index.html").exists()
