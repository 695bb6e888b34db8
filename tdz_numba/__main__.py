"""``python -m tdz_numba``: the ``tdz`` command line (see :mod:`tdz_numba.cli`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
