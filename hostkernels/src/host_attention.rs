//! Attention on the host, registered with a CPU plugin as an XLA FFI custom call:
//! `softmax(q k^T * scale + mask) v` and the logsumexp of each row, f32, for each (batch, head)
//! and block of query rows at once, so that a block's scores stay in the cache: one-thread MKL
//! products (`q k^T`, then the weights times `v`) around a vectorized softmax of the block
//! ([`super::host_rows::vector`]), the units shared by this thread and the spinning helpers.
//!
//! Why: lowered to XLA the scores of every head are written out, read by the softmax's passes
//! and read again by the second product (ViT-B/16 at batch 8: 15 MB per layer, each way).
//!
//! Operands are strided views: each of q, k, v is a buffer read at `offset + batch * sb +
//! head * sh + row * sr + col` (columns contiguous), so that the compiler can hand over the
//! projection's output as it lies, without the copies that split it into heads. The output is
//! written the same way (its strides chosen by the compiler).

use std::ffi::c_void;

use super::host_blas::OneThreadBlas;
use super::host_rows::vector;
use super::spin_helpers::{cpus, run_units};
use super::xla_ffi::{
    arg, error, open_frame, register_targets, ret, CallFrame, FfiBuffer, Handler, DTYPE_F32,
    DTYPE_S64,
};
use tpuc_runtime::PjrtError;
use tpuc_runtime::Plugin;

/// `tpuc_attention(q, k, v, geometry i64 [GEOMETRY_LEN], scale f32 [1][, mask f32])
/// -> (out f32, logsumexp f32 [b, h, l])`. q, k, v and out are buffers of any shape read and
/// written through the strides in `geometry` (see [`Geometry`]); the mask, where there is one,
/// is added to the scaled scores, read through its own strides.
pub const ATTENTION: &str = "tpuc_attention";

/// Entries of the geometry operand, in order.
pub const GEOMETRY: [&str; 26] = [
    "batch",
    "heads",
    "kv_heads",
    "queries",
    "keys",
    "dim",
    "value_dim",
    "causal",
    "q_offset",
    "q_batch",
    "q_head",
    "q_row",
    "k_offset",
    "k_batch",
    "k_head",
    "k_row",
    "v_offset",
    "v_batch",
    "v_head",
    "v_row",
    "mask_batch",
    "mask_head",
    "mask_row",
    "out_batch",
    "out_head",
    "out_row",
];
pub const GEOMETRY_LEN: usize = GEOMETRY.len();

/// Registers the target with `plugin`'s XLA, once per plugin. Ok(false) where the plugin has no
/// PJRT FFI extension.
pub fn register(plugin: &Plugin) -> Result<bool, PjrtError> {
    register_targets(
        plugin,
        &[(ATTENTION, attention as Handler)],
        "host attention",
    )
}

/// Query rows per unit: a block's scores (`rows x keys` f32) are at most this many, so that
/// they stay in L2 between the products and the softmax.
const BLOCK_SCORES: i64 = 1 << 16;

/// A strided view of one of the operands: element `(batch, head, row, col)` at `offset +
/// batch * sb + head * sh + row * sr + col`.
#[derive(Clone, Copy, Debug)]
struct View {
    ptr: *mut f32,
    offset: i64,
    sb: i64,
    sh: i64,
    sr: i64,
}

impl View {
    /// Whether every element of `[batch, heads, rows, cols]` lies inside `len` elements.
    fn fits(&self, [batch, heads, rows, cols]: [i64; 4], len: i64) -> bool {
        let strides = [self.sb, self.sh, self.sr];
        if self.offset < 0 || strides.iter().any(|&s| s < 0) {
            return false;
        }
        if [batch, heads, rows, cols].contains(&0) {
            return true;
        }
        let last = self.offset
            + (batch - 1) * self.sb
            + (heads - 1) * self.sh
            + (rows - 1) * self.sr
            + cols
            - 1;
        last < len
    }

    /// Element `(batch, head, row, 0)`.
    ///
    /// # Safety
    /// Inside the view's checked extent.
    unsafe fn at(&self, batch: i64, head: i64, row: i64) -> *mut f32 {
        // SAFETY: the caller's contract.
        unsafe {
            self.ptr
                .add((self.offset + batch * self.sb + head * self.sh + row * self.sr) as usize)
        }
    }
}

/// One call, shared with the threads that run its units.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    b: i64,
    h: i64,
    hk: i64,
    l: i64,
    s: i64,
    d: i64,
    dv: i64,
    causal: bool,
    q: View,
    k: View,
    v: View,
    mask: Option<View>,
    out: View,
    lse: *mut f32,
    scale: f32,
    /// Query rows per unit.
    block: i64,
}

// SAFETY: XLA's buffers for the duration of the call, which waits until every unit is done;
// each unit writes its own rows of the output and of the logsumexp.
unsafe impl Send for Geometry {}
// SAFETY: see Send.
unsafe impl Sync for Geometry {}

