//! Strided views: where each element of a value lies in the row-major buffer of a value it was
//! made from through layout ops only (`stablehlo.reshape`, `transpose`, `slice`), so that a
//! host kernel can read that buffer in place instead of a copy XLA would make (attention's
//! heads split out of one projection: `tpuc_hostkernels::host_attention`).

use melior::ir::attribute::DenseI64ArrayAttribute;
use melior::ir::operation::{OperationLike, OperationResult};
use melior::ir::r#type::{DimSize, RankedTensorType};
use melior::ir::{ShapedTypeLike, ValueLike};

use super::emit::{Emitter, T};

/// Element `(i_0, .., i_n)` of a value lies at `offset + sum(i_k * strides[k])` in `base`'s
/// row-major buffer.
#[derive(Clone, Debug)]
pub struct StridedView<'c, 'b> {
    pub base: T<'c, 'b>,
    pub offset: i64,
    pub strides: Vec<i64>,
}

/// Row-major strides of `shape`.
pub fn row_major(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1; shape.len()];
    for k in (0..shape.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1] * shape[k + 1].max(1);
    }
    strides
}

/// A linear map `offset + sum(c_m * strides[m])` (`0 <= c_m < extents[m]`) into a row-major
/// buffer of `shape`, as coordinates of that shape: the offset's coordinates, and for each term
/// the dim it moves along and by how much per step (None for a term that never moves). None
/// where a term would carry from one dim into the next, which no per-dim map can express.
#[allow(clippy::type_complexity)]
fn split_by_dims(
    offset: i64,
    extents: &[i64],
    strides: &[i64],
    shape: &[i64],
) -> Option<(Vec<i64>, Vec<Option<(usize, i64)>>)> {
    let rs = row_major(shape);
    let numel: i64 = shape.iter().product();
    if offset < 0 || offset >= numel.max(1) {
        return None;
    }
    let digits: Vec<i64> = (0..shape.len())
        .map(|k| (offset / rs[k]) % shape[k].max(1))
        .collect();
    let mut reach = vec![0i64; shape.len()];
    let mut terms = Vec::with_capacity(strides.len());
    for (&n, &s) in extents.iter().zip(strides) {
        if n <= 1 || s == 0 {
            terms.push(None);
            continue;
        }
        let k = (0..shape.len()).find(|&k| shape[k] > 1 && rs[k] <= s && s < rs[k] * shape[k])?;
        if s % rs[k] != 0 {
            return None;
        }
        let step = s / rs[k];
        reach[k] += (n - 1) * step;
        terms.push(Some((k, step)));
    }
    (0..shape.len())
        .all(|k| digits[k] + reach[k] < shape[k].max(1))
        .then_some((digits, terms))
}

/// The dims of a ranked tensor value.
fn dims_of(v: melior::ir::Value<'_, '_>) -> Option<Vec<i64>> {
    let t = RankedTensorType::try_from(v.r#type()).ok()?;
    (0..t.rank())
        .map(|i| match t.dim_size(i).ok()? {
            DimSize::Static(d) => i64::try_from(d).ok(),
            DimSize::Dynamic => None,
        })
        .collect()
}

fn i64_array(op: &melior::ir::operation::OperationRef<'_, '_>, name: &str) -> Option<Vec<i64>> {
    let a = DenseI64ArrayAttribute::try_from(op.attribute(name).ok()?).ok()?;
    (0..a.len()).map(|i| a.element(i).ok()).collect()
}

impl<'c, 'b> Emitter<'c, 'b> {
    /// `t` as a strided view of the furthest value it was made from by reshapes, transposes
    /// and unit-step or strided slices in this block (`t` itself, dense, when there is none).
    pub fn strided_view(&self, t: &T<'c, 'b>) -> StridedView<'c, 'b> {
        let mut view = StridedView {
            base: t.clone(),
            offset: 0,
            strides: row_major(&t.shape),
        };
        while let Some(next) = self.step_back(&view, &t.shape) {
            view = next;
        }
        view
    }

    /// `view` moved onto the operand of the layout op that made its base, if it is one.
    fn step_back(
        &self,
        view: &StridedView<'c, 'b>,
        extents: &[i64],
    ) -> Option<StridedView<'c, 'b>> {
        let op = OperationResult::try_from(view.base.v).ok()?.owner();
        let name = op.name();
        let name = name.as_string_ref().as_str().ok()?;
        let input = op.operand(0).ok()?;
        let in_shape = dims_of(input)?;
        let base = T {
            v: input,
            shape: in_shape.clone(),
            dtype: view.base.dtype,
        };
        let in_rs = row_major(&in_shape);
        // The input's coordinate and step along each of the output's dims.
        let (start, step, out_to_in): (Vec<i64>, Vec<i64>, Vec<usize>) = match name {
            // Same elements in the same order: the linear map is unchanged.
            "stablehlo.reshape" => {
                return Some(StridedView {
                    base,
                    ..view.clone()
                })
            }
            "stablehlo.transpose" => {
                let perm = i64_array(&op, "permutation")?;
                let n = perm.len();
                (
                    vec![0; n],
                    vec![1; n],
                    perm.iter().map(|&p| p as usize).collect(),
                )
            }
            "stablehlo.slice" => {
                let start = i64_array(&op, "start_indices")?;
                let steps = i64_array(&op, "strides")?;
                let n = start.len();
                (start, steps, (0..n).collect())
            }
            _ => return None,
        };
        let (digits, terms) = split_by_dims(view.offset, extents, &view.strides, &view.base.shape)?;
        let offset = digits
            .iter()
            .enumerate()
            .map(|(k, &c)| (start[k] + c * step[k]) * in_rs[out_to_in[k]])
            .sum();
        let strides = terms
            .iter()
            .map(|t| t.map_or(0, |(k, a)| a * step[k] * in_rs[out_to_in[k]]))
            .collect();
        Some(StridedView {
            base,
            offset,
            strides,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_by_dims_finds_each_terms_dim_or_refuses_a_carry() {
        // [197, 8, 2304] seen as q of head h: (b, h, row, col) strides (2304, 64, 8*2304, 1).
        let shape = [197, 8, 2304];
        let (digits, terms) =
            split_by_dims(768, &[8, 12, 197, 64], &[2304, 64, 18432, 1], &shape).unwrap();
        assert_eq!(digits, vec![0, 0, 768]);
        assert_eq!(
            terms,
            vec![Some((1, 1)), Some((2, 64)), Some((0, 1)), Some((2, 1))]
        );
        // 13 heads of 64 from offset 1536 run past the 2304 of the last dim.
        assert!(split_by_dims(1536, &[13, 64], &[64, 1], &shape).is_none());
        // A stride between two dims' strides that is not a multiple of the inner one.
        assert!(split_by_dims(0, &[2, 4], &[3000, 1], &shape).is_none());
        // Terms of one step, and broadcast terms, never move.
        let (_, terms) = split_by_dims(0, &[1, 5, 3], &[999, 0, 2304], &shape).unwrap();
        assert_eq!(terms, vec![None, None, Some((1, 1))]);
    }

    #[test]
    fn row_major_strides() {
        assert_eq!(row_major(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(row_major(&[5]), vec![1]);
        assert!(row_major(&[]).is_empty());
    }
}
