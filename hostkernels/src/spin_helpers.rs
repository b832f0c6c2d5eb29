//! Helper threads that join work cut into pieces on one of XLA's threads (the host BLAS's
//! one-thread pieces), and stay awake for a moment after each job.
//!
//! Why: a piece handed to XLA's own pool starts when one of its threads wakes, which on this
//! kind of machine (a VM whose idle vCPUs halt) took 55-80 us per product: a third of a
//! 32-row product of a 768-wide layer. PyTorch's OpenMP workers spin for a while after each
//! parallel region, so its next product starts at once. The helpers do the same, briefly and
//! politely: they poll for the next job for [`spin`] after their last one (yielding the core
//! to any other runnable thread every few polls), then sleep until a job is posted.
//!
//! A posted job is only help: its owner works on it too and never waits for a helper that has
//! not started (see [`super::host_blas`]'s claim counters), so a helper that arrives late finds
//! nothing left and goes back to waiting.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Work the helpers may join: `work` runs what is left of it, if anything, on the calling
/// thread.
pub(crate) trait Work: Send + Sync {
    fn work(&self);
}

struct Board {
    /// The latest job (None: none posted yet, or retracted).
    job: Option<Arc<dyn Work>>,
    sleeping: usize,
}

struct Helpers {
    board: Mutex<Board>,
    /// The helper threads, joined by [`stop`].
    handles: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The latest job's number (0: none posted yet): written only under the board's lock, read
    /// without it by spinning helpers.
    posted: AtomicU64,
    wake: Condvar,
}

static HELPERS: OnceLock<Option<&'static Helpers>> = OnceLock::new();

/// Set in a child forked after the helpers started: the helpers did not follow it, and the
/// board's lock may have been held by one of them at the fork.
static FORKED: AtomicBool = AtomicBool::new(false);

/// Set by [`stop`]: the helpers leave their loop, and no job is posted for them any more.
static STOPPED: AtomicBool = AtomicBool::new(false);

extern "C" fn forked_child() {
    FORKED.store(true, Ordering::Relaxed);
}

impl Helpers {
    fn board(&self) -> MutexGuard<'_, Board> {
        self.board.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// How long a helper polls for the next job after its last one before it sleeps, unless
/// [`set_spin`] changed it.
// 1 ms: a sleeping pool thread started a block 55-80 us late (docs/host-kernels.md, "Host BLAS").
pub const SPIN: Duration = Duration::from_micros(1000);

static SPIN_NANOS: AtomicU64 = AtomicU64::new(SPIN.as_nanos() as u64);

fn spin() -> Duration {
    Duration::from_nanos(SPIN_NANOS.load(Ordering::Relaxed))
}

/// Sets how long helpers poll for the next job before they sleep, for this process.
pub fn set_spin(spin: Duration) {
    let nanos = u64::try_from(spin.as_nanos()).unwrap_or(u64::MAX);
    SPIN_NANOS.store(nanos, Ordering::Relaxed);
}

/// The helpers, `count` of them, started on first use (none where threads cannot be made).
fn helpers(count: usize) -> Option<&'static Helpers> {
    *HELPERS.get_or_init(|| {
        if count == 0 {
            return None;
        }
        let helpers: &'static Helpers = Box::leak(Box::new(Helpers {
            board: Mutex::new(Board {
                job: None,
                sleeping: 0,
            }),
            posted: AtomicU64::new(0),
            wake: Condvar::new(),
            handles: Mutex::new(Vec::new()),
        }));
        // SAFETY: registers a handler that only stores to an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
        let mut started = 0;
        for i in 0..count {
            let spawned = std::thread::Builder::new()
                .name(format!("tpuc-gemm-{i}"))
                .spawn(move || run(helpers));
            match spawned {
                Ok(handle) => {
                    started += 1;
                    helpers
                        .handles
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(handle);
                }
                Err(e) => tracing::debug!("host BLAS helper thread not started: {e}"),
            }
        }
        (started > 0).then_some(helpers)
    })
}

