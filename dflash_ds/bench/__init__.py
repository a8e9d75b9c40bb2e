"""Benchmarks behind `dflash-ds bench NAME`: each prints a table, or one JSON object with --json."""
