# The two commands of the README: `make run` (set up, run the main example) and `make test`
# (set up, run every test and lint). Both are idempotent.
.PHONY: setup run test test-rust test-python lint bench

setup:
	./scripts/setup.sh

run: setup
	.venv/bin/python examples/compile_models.py

test: setup lint test-rust test-python

test-rust:
	cargo test --workspace -q

test-python:
	.venv/bin/python -m pytest -q tests

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -q -- -D warnings
	.venv/bin/ruff check python tests examples bench
	.venv/bin/ruff format --check python tests examples bench

bench: setup
	.venv/bin/python bench/bench_models.py
