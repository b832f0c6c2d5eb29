//! Interpreter exit: what tpuc does so that its threads never abort the process at exit.
//!
//! CPython 3.11 ends a thread that asks for the GIL once the interpreter is finalizing (after the
//! atexit hooks) with `pthread_exit`, and the final garbage collection hands the GIL around (torch
//! releases it to free every tensor it clears), so a thread blocked on the GIL then gets it and is
//! unwound. The forced unwind aborts the process when it crosses a frame that cannot be unwound:
//! pyo3's `catch_unwind` in every method of this extension ("FATAL: exception not rethrown"), a
//! C++ `noexcept` frame ("terminate called without an active exception"). Every place where tpuc
//! releases the GIL is such a thread's way back, so tpuc releases it only through [`detach`]:
//! once [`begin_exit`] ran (tpuc's atexit hook, while the interpreter is still whole), a thread
//! other than the exiting one never takes the GIL back inside tpuc; it parks, without the GIL,
//! until the process is gone (what CPython 3.14 does to such threads itself).
//! docs/reliability-and-testing.md ("A clean exit") has the whole shutdown order.

use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Set by [`begin_exit`]: the interpreter is exiting.
static EXITING: AtomicBool = AtomicBool::new(false);
/// Threads inside a GIL-released section of tpuc (see [`detach`]).
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// The thread that runs the interpreter's exit (the one that called [`begin_exit`]).
static EXIT_THREAD: OnceLock<std::thread::ThreadId> = OnceLock::new();
/// Threads parked for good by [`detach`] after the exit began.
static PARKED: AtomicUsize = AtomicUsize::new(0);
/// The runtimes (`Runtime` objects), kept from [`begin_exit`] on: their PJRT clients (and XLA's
/// threads) are deliberately never destroyed, rather than destroyed at whatever point the
/// interpreter's final collection happens to free the last object that holds one (a static is
/// never dropped, so neither is a runtime it holds).
static KEPT: Mutex<Vec<Py<PyAny>>> = Mutex::new(Vec::new());

fn exiting_elsewhere() -> bool {
    EXITING.load(Ordering::SeqCst) && EXIT_THREAD.get() != Some(&std::thread::current().id())
}

/// Parks the calling thread (which holds no GIL) until the process ends.
fn park_for_good() -> ! {
    PARKED.fetch_add(1, Ordering::SeqCst);
    tracing::debug!("a thread left in tpuc at interpreter exit is parked until the process ends");
    loop {
        std::thread::park();
    }
}

/// `py.detach(f)` (runs `f` without the GIL), except that once the interpreter is exiting, a
/// thread other than the exiting one never takes the GIL back: one that arrives after
/// [`begin_exit`] parks before running `f`, one that was inside parks after it (see the module
/// docs). The exiting thread itself runs as always.
pub(crate) fn detach<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    // Counted before EXITING is read (both SeqCst): either `begin_exit` sees this thread in
    // flight and waits for it, or this thread sees EXITING.
    IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
    py.detach(|| {
        if exiting_elsewhere() {
            IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
            park_for_good();
        }
        let result = f();
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
        if exiting_elsewhere() {
            park_for_good();
        }
        result
    })
}

/// Begins tpuc's part of the interpreter's exit (called once, by tpuc's atexit hook): marks the
/// exit, waits up to `timeout` seconds (without the GIL) for the other threads inside tpuc to
/// reach their park, stops and joins the host kernels' helper threads, and keeps the runtimes'
/// PJRT clients for the rest of the process. Never waits longer than `timeout` in all.
/// Returns `{"waited_s", "in_flight", "parked", "helpers_joined", "helpers_left", "runtimes_kept"}`.
#[pyfunction]
#[pyo3(signature = (runtimes, timeout=10.0))]
pub(crate) fn begin_exit(
    py: Python<'_>,
    runtimes: Vec<Py<PyAny>>,
    timeout: f64,
) -> PyResult<Vec<(&'static str, f64)>> {
    let _ = EXIT_THREAD.set(std::thread::current().id());
    EXITING.store(true, Ordering::SeqCst);
    KEPT.lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(runtimes);
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
    let (in_flight, helpers) = py.detach(|| {
        while IN_FLIGHT.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let in_flight = IN_FLIGHT.load(Ordering::SeqCst);
        let left = deadline.saturating_duration_since(Instant::now());
        (in_flight, tpuc_hostkernels::spin_helpers::stop(left))
    });
    if in_flight > 0 {
        tracing::warn!("{in_flight} thread(s) still running in tpuc at interpreter exit");
    }
    let kept = KEPT.lock().unwrap_or_else(|p| p.into_inner()).len();
    Ok(vec![
        ("waited_s", start.elapsed().as_secs_f64()),
        ("in_flight", in_flight as f64),
        ("parked", PARKED.load(Ordering::SeqCst) as f64),
        ("helpers_joined", helpers.joined as f64),
        ("helpers_left", helpers.left as f64),
        ("runtimes_kept", kept as f64),
    ])
}

/// Whether [`begin_exit`] ran in this process.
#[pyfunction]
pub(crate) fn exiting() -> bool {
    EXITING.load(Ordering::SeqCst)
}
