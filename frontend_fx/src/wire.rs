//! The JSON format Python writes for one FX graph (see `python/tpuc/fx_export.py`).
//!
//! Kept separate from the IR so the IR can change without changing what Python sends.

use crate::{DType, Dim, SymExpr};
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FxGraph {
    pub nodes: Vec<FxNode>,
    /// The graphs that `get_attr` nodes of this one name (the branches and bodies of
    /// control-flow ops: `torch.ops.higher_order.cond` ...), by the `get_attr` node's name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub subgraphs: BTreeMap<String, FxGraph>,
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
    /// The user's frames of `node.meta['stack_trace']`, innermost first; absent when FX
    /// recorded none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loc: Option<crate::SourceLoc>,
    /// Whether the node recomputes a checkpointed forward value for the backward (a
    /// `*_recomputed` copy that PyTorch's activation-checkpointing pass put before the backward's
    /// use): see [`crate::Node::recomputed`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recomputed: bool,
}

/// An argument of an FX node. Untagged: JSON numbers, bools, strings, arrays and null map to
/// themselves; objects carry a one-key tag. Read by a hand-written visitor (see the
/// `Deserialize` impl below) rather than serde's untagged derive, which buffers every value and
/// tries each variant in turn.
#[derive(Debug, Clone, PartialEq, Serialize)]
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

impl<'de> Deserialize<'de> for FxArg {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<FxArg, D::Error> {
        d.deserialize_any(FxArgVisitor)
    }
}

struct FxArgVisitor;

/// The one-key objects an argument may be, by key.
const TAGS: &[&str] = &["node", "dtype", "float", "device", "other"];

impl<'de> Visitor<'de> for FxArgVisitor {
    type Value = FxArg;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an FX argument: null, a bool, a number, a string, a list or a one-key object")
    }

    fn visit_unit<E: de::Error>(self) -> Result<FxArg, E> {
        Ok(FxArg::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<FxArg, E> {
        Ok(FxArg::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<FxArg, D::Error> {
        FxArg::deserialize(d)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<FxArg, E> {
        Ok(FxArg::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<FxArg, E> {
        Ok(FxArg::Int(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<FxArg, E> {
        // Past i64 the untagged derive fell through to Float; keep that.
        Ok(i64::try_from(v).map_or(FxArg::Float(v as f64), FxArg::Int))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<FxArg, E> {
        Ok(FxArg::Float(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<FxArg, E> {
        Ok(FxArg::Str(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<FxArg, E> {
        Ok(FxArg::Str(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<FxArg, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(FxArg::List(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<FxArg, A::Error> {
        let key: String = map
            .next_key()?
            .ok_or_else(|| de::Error::custom("an FX argument object is empty"))?;
        let arg = match key.as_str() {
            "node" => FxArg::Node {
                node: map.next_value()?,
            },
            "dtype" => FxArg::DType {
                dtype: map.next_value()?,
            },
            "float" => FxArg::SpecialFloat {
                float: map.next_value()?,
            },
            "device" => FxArg::Device {
                device: map.next_value()?,
            },
            "other" => FxArg::Other {
                other: map.next_value()?,
            },
            _ => return Err(de::Error::unknown_field(&key, TAGS)),
        };
        if let Some(extra) = map.next_key::<String>()? {
            return Err(de::Error::custom(format!(
                "an FX argument object has one key, got `{key}` and `{extra}`"
            )));
        }
        Ok(arg)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_read_back_as_written() {
        let args = vec![
            FxArg::Null,
            FxArg::Bool(true),
            FxArg::Int(-3),
            FxArg::Int(i64::MAX),
            FxArg::Float(0.5),
            FxArg::Float(2.0),
            FxArg::Str("mean".into()),
            FxArg::List(vec![FxArg::Int(1), FxArg::Node { node: "x".into() }]),
            FxArg::Node { node: "add".into() },
            FxArg::DType {
                dtype: DType::Float32,
            },
            FxArg::SpecialFloat {
                float: "-inf".into(),
            },
            FxArg::Device {
                device: "cpu".into(),
            },
            FxArg::Other {
                other: "torch.strided".into(),
            },
        ];
        let text = serde_json::to_string(&args).unwrap();
        let back: Vec<FxArg> = serde_json::from_str(&text).unwrap();
        assert_eq!(back, args);
        let big: FxArg = serde_json::from_str("18446744073709551615").unwrap();
        assert_eq!(big, FxArg::Float(u64::MAX as f64));
    }

    #[test]
    fn bad_arg_objects_are_errors() {
        for text in [
            r#"{}"#,
            r#"{"what": 1}"#,
            r#"{"node": "a", "dtype": "float32"}"#,
            r#"{"node": 3}"#,
        ] {
            assert!(serde_json::from_str::<FxArg>(text).is_err(), "{text}");
        }
    }
}
