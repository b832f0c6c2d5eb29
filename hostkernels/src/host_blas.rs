//! f32 matrix products through the host's BLAS (the `sgemm_` PyTorch itself calls: MKL in
//! torch's x86 wheels), registered with a CPU plugin as XLA FFI custom calls.
//!
//! Unless `TPUC_HOST_KERNELS` turns `gemm` off, the compiler emits
//! `stablehlo.custom_call @tpuc_sgemm_<ta><tb>` (typed FFI, api_version 4) for large f32 products; XLA's CPU runtime
//! calls [`gemm`] with the operands' host memory. The targets must be registered in every
//! process before a module naming them is compiled or deserialized: [`register`] does it once
//! per plugin, through the plugin's PJRT FFI extension.
//!
//! The FFI plumbing (registration, call frames, errors) is [`super::xla_ffi`]'s.

use std::ffi::{c_char, c_int, c_void};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::spin_helpers::cpus;
use super::xla_ffi::{
    arg, destroy, error, open_frame_of, register_targets, ret, CallFrame, ErrorGetMessageArgs,
    FfiApi, FfiBuffer, Handler, DTYPE_F32,
};
use tpuc_runtime::PjrtError;
use tpuc_runtime::Plugin;

/// The custom-call targets, by whether A and B are stored transposed (`t`) or not (`n`):
/// A is `[.., M, K]` (`n`) or `[.., K, M]` (`t`), B is `[.., K, N]` or `[.., N, K]`; the result
/// is `[.., M, N]` row-major. A leading batch dim, if any, is the same on all three.
pub const TARGETS: [(&str, bool, bool); 4] = [
    ("tpuc_sgemm_nn", false, false),
    ("tpuc_sgemm_nt", false, true),
    ("tpuc_sgemm_tn", true, false),
    ("tpuc_sgemm_tt", true, true),
];

/// The target name for operands stored as given.
pub fn target(a_transposed: bool, b_transposed: bool) -> &'static str {
    TARGETS
        .iter()
        .find(|(_, ta, tb)| *ta == a_transposed && *tb == b_transposed)
        .map(|(name, _, _)| *name)
        .expect("all four combinations are listed")
}

/// Fortran `sgemm_` (LP64: 32-bit integers, every argument by reference).
type Sgemm = unsafe extern "C" fn(
    transa: *const c_char,
    transb: *const c_char,
    m: *const c_int,
    n: *const c_int,
    k: *const c_int,
    alpha: *const f32,
    a: *const f32,
    lda: *const c_int,
    b: *const f32,
    ldb: *const c_int,
    beta: *const f32,
    c: *mut f32,
    ldc: *const c_int,
) -> ();

/// MKL's per-thread thread count (`MKL_Set_Num_Threads_Local`, the C entry point: the lowercase
/// name is the Fortran one, whose argument is a pointer); returns the previous value.
type SetLocalThreads = unsafe extern "C" fn(c_int) -> c_int;

/// MKL's packed-operand API (`cblas_sgemm_pack_get_size`, `cblas_sgemm_pack`,
/// `cblas_sgemm_compute`; LP64, CBLAS enums as `c_int`).
type PackGetSize = unsafe extern "C" fn(identifier: c_int, m: c_int, n: c_int, k: c_int) -> usize;
type Pack = unsafe extern "C" fn(
    layout: c_int,
    identifier: c_int,
    trans: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: f32,
    src: *const f32,
    ld: c_int,
    dest: *mut f32,
);
type Compute = unsafe extern "C" fn(
    layout: c_int,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: f32,
    c: *mut f32,
    ldc: c_int,
);

const CBLAS_ROW_MAJOR: c_int = 101;
const CBLAS_NO_TRANS: c_int = 111;
const CBLAS_TRANS: c_int = 112;
const CBLAS_PACKED: c_int = 151;
const CBLAS_B_MATRIX: c_int = 162;

