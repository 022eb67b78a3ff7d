"""DuckDB as the audit's indexer, readers and exports load it: the engine alone.

`import duckdb` runs the package's Python layer before anything can be asked: its version read
through `importlib.metadata` and the relational and expression APIs, about 0.2 s of a fresh
process here (half of what `stockade audit sql` or a point query from a new process costs), for
none of which the audit has a use. All it calls (`connect`, the connection and its cursor,
`Error`, `StatementType`) is the engine's extension module, which the package re-exports as it
is: `duckdb.connect is _duckdb.connect`. DuckDB 1.4 and later ship that module at the top level
as `_duckdb`; an older DuckDB without it is loaded as a whole package, as before.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["load_duckdb"]


def load_duckdb() -> ModuleType:
    """The DuckDB engine module (see the module docstring); raises ImportError without DuckDB."""
    try:
        return importlib.import_module("_duckdb")
    except ImportError:
        return importlib.import_module("duckdb")