/// A helper's life: run each job posted, poll for the next one for [`spin`], else sleep.
fn run(helpers: &'static Helpers) {
    let mut seen = 0u64;
    let mut last_job = Instant::now();
    let mut polls = 0u32;
    loop {
        if STOPPED.load(Ordering::Acquire) {
            return;
        }
        let posted = helpers.posted.load(Ordering::Acquire);
        if posted != seen {
            seen = posted;
            let job = helpers.board().job.clone();
            if let Some(job) = job {
                job.work();
            }
            last_job = Instant::now();
            continue;
        }
        polls = polls.wrapping_add(1);
        if !polls.is_multiple_of(32) {
            std::hint::spin_loop();
            continue;
        }
        if last_job.elapsed() < spin() {
            std::thread::yield_now();
            continue;
        }
        let mut board = helpers.board();
        board.sleeping += 1;
        while helpers.posted.load(Ordering::Acquire) == seen && !STOPPED.load(Ordering::Acquire) {
            board = helpers.wake.wait(board).unwrap_or_else(|p| p.into_inner());
        }
        board.sleeping -= 1;
    }
}

/// Whether `TPUC_DEBUG=serial` asks for every job to run on the thread that posts it (read once
/// per process): a result that differs between runs with helpers and never without them points
/// at a race, one that differs without them too at a numeric difference. The pieces are the
/// same either way (only who runs them changes), so the numbers are too.
pub(crate) fn serial() -> bool {
    static SERIAL: OnceLock<bool> = OnceLock::new();
    *SERIAL.get_or_init(|| tpuc_runtime::env::debug_flag("serial"))
}

/// Posts `job` for the helpers (one per thread beyond the caller's, for `threads` threads) to
/// join; returns its number for [`retract`], or None where there are no helpers (none could
/// start, this process is a fork of the one they run in, [`stop`] ran, or `TPUC_DEBUG=serial`).
pub(crate) fn post(job: Arc<dyn Work>, threads: usize) -> Option<u64> {
    if FORKED.load(Ordering::Relaxed) || STOPPED.load(Ordering::Acquire) || serial() {
        return None;
    }
    let helpers = helpers(threads.saturating_sub(1))?;
    let mut board = helpers.board();
    let number = helpers.posted.load(Ordering::Relaxed) + 1;
    board.job = Some(job);
    helpers.posted.store(number, Ordering::Release);
    let wake = board.sleeping > 0;
    drop(board);
    if wake {
        helpers.wake.notify_all();
    }
    Some(number)
}

/// Drops the board's reference to job `number` once its owner is done with it (a later job
/// may have replaced it already).
pub(crate) fn retract(number: u64) {
    if FORKED.load(Ordering::Relaxed) {
        return;
    }
    if let Some(Some(helpers)) = HELPERS.get() {
        let mut board = helpers.board();
        if helpers.posted.load(Ordering::Relaxed) == number {
            board.job = None;
        }
    }
}

/// What [`stop`] did: helper threads joined, and those still running at its deadline (left to
/// end with the process).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stopped {
    pub joined: usize,
    pub left: usize,
}

/// Stops the helpers for the rest of the process (at interpreter exit): each leaves its loop
/// after the piece it is running, and is joined if it has ended within `timeout`, so this never
/// waits longer. Jobs are no longer posted: their owners run every piece themselves.
pub fn stop(timeout: Duration) -> Stopped {
    STOPPED.store(true, Ordering::Release);
    let Some(Some(helpers)) = HELPERS.get() else {
        return Stopped::default();
    };
    if FORKED.load(Ordering::Relaxed) {
        return Stopped::default(); // a fork's helpers did not follow it
    }
    // Taking the board's lock orders the store above before a helper's check under it.
    drop(helpers.board());
    helpers.wake.notify_all();
    let deadline = Instant::now() + timeout;
    let handles = std::mem::take(&mut *helpers.handles.lock().unwrap_or_else(|p| p.into_inner()));
    let mut stopped = Stopped::default();
    for handle in handles {
        while !handle.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        if handle.is_finished() {
            let _ = handle.join();
            stopped.joined += 1;
        } else {
            stopped.left += 1;
        }
    }
    stopped
}