struct PackedApi {
    get_size: PackGetSize,
    pack: Pack,
    compute: Compute,
}

struct Blas {
    sgemm: Sgemm,
    set_local_threads: SetLocalThreads,
    /// Absent from a BLAS without it: pieces then always take `sgemm_`.
    packed: Option<PackedApi>,
}

static BLAS: OnceLock<Blas> = OnceLock::new();

/// Finds `sgemm_` in `library` (already loaded by the process: PyTorch's own `libtorch_cpu.so`)
/// and registers the targets with `plugin`'s XLA. Idempotent per plugin. Returns whether the
/// targets are usable: false where the library has no `sgemm_` or the plugin no FFI extension.
pub fn register(plugin: &Plugin, library: &Path) -> Result<bool, PjrtError> {
    if BLAS.get().is_none() {
        let Some(b) = find_blas(library) else {
            return Ok(false);
        };
        let _ = BLAS.set(b);
    }
    let targets = TARGETS.map(|(name, ta, tb)| {
        let handler: Handler = match (ta, tb) {
            (false, false) => gemm::<false, false>,
            (false, true) => gemm::<false, true>,
            (true, false) => gemm::<true, false>,
            (true, true) => gemm::<true, true>,
        };
        (name, handler)
    });
    register_targets(plugin, &targets, "host BLAS sgemm")
}

/// MKL's `sgemm_` in `library`, if it is loaded and is MKL.
fn find_blas(library: &Path) -> Option<Blas> {
    // RTLD_NOLOAD: only a library the process has already loaded (PyTorch's), never a new one.
    // SAFETY: opening an already-loaded library runs no initializers.
    let lib = unsafe {
        libloading::os::unix::Library::open(Some(library), libc::RTLD_NOW | libc::RTLD_NOLOAD)
    }
    .ok()?;
    // SAFETY: both have these signatures in MKL's LP64 interface; the library stays loaded
    // (the handle is leaked, and PyTorch holds it anyway).
    let blas = unsafe {
        let sgemm = lib.get::<Sgemm>(b"sgemm_\0").ok().map(|s| *s);
        let threads = lib
            .get::<SetLocalThreads>(b"MKL_Set_Num_Threads_Local\0")
            .ok()
            .map(|s| *s);
        let packed = (|| {
            Some(PackedApi {
                get_size: *lib
                    .get::<PackGetSize>(b"cblas_sgemm_pack_get_size\0")
                    .ok()?,
                pack: *lib.get::<Pack>(b"cblas_sgemm_pack\0").ok()?,
                compute: *lib.get::<Compute>(b"cblas_sgemm_compute\0").ok()?,
            })
        })();
        sgemm.zip(threads).map(|(sgemm, set_local_threads)| Blas {
            sgemm,
            set_local_threads,
            packed,
        })
    };
    std::mem::forget(lib);
    blas
}

#[repr(C)]
struct ScheduleArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    ctx: *mut c_void,
    task: unsafe extern "C" fn(*mut c_void),
    data: *mut c_void,
}

type Schedule = unsafe extern "C" fn(*mut ScheduleArgs) -> *mut c_void;

/// `XLA_FFI_ThreadPool_Schedule` of `api`, once checked to be that function: code of a loaded
/// library which, called with an empty argument struct, refuses it naming its own argument
/// struct (every XLA FFI function checks the size first). Checked once per table.
fn xla_pool(api: *const FfiApi) -> Option<Schedule> {
    static CHECKED: Mutex<Vec<(usize, Option<usize>)>> = Mutex::new(Vec::new());
    let mut checked = CHECKED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, f)) = checked.iter().find(|(a, _)| *a == api as usize) {
        // SAFETY: stored below only after the check.
        return f.map(|f| unsafe { std::mem::transmute::<usize, Schedule>(f) });
    }
    let found = check_schedule(api);
    checked.push((api as usize, found.map(|f| f as usize)));
    found
}

