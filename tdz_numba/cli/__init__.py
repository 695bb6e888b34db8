"""The ``tdz`` command line (:func:`main`), the data behind info/tree/show, the demo and warm-up."""

from .command import main

__all__ = ["main"]