fn f32_buffer(b: Option<&FfiBuffer>) -> Option<(&FfiBuffer, i64)> {
    let b = b?;
    (b.dtype == DTYPE_F32).then(|| (b, b.dims().iter().product()))
}

/// The handler of [`ATTENTION`].
///
/// # Safety
/// Called by XLA with a valid call frame.
unsafe extern "C" fn attention(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: the pointer XLA passed.
    let frame = match unsafe { open_frame(frame, ATTENTION) } {
        Ok(frame) => frame,
        Err(done) => return done,
    };
    // SAFETY: the frame XLA passed, its size checked by `open_frame`.
    match unsafe { geometry(frame) } {
        Ok(Some(g)) => {
            let blocks = (g.l + g.block - 1) / g.block;
            run_units(g.b * g.h * blocks, cpus() as usize, move |u| {
                let Some(blas) = OneThreadBlas::enter() else {
                    return;
                };
                // SAFETY: the checked views; each unit writes its own rows.
                unsafe { g.unit(&blas, u / blocks, u % blocks) };
            });
            std::ptr::null_mut()
        }
        Ok(None) => std::ptr::null_mut(),
        Err(message) => error(frame, &format!("tpuc_attention: {message}")),
    }
}

/// The call's geometry, checked against its buffers; None when there is nothing to compute.
///
/// # Safety
/// `frame` must be a live, opened call frame.
unsafe fn geometry(frame: &CallFrame) -> Result<Option<Geometry>, String> {
    let masked = match (frame.args.size, frame.rets.size) {
        (5, 2) => false,
        (6, 2) => true,
        _ => return Err("expects 5 or 6 operands and 2 results".into()),
    };
    if OneThreadBlas::enter().is_none() {
        return Err("no host BLAS in this process".into());
    }
    // SAFETY: a checked frame of 5 or 6 operands and 2 results.
    let (q, k, v, geo, scale, mask, out, lse) = unsafe {
        (
            f32_buffer(arg(frame, 0)),
            f32_buffer(arg(frame, 1)),
            f32_buffer(arg(frame, 2)),
            arg(frame, 3),
            f32_buffer(arg(frame, 4)),
            if masked {
                f32_buffer(arg(frame, 5)).map(Some)
            } else {
                Some(None)
            },
            f32_buffer(ret(frame, 0)),
            f32_buffer(ret(frame, 1)),
        )
    };
    let (Some(q), Some(k), Some(v), Some(scale), Some(mask), Some(out), Some(lse)) =
        (q, k, v, scale, mask, out, lse)
    else {
        return Err("operands and results must be f32 (the geometry i64)".into());
    };
    let geo = match geo {
        Some(g) if g.dtype == DTYPE_S64 && g.dims() == [GEOMETRY_LEN as i64] => {
            // SAFETY: an s64 buffer of GEOMETRY_LEN elements.
            unsafe { std::slice::from_raw_parts(g.data as *const i64, GEOMETRY_LEN) }
        }
        _ => return Err(format!("geometry must be s64[{GEOMETRY_LEN}]")),
    };
    if scale.1 != 1 {
        return Err("scale must hold one f32".into());
    }
    let [b, h, hk, l, s, d, dv, causal] = <[i64; 8]>::try_from(&geo[..8]).expect("8 entries");
    let view = |(buf, _): (&FfiBuffer, i64), at: usize| View {
        ptr: buf.data as *mut f32,
        offset: geo[at],
        sb: geo[at + 1],
        sh: geo[at + 2],
        sr: geo[at + 3],
    };
    // A matrix of one row may have any row stride in a view (its rows never step); the BLAS
    // still wants a leading dimension of at least the row's length.
    let lead = |mut view: View, rows: i64, cols: i64| {
        if rows <= 1 {
            view.sr = cols.max(1);
        }
        view
    };
    let (qv, kv, vv) = (
        lead(view(q, 8), l, d),
        lead(view(k, 12), s, d),
        lead(view(v, 16), s, dv),
    );
    let mask_view = mask.map(|m| View {
        ptr: m.0.data as *mut f32,
        offset: 0,
        sb: geo[20],
        sh: geo[21],
        sr: geo[22],
    });
    let out_view = lead(
        View {
            ptr: out.0.data as *mut f32,
            offset: 0,
            sb: geo[23],
            sh: geo[24],
            sr: geo[25],
        },
        l,
        dv,
    );
    if [b, h, hk, l, s, d, dv].iter().any(|&x| x < 0) || hk == 0 && h > 0 || h % hk.max(1) != 0 {
        return Err(format!("bad sizes {:?}", &geo[..7]));
    }
    let fits = [
        (qv, [b, h, l, d], q.1, "query"),
        (kv, [b, hk, s, d], k.1, "key"),
        (vv, [b, hk, s, dv], v.1, "value"),
        (out_view, [b, h, l, dv], out.1, "output"),
    ];
    for (view, shape, len, what) in fits {
        // Rows that overlap are no matrix the BLAS can read (nor write).
        if !view.fits(shape, len) || view.sr < shape[3] {
            return Err(format!(
                "the {what} view {view:?} of {shape:?} exceeds its {len} elements"
            ));
        }
    }
    if let (Some(view), Some(m)) = (mask_view, mask) {
        if !view.fits([b, h, l, s], m.1) {
            return Err(format!(
                "the mask view {view:?} exceeds its {} elements",
                m.1
            ));
        }
    }
    if lse.1 != b * h * l {
        return Err("the logsumexp result must have batch x heads x queries elements".into());
    }
    if [b, h, l].contains(&0) {
        return Ok(None);
    }
    let fits_blas = |x: i64| i32::try_from(x).is_ok();
    if ![s, d, dv, l, qv.sr, kv.sr, vv.sr, out_view.sr]
        .iter()
        .all(|&x| fits_blas(x))
    {
        return Err("dims exceed 32-bit BLAS".into());
    }
    // SAFETY: an f32 buffer of one element.
    let scale = unsafe { *(scale.0.data as *const f32) };
    Ok(Some(Geometry {
        b,
        h,
        hk,
        l,
        s,
        d,
        dv,
        causal: causal != 0,
        q: qv,
        k: kv,
        v: vv,
        mask: mask_view,
        out: out_view,
        lse: lse.0.data as *mut f32,
        scale,
        block: (BLOCK_SCORES / s.max(1)).clamp(16, l.max(16)),
    }))
}