fn check_schedule(api: *const FfiApi) -> Option<Schedule> {
    // SAFETY: `api` is XLA's table (from a call frame); the entry is read as an address, and
    // called only once it is known to be code of a loaded library.
    let f = unsafe { (*api).thread_pool_schedule };
    // SAFETY: `Dl_info` is plain pointers, valid all zero.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only looks the address up and fills `info`.
    if f.is_null() || unsafe { libc::dladdr(f, &mut info) } == 0 || info.dli_fbase.is_null() {
        return None;
    }
    // SAFETY: code of a loaded library, called as an XLA FFI function with a zero-size struct,
    // which it must refuse before reading anything else.
    let schedule: Schedule = unsafe { std::mem::transmute::<*const c_void, Schedule>(f) };
    let mut probe = ScheduleArgs {
        struct_size: 0,
        extension_start: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
        task: noop_task,
        data: std::ptr::null_mut(),
    };
    // SAFETY: as for the transmute: a zero-size struct, which XLA's size check refuses before
    // it reads any field; `probe` outlives the call.
    let err = unsafe { schedule(&mut probe) };
    if err.is_null() {
        return None;
    }
    // SAFETY: `err` is an XLA FFI error, read and destroyed through the same table.
    let text = unsafe {
        let mut get = ErrorGetMessageArgs {
            struct_size: std::mem::size_of::<ErrorGetMessageArgs>(),
            extension_start: std::ptr::null_mut(),
            error: err,
            message: std::ptr::null(),
        };
        ((*api).error_get_message)(&mut get);
        let text = if get.message.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(get.message)
                .to_string_lossy()
                .into_owned()
        };
        destroy(api, err);
        text
    };
    tracing::debug!("XLA FFI thread pool probe: {text}");
    text.contains("XLA_FFI_ThreadPool_Schedule_Args")
        .then_some(schedule)
}

unsafe extern "C" fn noop_task(_: *mut c_void) {}

/// A buffer's dims and data, after checking it is an f32 buffer of rank 2 or 3.
fn f32_matrix(b: &FfiBuffer) -> Option<(&[i64], *mut f32)> {
    (b.dtype == DTYPE_F32 && (2..=3).contains(&b.rank)).then(|| (b.dims(), b.data as *mut f32))
}