/// The CPUs this process may use, read once: std's `available_parallelism` asks the kernel for
/// the affinity and reads the cgroup quota files on every call, and this is asked per call of a
/// host kernel.
pub(crate) fn cpus() -> i64 {
    static CPUS: OnceLock<i64> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()) as i64)
}

/// Spins (yielding now and then) until `done` reaches `total`: the end of work whose every
/// claimed part is running on some thread.
pub(crate) fn wait_until_done(done: &AtomicI64, total: i64) {
    let mut polls = 0u32;
    while done.load(Ordering::Acquire) < total {
        polls = polls.wrapping_add(1);
        if polls.is_multiple_of(64) {
            std::thread::yield_now();
        }
        std::hint::spin_loop();
    }
}

/// `total` units of work, claimed one at a time by the threads that run them.
struct Units<F> {
    run: F,
    total: i64,
    next: AtomicI64,
    done: AtomicI64,
}

impl<F: Fn(i64) + Send + Sync> Work for Units<F> {
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::AcqRel);
            if i >= self.total {
                return;
            }
            (self.run)(i);
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// Runs `run(i)` for every `i` in `0..total`, each once, on this thread and on the helpers
/// (`threads` threads in all), and returns when all have run. Without helpers (none could
/// start, or a forked child) this thread runs them all.
pub(crate) fn run_units(total: i64, threads: usize, run: impl Fn(i64) + Send + Sync + 'static) {
    let units = Arc::new(Units {
        run,
        total,
        next: AtomicI64::new(0),
        done: AtomicI64::new(0),
    });
    let posted = if total > 1 && threads > 1 {
        post(units.clone(), threads)
    } else {
        None
    };
    units.work();
    // Units other threads claimed are running now (a helper that has not started claims
    // nothing, so this never waits for one).
    wait_until_done(&units.done, total);
    if let Some(number) = posted {
        retract(number);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Units claimed one at a time, each counted by the thread that ran it.
    struct Units {
        next: AtomicI64,
        done: AtomicI64,
        total: i64,
        runs: Vec<AtomicUsize>,
        by_helpers: AtomicUsize,
        owner: std::thread::ThreadId,
    }

    impl Work for Units {
        fn work(&self) {
            loop {
                let i = self.next.fetch_add(1, Ordering::AcqRel);
                if i >= self.total {
                    return;
                }
                let t = Instant::now();
                while t.elapsed() < Duration::from_micros(20) {
                    std::hint::spin_loop();
                }
                self.runs[i as usize].fetch_add(1, Ordering::Relaxed);
                if std::thread::current().id() != self.owner {
                    self.by_helpers.fetch_add(1, Ordering::Relaxed);
                }
                self.done.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    #[test]
    fn helpers_join_posted_work_and_every_unit_runs_once() {
        let mut helped = 0;
        for _ in 0..50 {
            let units = Arc::new(Units {
                next: AtomicI64::new(0),
                done: AtomicI64::new(0),
                total: 32,
                runs: (0..32).map(|_| AtomicUsize::new(0)).collect(),
                by_helpers: AtomicUsize::new(0),
                owner: std::thread::current().id(),
            });
            let number = post(units.clone(), 2).expect("a helper thread starts");
            units.work();
            while units.done.load(Ordering::Acquire) < units.total {
                std::hint::spin_loop();
            }
            retract(number);
            assert!(units.runs.iter().all(|r| r.load(Ordering::Relaxed) == 1));
            helped += units.by_helpers.load(Ordering::Relaxed);
        }
        assert!(helped > 0, "no unit ran on a helper in 50 jobs");
    }

    #[test]
    fn run_units_runs_every_unit_once_and_returns_after_the_last() {
        for total in [0i64, 1, 2, 37] {
            let runs: Arc<Vec<AtomicUsize>> =
                Arc::new((0..total).map(|_| AtomicUsize::new(0)).collect());
            let seen = runs.clone();
            run_units(total, 2, move |i| {
                let t = Instant::now();
                while t.elapsed() < Duration::from_micros(10) {
                    std::hint::spin_loop();
                }
                seen[i as usize].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                runs.iter().all(|r| r.load(Ordering::Relaxed) == 1),
                "total {total}"
            );
        }
    }
}
