#!/usr/bin/env bash
# Sanitized runs of the Rust core (slow; not part of `make test`).
#
#   scripts/sanitize.sh [FILTER...]   the PJRT FFI layer (the runtime crate) under Valgrind memcheck:
#                                     builds the runtime crate's unit-test binary and runs its PJRT
#                                     tests (default filter `tests`) against the real CPU plugin
#   scripts/sanitize.sh --threads     the host kernels' unit tests (helper threads handing pieces of
#                                     work over, the row kernels run by several threads) under
#                                     ThreadSanitizer (nightly with rust-src: `rustup component add
#                                     --toolchain nightly rust-src`; std is rebuilt instrumented)
#   scripts/sanitize.sh --miri        the unit tests of the crates without FFI (frontend_fx, passes,
#                                     cache) under Miri (needs `rustup component add --toolchain
#                                     nightly miri rust-src`)
#
# Exits non-zero on any Valgrind error (invalid read/write, use of uninitialised memory, bad free,
# definite leak) outside the suppressions in scripts/valgrind.supp, or any Miri finding.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--threads" ]]; then
    shift
    # A separate target directory: instrumented std and dependencies never mix with `make`'s.
    # halt_on_error: the first data race fails the run.
    export RUSTFLAGS="-Zsanitizer=thread" TSAN_OPTIONS="halt_on_error=1"
    exec cargo +nightly test -Zbuild-std --target x86_64-unknown-linux-gnu --target-dir target/tsan \
        -p tpuc_hostkernels --lib "$@"
fi

if [[ "${1:-}" == "--miri" ]]; then
    shift
    # Isolation off: the cache tests use the real file system and clock.
    export MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation}"
    # insta would run `cargo metadata` (a subprocess, which Miri cannot spawn) to find the root.
    export INSTA_WORKSPACE_ROOT="$PWD"
    exec cargo +nightly miri test --no-fail-fast -p tpuc_frontend_fx -p tpuc_passes -p tpuc_cache "$@"
fi

filters=("$@")
[[ ${#filters[@]} -eq 0 ]] && filters=(tests)

# The release profile, whose dependencies `make` has built already (reports name functions; for
# file and line, run with CARGO_PROFILE_RELEASE_DEBUG=line-tables-only, which rebuilds everything).
bin=$(cargo test --release -p tpuc_runtime --lib --no-run --message-format=json |
    jq -r 'select(.reason == "compiler-artifact" and .target.name == "tpuc_runtime"
                  and .profile.test and .executable != null) | .executable' | tail -n 1)
[[ -x "$bin" ]] || { echo "sanitize.sh: test binary not found" >&2; exit 2; }
echo "sanitize.sh: $bin ${filters[*]}" >&2

start=$(date +%s)
# --test-threads=1: one test at a time, so a report belongs to the test printed before it.
valgrind --tool=memcheck --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite \
    --show-leak-kinds=definite --num-callers=40 --suppressions=scripts/valgrind.supp \
    --gen-suppressions=all \
    "$bin" "${filters[@]}" --test-threads=1
echo "sanitize.sh: valgrind clean in $(($(date +%s) - start)) s" >&2