/// The handler: `C = op(A) @ op(B)` for row-major operands, each batch entry by one `sgemm_`.
///
/// # Safety
/// Called by XLA with a valid call frame.
unsafe extern "C" fn gemm<const TA: bool, const TB: bool>(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: the pointer XLA passed.
    let frame = match unsafe { open_frame_of(frame, "tpuc_sgemm", 2, 1) } {
        Ok(frame) => frame,
        Err(done) => return done,
    };
    // SAFETY: a checked frame of 2 operands and 1 result.
    let (a, b, c) = unsafe {
        (
            arg(frame, 0).and_then(f32_matrix),
            arg(frame, 1).and_then(f32_matrix),
            ret(frame, 0).and_then(f32_matrix),
        )
    };
    let (Some((ad, ap)), Some((bd, bp)), Some((cd, cp))) = (a, b, c) else {
        return error(frame, "tpuc_sgemm: operands must be f32 of rank 2 or 3");
    };
    let r = ad.len();
    if bd.len() != r || cd.len() != r || (r == 3 && (ad[0] != bd[0] || ad[0] != cd[0])) {
        return error(frame, "tpuc_sgemm: operand ranks or batch sizes differ");
    }
    let (a0, a1, b0, b1) = (ad[r - 2], ad[r - 1], bd[r - 2], bd[r - 1]);
    let (m, ka) = if TA { (a1, a0) } else { (a0, a1) };
    let (kb, n) = if TB { (b1, b0) } else { (b0, b1) };
    if ka != kb || cd[r - 2] != m || cd[r - 1] != n {
        return error(
            frame,
            "tpuc_sgemm: operand shapes do not multiply to the result's",
        );
    }
    let batch = if r == 3 { ad[0] } else { 1 };
    let fits = |x: i64| i32::try_from(x).is_ok();
    if ![m, n, ka, a0 * a1, b0 * b1].iter().all(|&x| fits(x)) {
        return error(frame, "tpuc_sgemm: dims exceed 32-bit BLAS");
    }
    let Some(blas) = BLAS.get() else {
        return error(frame, "tpuc_sgemm: no host BLAS in this process");
    };
    if m == 0 || n == 0 {
        return std::ptr::null_mut();
    }
    let product = Product {
        ta: TA,
        tb: TB,
        m,
        n,
        k: ka,
        a: ap,
        b: bp,
        c: cp,
    };
    if tpuc_runtime::executing_on_this_thread() && !always_pieces() {
        // The plugin runs the program on the thread that called execute: the BLAS's own
        // threading there is the one PyTorch's own products on this thread use.
        // SAFETY: the buffers hold `batch` products of the checked shapes.
        unsafe { product.run(blas, batch) };
        CALLS[0].fetch_add(1, Ordering::Relaxed);
        return std::ptr::null_mut();
    }
    CALLS[1].fetch_add(1, Ordering::Relaxed);
    // One of XLA's threads: one-thread pieces, on it and on XLA's own pool. (MKL's OpenMP
    // threading here would start a team whose idle threads spin for milliseconds after each
    // product, taking the cores the PyTorch work that follows needs.)
    let pieces = product.pieces(batch);
    let total = batch * pieces;
    let job = Arc::new(Pieces {
        product,
        batch,
        pieces,
        next: AtomicI64::new(0),
        done: AtomicI64::new(0),
    });
    // Help comes from the spinning helpers where there are any, else from XLA's pool; none with
    // `TPUC_DEBUG=serial`, where this thread runs every piece.
    let mut posted = None;
    if total > 1 && !super::spin_helpers::serial() {
        posted = super::spin_helpers::post(job.clone(), cpus() as usize);
        if posted.is_none() {
            schedule_pieces(frame, &job, total);
        }
    }
    job.work_with(blas);
    // The pieces other threads claimed are running now: wait for them (never for a task that
    // has not started, which may be queued behind this very thread).
    super::spin_helpers::wait_until_done(&job.done, total);
    if let Some(number) = posted {
        super::spin_helpers::retract(number);
    }
    std::ptr::null_mut()
}

/// Hands `total - 1` piece tasks of `job` (at most one per other thread) to XLA's pool.
fn schedule_pieces(frame: &CallFrame, job: &Arc<Pieces>, total: i64) {
    let Some(schedule) = xla_pool(frame.api) else {
        return;
    };
    for _ in 1..total.min(cpus()) {
        let data = Arc::into_raw(job.clone()) as *mut c_void;
        let mut args = ScheduleArgs {
            struct_size: std::mem::size_of::<ScheduleArgs>(),
            extension_start: std::ptr::null_mut(),
            ctx: frame.ctx,
            task: piece_task,
            data,
        };
        // SAFETY: checked to be XLA's ThreadPool_Schedule; the task owns `data`.
        let err = unsafe { schedule(&mut args) };
        if !err.is_null() {
            // Not scheduled: the task never runs, so its reference is dropped here (this
            // thread runs the pieces instead).
            // SAFETY: from `Arc::into_raw` just above, not handed over.
            drop(unsafe { Arc::from_raw(data as *const Pieces) });
            destroy(frame.api, err);
            break;
        }
    }
}

/// Products run on the thread that called execute (`[0]`) and in one-thread pieces (`[1]`);
/// pieces that packed B first (`[2]`, see [`Product::wants_packed_b`]).
static CALLS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// `(on the calling thread, in pieces, pieces with B packed)`: how many products ran each way
/// in this process.
pub fn calls() -> (u64, u64, u64) {
    (
        CALLS[0].load(Ordering::Relaxed),
        CALLS[1].load(Ordering::Relaxed),
        CALLS[2].load(Ordering::Relaxed),
    )
}

