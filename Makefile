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

# The tests of what differs on a device with memory of its own (uploads, copies back, resident
# copies), run again with the CPU plugin treated as one (TPUC_DEBUG=discrete_device): those marked
# `discrete_device` in these files (numerics, errors and compile paths the mode does not touch run
# once, in the first pass).
DISCRETE_TESTS = tests/test_params.py tests/test_hot_path.py tests/test_sharding.py \
	tests/test_distributed.py tests/test_models.py tests/test_buckets.py tests/test_saved.py \
	tests/test_ties.py tests/test_fallback_partitions.py tests/test_edge_inputs.py \
	tests/test_handoff.py tests/test_input_views.py tests/test_donation.py

# pytest-xdist workers for the first pass: one process alone leaves much of a second core idle
# (Dynamo's tracing is Python, and many tests wait on child processes); two keep a 2-core machine
# busy. The second pass is short and led by two-process tests: workers gain it nothing (measured).
PYTEST_WORKERS = 2

# The families that matter on the TPU road (buckets, mutations, ties, input views, models,
# training), run once more compiled for a TPU slice and run through its CPU stand-in (`pytest
# --stand-in`, tests/conftest.py: docs/tpu-target.md): those marked `stand_in` in these files.
# Regions and saved files on the target road are tests/test_regions.py's and
# tests/test_target_road.py's own (first pass). Needs libtpu (scripts/setup.sh installs it).
STAND_IN_TESTS = tests/test_buckets.py tests/test_mutations.py tests/test_ties.py \
	tests/test_input_views.py tests/test_models.py tests/test_training_step.py

test-python:
	.venv/bin/python -m pytest -q -n $(PYTEST_WORKERS) tests
	TPUC_DEBUG=discrete_device .venv/bin/python -m pytest -q -m discrete_device $(DISCRETE_TESTS)
	.venv/bin/python -m pytest -q --stand-in -m stand_in $(STAND_IN_TESTS)

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -q -- -D warnings
	.venv/bin/ruff check python tests examples bench
	.venv/bin/ruff format --check python tests examples bench

bench: setup
	.venv/bin/python bench/bench_models.py