thread_local! {
    /// A unit's scores (see [`BLOCK_SCORES`]), kept for the thread's next unit.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Geometry {
    /// Query rows `block * rows..` of entry `entry` (batch-major over heads).
    ///
    /// # Safety
    /// The views must be the call's checked ones, alive until this returns.
    unsafe fn unit(&self, blas: &OneThreadBlas, entry: i64, block: i64) {
        let (bi, hi) = (entry / self.h, entry % self.h);
        let ki = hi / (self.h / self.hk);
        let row0 = block * self.block;
        let rows = self.block.min(self.l - row0);
        // Causal (top-left aligned): query i sees keys 0..=i, so the block sees keys
        // 0..row0 + rows.
        let keys = if self.causal {
            (row0 + rows).min(self.s)
        } else {
            self.s
        };
        SCORES.with(|scores| {
            let mut scores = scores.borrow_mut();
            let ld = keys.max(1);
            if (scores.len() as i64) < rows * ld {
                scores.resize((rows * ld) as usize, 0.0);
            }
            let sp = scores.as_mut_ptr();
            // SAFETY: each product below reads rows of the checked views and writes rows of the
            // scores buffer, which holds rows x ld.
            unsafe {
                if keys > 0 && self.d > 0 {
                    blas.product(
                        (rows, keys, self.d),
                        self.scale,
                        (self.q.at(bi, hi, row0), self.q.sr),
                        (self.k.at(bi, ki, 0), self.k.sr, true),
                        (sp, ld),
                    );
                } else {
                    scores[..(rows * ld) as usize].fill(0.0);
                }
            }
            for r in 0..rows {
                let i = row0 + r;
                let row = &mut scores[(r * ld) as usize..(r * ld + keys) as usize];
                if let Some(m) = &self.mask {
                    // SAFETY: row i of the checked mask view, `keys <= s` entries.
                    let add = unsafe { std::slice::from_raw_parts(m.at(bi, hi, i), keys as usize) };
                    vector::add_in_place(row, add);
                }
                // Keys past the query's own are masked; they start at i + 1 < keys.
                let seen = if self.causal { (i + 1).min(keys) } else { keys };
                row[seen as usize..].fill(0.0);
                let (max, sum) = vector::softmax_row(&mut row[..seen as usize]);
                let lse = if max == f32::NEG_INFINITY {
                    // Every key masked: PyTorch's kernel returns zeros and a logsumexp of 0.
                    0.0
                } else {
                    max + sum.ln()
                };
                // SAFETY: entry (bi, hi, i) of the [b, h, l] logsumexp.
                unsafe { *self.lse.add(((bi * self.h + hi) * self.l + i) as usize) = lse };
            }
            // SAFETY: rows of the checked views.
            unsafe {
                let out = self.out.at(bi, hi, row0);
                if keys > 0 {
                    blas.product(
                        (rows, self.dv, keys),
                        1.0,
                        (sp, ld),
                        (self.v.at(bi, ki, 0), self.v.sr, false),
                        (out, self.out.sr),
                    );
                } else {
                    for r in 0..rows {
                        std::slice::from_raw_parts_mut(
                            out.add((r * self.out.sr) as usize),
                            self.dv as usize,
                        )
                        .fill(0.0);
                    }
                }
            }
        });
    }
}
