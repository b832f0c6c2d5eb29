//! Sliding-window geometry shared by pooling and the convolutions lowered tap by tap.

use crate::lower::emit::Emitter;
use crate::lower::{Scalar, R, T};

/// Kernel, stride, padding and dilation of a sliding window, each per spatial dim (the
/// trailing dims of the tensor it slides over).
#[derive(Clone)]
pub struct Window {
    pub kernel: Vec<i64>,
    pub stride: Vec<i64>,
    pub padding: Vec<i64>,
    pub dilation: Vec<i64>,
}

/// Every index into a window of `extent` per dim, row-major (the order PyTorch's kernels scan).
pub fn taps(extent: &[i64]) -> Vec<Vec<i64>> {
    let mut taps: Vec<Vec<i64>> = vec![vec![]];
    for &k in extent {
        taps = taps
            .into_iter()
            .flat_map(|t| {
                (0..k).map(move |i| {
                    let mut t = t.clone();
                    t.push(i);
                    t
                })
            })
            .collect();
    }
    taps
}

impl Window {
    /// Every tap of the window, as its index per kernel dim, row-major (the order PyTorch's
    /// kernels scan).
    pub fn taps(&self) -> Vec<Vec<i64>> {
        taps(&self.kernel)
    }

    /// `x` padded with `value` on its trailing spatial dims (the window's padding before, and
    /// after as far as the last window reaches), so that the window of every tap over every
    /// output position of `out_shape` is a strided slice of it.
    pub fn pad<'c, 'b>(
        &self,
        e: &Emitter<'c, 'b>,
        x: &T<'c, 'b>,
        out_shape: &[i64],
        value: Scalar,
    ) -> R<T<'c, 'b>> {
        self.pad_from(e, x, out_shape, value, x.rank() - self.kernel.len())
    }

    /// [`Window::pad`] with the spatial dims starting at dim `first` (1 for channels-last).
    pub fn pad_from<'c, 'b>(
        &self,
        e: &Emitter<'c, 'b>,
        x: &T<'c, 'b>,
        out_shape: &[i64],
        value: Scalar,
        first: usize,
    ) -> R<T<'c, 'b>> {
        let rank = x.rank();
        let (mut lo, mut hi) = (vec![0; rank], vec![0; rank]);
        let mut padded_shape = x.shape.clone();
        for k in 0..self.kernel.len() {
            let d = first + k;
            let needed =
                (out_shape[d] - 1) * self.stride[k] + (self.kernel[k] - 1) * self.dilation[k] + 1;
            lo[d] = self.padding[k];
            hi[d] = (needed - x.shape[d] - self.padding[k]).max(0);
            padded_shape[d] += lo[d] + hi[d];
        }
        if padded_shape == x.shape {
            return Ok(x.clone()); // every window lies inside `x`
        }
        let fill = e.splat(value, &[], x.dtype)?;
        e.pad(x, &fill, &lo, &hi, &vec![0; rank])
    }
}
