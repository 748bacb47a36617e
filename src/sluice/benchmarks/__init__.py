"""Benchmarks that ship with the package, so an installed sluice can measure its own claims.

Each benchmark is a module with a `run(args) -> dict` (plain JSON-able result, environment
included) and a `print_tables(result)`; `sluice bench <name>` (cli/bench.py) and the thin
scripts in bench/ both call them. Speed is recorded in docs/benchmarks.md, never asserted in tests.
"""
