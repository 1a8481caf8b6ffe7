"""``python -m zerojax ...`` is the ``zerojax`` command (for an environment whose scripts are
not on the PATH):

    python -m zerojax launch --nproc 2 --devices-per-proc 4 train.py --steps 100
    python -m zerojax config check ds_config.json
"""
import sys

from zerojax._cli import main

if __name__ == "__main__":
    sys.exit(main())