/// Test hook ([`set_always_pieces`]): products cut into one-thread pieces on the calling thread
/// too (the path of XLA's threads, which small test programs never take otherwise).
static ALWAYS_PIECES: AtomicBool = AtomicBool::new(false);

fn always_pieces() -> bool {
    ALWAYS_PIECES.load(Ordering::Relaxed)
}

/// Test hook: cut every product into one-thread pieces, on the calling thread too, from now on
/// in this process (`on`), or only on XLA's threads again.
pub fn set_always_pieces(on: bool) {
    ALWAYS_PIECES.store(on, Ordering::Relaxed);
}

/// A call's products cut into pieces, claimed one at a time by the threads that run them.
struct Pieces {
    product: Product,
    batch: i64,
    pieces: i64,
    next: AtomicI64,
    done: AtomicI64,
}

impl Pieces {
    /// Runs unclaimed pieces on this thread, each through a one-thread `sgemm_`, until none is
    /// left.
    fn work_with(&self, blas: &'static Blas) {
        // On the thread that called execute (only with [`set_always_pieces`]) MKL's setting
        // is restored after: PyTorch's own products there use its threads.
        let _one_thread = OneThreadBlas::with(blas);
        let total = self.batch * self.pieces;
        loop {
            let i = self.next.fetch_add(1, Ordering::AcqRel);
            if i >= total {
                return;
            }
            // SAFETY: the handler waits until every claimed piece is done, so the buffers live;
            // each piece writes its own part of the result.
            unsafe {
                self.product
                    .run_piece(blas, i / self.pieces, i % self.pieces, self.pieces)
            };
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// A piece task on XLA's pool: works on the pieces left, if any (it may start after the others
/// ran them all, and then only drops its reference).
unsafe extern "C" fn piece_task(data: *mut c_void) {
    // SAFETY: `data` is one `Arc::into_raw` reference, given to this task.
    let job = unsafe { Arc::from_raw(data as *const Pieces) };
    if let Some(blas) = BLAS.get() {
        job.work_with(blas);
    }
}

impl super::spin_helpers::Work for Pieces {
    fn work(&self) {
        if let Some(blas) = BLAS.get() {
            self.work_with(blas);
        }
    }
}

thread_local! {
    /// Whether MKL was told to use one thread on this (XLA) thread.
    static ONE_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Packed B of [`Product::run_packed_b`], kept for the thread's next product (MKL's packed
    /// form of a 768x1536 block takes 14 MB).
    static PACK_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// MKL computes with this thread alone from now on when called on it, one of XLA's (set once:
/// XLA's threads never call MKL otherwise).
fn one_thread_blas(blas: &Blas) {
    if !ONE_THREAD.with(|o| o.replace(true)) {
        // SAFETY: MKL's setting for the calling thread.
        unsafe { (blas.set_local_threads)(1) };
    }
}

/// MKL's `sgemm_` on this thread alone while it lives, for host kernels that run their own
/// products in one-thread units (see `super::host_attention`): on one of XLA's threads or a
/// helper the setting stays (nothing else calls MKL there); on the thread that called execute,
/// whose PyTorch products use MKL's threads, the setting before is restored on drop.
pub(crate) struct OneThreadBlas {
    blas: &'static Blas,
    restore: Option<c_int>,
}

impl OneThreadBlas {
    /// None where the process has no host BLAS.
    pub(crate) fn enter() -> Option<OneThreadBlas> {
        BLAS.get().map(OneThreadBlas::with)
    }

    fn with(blas: &'static Blas) -> OneThreadBlas {
        let restore = if tpuc_runtime::executing_on_this_thread() {
            // SAFETY: MKL's setting for the calling thread, restored on drop.
            Some(unsafe { (blas.set_local_threads)(1) })
        } else {
            one_thread_blas(blas);
            None
        };
        OneThreadBlas { blas, restore }
    }

    /// Row-major `C = alpha * A op(B)`: A `[m, k]` with rows `lda` apart, B `[k, n]` (or, where
    /// `b_transposed`, `[n, k]`) with rows `ldb` apart, C `[m, n]` with rows `ldc` apart.
    ///
    /// # Safety
    /// Every row of each matrix must lie inside a live buffer; `C` must not overlap A or B.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn product(
        &self,
        (m, n, k): (i64, i64, i64),
        alpha: f32,
        (a, lda): (*const f32, i64),
        (b, ldb, b_transposed): (*const f32, i64, bool),
        (c, ldc): (*mut f32, i64),
    ) {
        // Row-major C = A B is column-major C^T = B^T A^T: BLAS's first operand is B.
        let tb = if b_transposed { b'T' } else { b'N' } as c_char;
        let ta = b'N' as c_char;
        let (mi, ni, ki) = (m as c_int, n as c_int, k as c_int);
        let (lda, ldb, ldc) = (
            lda.max(1) as c_int,
            ldb.max(1) as c_int,
            ldc.max(1) as c_int,
        );
        let beta = 0.0f32;
        // SAFETY: the caller's contract.
        unsafe {
            (self.blas.sgemm)(
                &tb, &ta, &ni, &mi, &ki, &alpha, b, &ldb, a, &lda, &beta, c, &ldc,
            )
        };
    }
}

impl Drop for OneThreadBlas {
    fn drop(&mut self) {
        if let Some(before) = self.restore {
            // SAFETY: MKL's setting for the calling thread, as it was.
            unsafe { (self.blas.set_local_threads)(before) };
        }
    }
}

/// One call's products: row-major `C = op(A) op(B)` for each batch entry.
#[derive(Clone, Copy)]
struct Product {
    ta: bool,
    tb: bool,
    m: i64,
    n: i64,
    k: i64,
    a: *mut f32,
    b: *mut f32,
    c: *mut f32,
}

// SAFETY: the pointers are XLA's buffers for the duration of the call, which waits until the
// products are done, whichever thread runs them.
unsafe impl Send for Product {}
// SAFETY: see Send.
unsafe impl Sync for Product {}

/// Products of at least this many rows are cut into row blocks (see [`Product::by_rows`]).
const ROW_BLOCKS_MIN_ROWS: i64 = 512;
/// Column blocks are multiples of this many columns.
const COLUMN_BLOCK: i64 = 64;

/// Multiply-adds below which a product is not cut (a piece's fixed cost outweighs it).
const MIN_PIECE_MACS: i64 = 1 << 17;

impl Product {
    /// How many pieces each product is cut into: one per thread where the batch does not
    /// already give every thread work, fewer for small products.
    fn pieces(&self, batch: i64) -> i64 {
        let want = (cpus() + batch - 1) / batch;
        let by_work = self.m * self.n * self.k.max(1) / MIN_PIECE_MACS;
        let by_shape = if self.by_rows() {
            self.m / 16
        } else {
            self.n / COLUMN_BLOCK
        };
        want.min(by_work).min(by_shape).max(1)
    }

    /// Whether pieces are row blocks of C (each reading all of B, as MKL's packed kernels
    /// want) rather than column blocks (each reading a share of B: products of fewer rows,
    /// whose time is mostly B's packing and reading; one-thread MKL on half the columns of
    /// 128x768 @ 768x3072 takes 1.8 ms, on half the rows 2.0, XLA's dot 2.4 on both threads),
    /// or where there are too few columns to give every thread a block.
    fn by_rows(&self) -> bool {
        self.m >= ROW_BLOCKS_MIN_ROWS || self.n < COLUMN_BLOCK * cpus()
    }

    /// Piece `piece` of `pieces` of batch entry `entry`, through one `sgemm_`.
    ///
    /// # Safety
    /// The pointers must hold the call's checked shapes, alive until this returns.
    unsafe fn run_piece(&self, blas: &Blas, entry: i64, piece: i64, pieces: i64) {
        let Product { m, n, k, .. } = *self;
        let span = |extent: i64, align: i64| {
            let step = (extent / pieces + align - 1) / align * align;
            let lo = (piece * step).min(extent);
            let hi = if piece == pieces - 1 {
                extent
            } else {
                ((piece + 1) * step).min(extent)
            };
            (lo, hi)
        };
        // SAFETY: this offset and every one below lie inside entry `entry` of its buffer, by
        // the checked shapes.
        let (a, b, c) = unsafe {
            (
                self.a.add((entry * m * k) as usize),
                self.b.add((entry * k * n) as usize),
                self.c.add((entry * m * n) as usize),
            )
        };
        let piece = if self.by_rows() {
            // Rows lo..hi of op(A) and C: row offset in A stored [M, K], column offset in [K, M].
            let (lo, hi) = span(m, 8);
            Product {
                m: hi - lo,
                // SAFETY: rows lo..hi < m of this entry (see above).
                a: unsafe { a.add((if self.ta { lo } else { lo * k }) as usize) },
                // SAFETY: as for `a`.
                c: unsafe { c.add((lo * n) as usize) },
                b,
                ..*self
            }
        } else {
            // Columns lo..hi of op(B) and C: column offset in B stored [K, N], row offset in
            // [N, K].
            let (lo, hi) = span(n, COLUMN_BLOCK);
            Product {
                n: hi - lo,
                // SAFETY: columns lo..hi < n of this entry (see above).
                b: unsafe { b.add((if self.tb { lo * k } else { lo }) as usize) },
                // SAFETY: as for `b`.
                c: unsafe { c.add(lo as usize) },
                a,
                ..*self
            }
        };
        if piece.m > 0 && piece.n > 0 {
            // SAFETY: the piece's operands and result lie inside the call's buffers; the
            // leading dimensions are the whole matrices'.
            unsafe {
                match blas.packed.as_ref().filter(|_| piece.wants_packed_b(n)) {
                    Some(api) => piece.run_packed_b(api, (m, n)),
                    None => piece.run_with(blas, 1, (m, n)),
                }
            };
        }
    }

    /// Whether this one-thread piece runs faster with B packed first (MKL's
    /// `cblas_sgemm_pack` into a scratch buffer, then `cblas_sgemm_compute`) than through
    /// `sgemm_`, given the whole B's row length `cols`: for B stored `[K, N]` whose rows lie a
    /// multiple of 4 KB apart, one-thread `sgemm_` at about 80-176 rows reads B in place and
    /// its loads alias in the L1 cache. Measured (one thread, MKL 2024.2, AVX-512): GPT-2's
    /// 128x768 @ 768x1536 half of `c_fc` (rows 12 KB apart) 2.70 -> 2.11 ms with the packing
    /// in every call; 128x2048 @ 2048x1024 with rows 16 KB apart 5.5 -> 4.2 ms; rows 3 or 9 KB
    /// apart, 64 or 256+ rows, or B stored `[N, K]`: no gain or a few percent slower. Both
    /// ways run the same kernel: the results are the same bits in every case checked. Only
    /// the one-thread pieces: MKL's own threads on a whole product do not lose this way.
    fn wants_packed_b(&self, cols: i64) -> bool {
        !self.tb && cols % 1024 == 0 && (80..=176).contains(&self.m) && self.k >= 256
    }

    /// One `op(A) @ B` (batch 1) through MKL's packed API: B packed into this thread's scratch
    /// buffer, then the product. `(rows, cols)` as for [`Product::run_with`].
    ///
    /// # Safety
    /// As for [`Product::run`].
    unsafe fn run_packed_b(&self, api: &PackedApi, (rows, cols): (i64, i64)) {
        let Product { m, n, k, .. } = *self;
        let (mi, ni, ki) = (m as c_int, n as c_int, k as c_int);
        // SAFETY: MKL's size query.
        let bytes = unsafe { (api.get_size)(CBLAS_B_MATRIX, mi, ni, ki) };
        PACK_SCRATCH.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            // 64-byte alignment, as MKL's packed kernels read it.
            let floats = bytes.div_ceil(4) + 16;
            if scratch.len() < floats {
                scratch.resize(floats, 0.0);
            }
            let offset = scratch.as_ptr().align_offset(64);
            let dest = scratch[offset..].as_mut_ptr();
            let transa = if self.ta { CBLAS_TRANS } else { CBLAS_NO_TRANS };
            let lda = self.lda(rows) as c_int;
            // SAFETY: B (`[K, N]` block, row length `cols`), A and C lie inside the call's
            // buffers; `dest` holds at least the size MKL asked for.
            unsafe {
                (api.pack)(
                    CBLAS_ROW_MAJOR,
                    CBLAS_B_MATRIX,
                    CBLAS_NO_TRANS,
                    mi,
                    ni,
                    ki,
                    1.0,
                    self.b,
                    cols as c_int,
                    dest,
                );
                (api.compute)(
                    CBLAS_ROW_MAJOR,
                    transa,
                    CBLAS_PACKED,
                    mi,
                    ni,
                    ki,
                    self.a,
                    lda,
                    dest,
                    ni,
                    0.0,
                    self.c,
                    cols as c_int,
                )
            };
        });
        CALLS[2].fetch_add(1, Ordering::Relaxed);
    }

    /// A's leading dimension, for a product whose whole `op(A)` has `rows` rows: A stored
    /// `[K, M]` (transposed) or `[M, K]`; at least 1 even for an empty dim (k = 0 writes zeros).
    fn lda(&self, rows: i64) -> i64 {
        if self.ta {
            rows
        } else {
            self.k.max(1)
        }
    }

    /// The `batch` products, one `sgemm_` each.
    ///
    /// # Safety
    /// The pointers must hold the call's checked shapes, alive until this returns.
    unsafe fn run(&self, blas: &Blas, batch: i64) {
        // SAFETY: the caller's contract.
        unsafe { self.run_with(blas, batch, (self.m, self.n)) }
    }

    /// [`Product::run`] for a block of a product whose whole `op(A)` has `rows` rows and whose
    /// whole `op(B)` has `cols` columns (they set the leading dimensions).
    ///
    /// # Safety
    /// As for [`Product::run`].
    unsafe fn run_with(&self, blas: &Blas, batch: i64, (rows, cols): (i64, i64)) {
        let Product { m, n, k, .. } = *self;
        // Row-major C = A B is column-major C^T = B^T A^T: BLAS's first operand is B, its
        // second A. A leading dimension is at least 1 even for an empty dim (k = 0 writes zeros).
        let ldb = if self.tb { k.max(1) } else { cols };
        let lda = self.lda(rows);
        let (tb, ta) = (
            if self.tb { b'T' } else { b'N' } as c_char,
            if self.ta { b'T' } else { b'N' } as c_char,
        );
        let (mi, ni, ki) = (m as c_int, n as c_int, k as c_int);
        let (ldb, lda, ldc) = (ldb as c_int, lda as c_int, cols as c_int);
        let (alpha, beta) = (1.0f32, 0.0f32);
        for entry in 0..batch {
            // SAFETY: entry `entry` of each operand and of the result lies inside its buffer.
            unsafe {
                (blas.sgemm)(
                    &tb,
                    &ta,
                    &ni,
                    &mi,
                    &ki,
                    &alpha,
                    self.b.add((entry * k * n) as usize),
                    &ldb,
                    self.a.add((entry * m * k) as usize),
                    &lda,
                    &beta,
                    self.c.add((entry * m * n) as usize),
                    &ldc,
                )
            };
        }
    }
}
