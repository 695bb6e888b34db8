"""``python -m tdz_numba.bench``."""

from . import main

raise SystemExit(main(prog="python -m tdz_numba.bench"))
