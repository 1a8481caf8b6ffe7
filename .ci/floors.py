"""Print pip constraints that pin every dependency of pyproject.toml to its declared lower bound.

CI installs its oldest environment with these (``pip install -c``), so the bounds pyproject.toml
declares are the versions that environment tests. Usage: ``python .ci/floors.py [EXTRA ...]``:
the core dependencies and those of the named extras (e.g. ``test``).
"""
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# a dependency whose floor pins a companion package to the same version
COMPANIONS = {"jax": ("jaxlib",)}


def floors(extras):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in extras:
        specs += project["optional-dependencies"][extra]
    pins = {}
    for spec in specs:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(>=|==)\s*([^,;\s]+)\s*", spec)
        if match is None:
            sys.exit(f".ci/floors.py: {spec!r} in pyproject.toml has no single lower bound (>= or ==)")
        name, _, op, version = match.groups()
        version = version.rstrip(".*")
        pins[name.lower()] = version
        for companion in COMPANIONS.get(name.lower(), ()):
            pins[companion] = version
    return pins


if __name__ == "__main__":
    for name, version in sorted(floors(sys.argv[1:]).items()):
        print(f"{name}=={version}")
