"""Subprocess entry points and factories for tests/test_cache.py and bench/bench_cache.py."""
