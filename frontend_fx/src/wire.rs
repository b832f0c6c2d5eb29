//! The JSON format Python writes for one FX graph (see `python/tpuc/fx_export.py`).
//!
//! Kept separate from the IR so the IR can change without changing what Python sends.

use crate::{DType, Dim, SymExpr};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FxGraph {
    pub nodes: Vec<FxNode>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FxNode {
    pub name: String,
    /// `placeholder`, `call_function`, `get_attr` or `output`, as in `torch.fx.Node.op`.
    pub op: String,
    /// `str(node.target)`: `aten.addmm.default`, `<built-in function getitem>`, ...
    #[serde(default)]
    pub target: String,
    #[serde(default)]
    pub args: Vec<FxArg>,
    #[serde(default)]
    pub kwargs: BTreeMap<String, FxArg>,
    /// `node.meta['val']`, absent when FX recorded none.
    #[serde(default)]
    pub val: Option<FxMeta>,
}

/// An argument of an FX node. Untagged: JSON numbers, bools, strings, arrays and null map to
/// themselves; objects carry a one-key tag.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FxArg {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<FxArg>),
    Node {
        node: String,
    },
    DType {
        dtype: DType,
    },
    /// Non-finite floats, which JSON cannot spell: `"inf"`, `"-inf"`, `"nan"`.
    SpecialFloat {
        float: String,
    },
    Device {
        device: String,
    },
    /// Layouts, memory formats and other enum-like values, by their Python `str`.
    Other {
        other: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FxMeta {
    Tensor { shape: Vec<Dim>, dtype: DType },
    Tuple(Vec<Option<FxMeta>>),
    Symint(SymExpr),
    Int(i64),
    Float(f64),
    Bool(bool),
}
