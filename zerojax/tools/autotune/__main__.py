"""``python -m zerojax.tools.autotune``: see :mod:`zerojax.tools.autotune._cli`."""
import sys

from zerojax.tools.autotune._cli import main

sys.exit(main())
