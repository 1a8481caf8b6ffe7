"""``python -m zerojax.tools.autotune``: see :mod:`zerojax.tools.autotune.cli`."""
import sys

from zerojax.tools.autotune.cli import main

sys.exit(main())
