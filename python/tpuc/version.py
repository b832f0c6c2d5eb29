"""tpuc's version (python/pyproject.toml's), on its own so that modules that key caches with it
need not import the package's `__init__`, which imports them."""

__version__ = "0.1.0"
