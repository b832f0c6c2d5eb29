//! XLA's optimized program as readable HLO text, for dumps (`optimized_hlo.txt`).
//!
//! Plugins that return the optimized program only as a serialized `HloModuleProto` (the CPU
//! plugin's format `"hlo_with_config"`, or `"hlo"`) cannot print it; this module decodes the
//! few proto fields that matter for reading (prost, partial messages: unknown fields are
//! skipped) and prints them in the shape of XLA's HLO text: computations, instructions with
//! shapes and layouts, operands, fusion kinds and called computations, and the main
//! attributes (dimensions, slices, dot dims, comparison direction, scalar constants), and each
//! instruction's metadata (`op_name`, `source_file`, `source_line`: the user's line that made
//! it, from the StableHLO op's location; a `stack_frame_id` is resolved through the module's
//! stack frame index). It is not XLA's printer: large constants are left out.

use prost::Message;
use std::collections::HashMap;
use std::fmt::Write;

/// `xla.HloModuleProtoWithConfig` (xla/xla.proto).
#[derive(Clone, PartialEq, Message)]
struct HloModuleProtoWithConfig {
    #[prost(message, optional, tag = "1")]
    hlo_module: Option<HloModuleProto>,
}

/// `xla.HloModuleProto` (xla/service/hlo.proto), partial.
#[derive(Clone, PartialEq, Message)]
struct HloModuleProto {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    entry_computation_name: String,
    #[prost(message, repeated, tag = "3")]
    computations: Vec<HloComputationProto>,
    #[prost(int64, tag = "6")]
    entry_computation_id: i64,
    #[prost(message, optional, tag = "17")]
    stack_frame_index: Option<StackFrameIndexProto>,
}

/// `xla.StackFrameIndexProto`: source locations interned per module (ids are 1-based).
#[derive(Clone, PartialEq, Message)]
struct StackFrameIndexProto {
    #[prost(string, repeated, tag = "1")]
    file_names: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    function_names: Vec<String>,
    #[prost(message, repeated, tag = "3")]
    file_locations: Vec<FileLocation>,
    #[prost(message, repeated, tag = "4")]
    stack_frames: Vec<StackFrame>,
}

#[derive(Clone, PartialEq, Message)]
struct FileLocation {
    #[prost(int32, tag = "1")]
    file_name_id: i32,
    #[prost(int32, tag = "2")]
    function_name_id: i32,
    #[prost(int32, tag = "3")]
    line: i32,
}

#[derive(Clone, PartialEq, Message)]
struct StackFrame {
    #[prost(int32, tag = "1")]
    file_location_id: i32,
    #[prost(int32, tag = "2")]
    parent_frame_id: i32,
}

/// `xla.OpMetadata` (xla/xla_data.proto), partial.
#[derive(Clone, PartialEq, Message)]
struct OpMetadata {
    #[prost(string, tag = "1")]
    op_type: String,
    #[prost(string, tag = "2")]
    op_name: String,
    #[prost(string, tag = "3")]
    source_file: String,
    #[prost(int32, tag = "4")]
    source_line: i32,
    #[prost(int32, tag = "15")]
    stack_frame_id: i32,
}

#[derive(Clone, PartialEq, Message)]
struct HloComputationProto {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(message, repeated, tag = "2")]
    instructions: Vec<HloInstructionProto>,
    #[prost(int64, tag = "5")]
    id: i64,
    #[prost(int64, tag = "6")]
    root_id: i64,
    #[prost(bool, tag = "7")]
    is_fusion_computation: bool,
}

#[derive(Clone, PartialEq, Message)]
struct SliceDimensions {
    #[prost(int64, tag = "1")]
    start: i64,
    #[prost(int64, tag = "2")]
    limit: i64,
    #[prost(int64, tag = "3")]
    stride: i64,
}

#[derive(Clone, PartialEq, Message)]
struct DotDimensionNumbers {
    #[prost(int64, repeated, tag = "1")]
    lhs_contracting_dimensions: Vec<i64>,
    #[prost(int64, repeated, tag = "2")]
    rhs_contracting_dimensions: Vec<i64>,
    #[prost(int64, repeated, tag = "3")]
    lhs_batch_dimensions: Vec<i64>,
    #[prost(int64, repeated, tag = "4")]
    rhs_batch_dimensions: Vec<i64>,
}

/// `xla.Window` (reduce-window, convolution, select-and-scatter).
#[derive(Clone, PartialEq, Message)]
struct Window {
    #[prost(message, repeated, tag = "1")]
    dimensions: Vec<WindowDimension>,
}

#[derive(Clone, PartialEq, Message)]
struct WindowDimension {
    #[prost(int64, tag = "1")]
    size: i64,
    #[prost(int64, tag = "2")]
    stride: i64,
    #[prost(int64, tag = "3")]
    padding_low: i64,
    #[prost(int64, tag = "4")]
    padding_high: i64,
    #[prost(int64, tag = "5")]
    window_dilation: i64,
    #[prost(int64, tag = "6")]
    base_dilation: i64,
}

/// `xla.PaddingConfig` (pad).
#[derive(Clone, PartialEq, Message)]
struct PaddingConfig {
    #[prost(message, repeated, tag = "1")]
    dimensions: Vec<PaddingConfigDimension>,
}

#[derive(Clone, PartialEq, Message)]
struct PaddingConfigDimension {
    #[prost(int64, tag = "1")]
    edge_padding_low: i64,
    #[prost(int64, tag = "2")]
    edge_padding_high: i64,
    #[prost(int64, tag = "3")]
    interior_padding: i64,
}

#[derive(Clone, PartialEq, Message)]
struct HloInstructionProto {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    opcode: String,
    #[prost(message, optional, tag = "3")]
    shape: Option<ShapeProto>,
    #[prost(message, optional, tag = "7")]
    metadata: Option<OpMetadata>,
    #[prost(message, optional, tag = "8")]
    literal: Option<LiteralProto>,
    #[prost(int64, tag = "9")]
    parameter_number: i64,
    #[prost(string, tag = "11")]
    fusion_kind: String,
    #[prost(int64, tag = "13")]
    tuple_index: i64,
    #[prost(int64, repeated, tag = "14")]
    dimensions: Vec<i64>,
    #[prost(message, optional, tag = "15")]
    window: Option<Window>,
    #[prost(message, repeated, tag = "17")]
    slice_dimensions: Vec<SliceDimensions>,
    #[prost(message, optional, tag = "21")]
    padding_config: Option<PaddingConfig>,
    #[prost(int64, repeated, tag = "20")]
    dynamic_slice_sizes: Vec<i64>,
    #[prost(string, tag = "28")]
    custom_call_target: String,
    #[prost(message, optional, tag = "30")]
    dot_dimension_numbers: Option<DotDimensionNumbers>,
    #[prost(int64, repeated, tag = "34")]
    gather_slice_sizes: Vec<i64>,
    #[prost(int64, tag = "35")]
    id: i64,
    #[prost(int64, repeated, tag = "36")]
    operand_ids: Vec<i64>,
    #[prost(int64, repeated, tag = "38")]
    called_computation_ids: Vec<i64>,
    /// XLA's backend configuration as text (the CPU plugin's: JSON, e.g. a fusion's
    /// `outer_dimension_partitions`, the work split between threads).
    #[prost(bytes = "vec", tag = "43")]
    backend_config: Vec<u8>,
    #[prost(string, tag = "63")]
    comparison_direction: String,
}

/// `xla.ShapeProto` (xla/xla_data.proto), partial.
#[derive(Clone, PartialEq, Message)]
struct ShapeProto {
    #[prost(int32, tag = "2")]
    element_type: i32,
    #[prost(int64, repeated, tag = "3")]
    dimensions: Vec<i64>,
    #[prost(message, repeated, tag = "4")]
    tuple_shapes: Vec<ShapeProto>,
    #[prost(message, optional, tag = "5")]
    layout: Option<LayoutProto>,
}

#[derive(Clone, PartialEq, Message)]
struct LayoutProto {
    #[prost(int64, repeated, tag = "1")]
    minor_to_major: Vec<i64>,
}

/// `xla.LiteralProto`, the scalar-friendly fields.
#[derive(Clone, PartialEq, Message)]
struct LiteralProto {
    #[prost(bool, repeated, tag = "2")]
    preds: Vec<bool>,
    #[prost(int32, repeated, tag = "4")]
    s32s: Vec<i32>,
    #[prost(int64, repeated, tag = "5")]
    s64s: Vec<i64>,
    #[prost(uint32, repeated, tag = "6")]
    u32s: Vec<u32>,
    #[prost(uint64, repeated, tag = "7")]
    u64s: Vec<u64>,
    #[prost(float, repeated, tag = "8")]
    f32s: Vec<f32>,
    #[prost(double, repeated, tag = "9")]
    f64s: Vec<f64>,
}

/// `xla.PrimitiveType` names as HLO text spells them.
fn primitive_name(t: i32) -> &'static str {
    match t {
        1 => "pred",
        2 => "s8",
        3 => "s16",
        4 => "s32",
        5 => "s64",
        6 => "u8",
        7 => "u16",
        8 => "u32",
        9 => "u64",
        10 => "f16",
        11 => "f32",
        12 => "f64",
        13 => "tuple",
        14 => "opaque",
        15 => "c64",
        16 => "bf16",
        17 => "token",
        18 => "c128",
        19 => "f8e5m2",
        20 => "f8e4m3fn",
        21 => "s4",
        22 => "u4",
        _ => "unknown",
    }
}

fn join<T: ToString>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// `f32[3,16]{1,0}`, `(f32[4]{0}, s32[])`.
fn shape_text(s: &ShapeProto, with_layout: bool) -> String {
    if s.element_type == 13 {
        let parts: Vec<String> = s
            .tuple_shapes
            .iter()
            .map(|t| shape_text(t, with_layout))
            .collect();
        return format!("({})", parts.join(", "));
    }
    let mut out = format!(
        "{}[{}]",
        primitive_name(s.element_type),
        join(&s.dimensions)
    );
    if with_layout && !s.dimensions.is_empty() {
        if let Some(l) = &s.layout {
            let _ = write!(out, "{{{}}}", join(&l.minor_to_major));
        }
    }
    out
}

/// A constant's value when it is small (a scalar or a few elements), else `{...}`.
fn literal_text(l: &LiteralProto) -> String {
    fn show<T: ToString>(v: &[T]) -> Option<String> {
        match v.len() {
            0 => None,
            1 => Some(v[0].to_string()),
            n if n <= 8 => Some(format!("{{{}}}", join(v))),
            _ => Some("{...}".into()),
        }
    }
    show(&l.f32s)
        .or_else(|| show(&l.f64s))
        .or_else(|| show(&l.s32s))
        .or_else(|| show(&l.s64s))
        .or_else(|| show(&l.u32s))
        .or_else(|| show(&l.u64s))
        .or_else(|| show(&l.preds))
        .unwrap_or_else(|| "{...}".into())
}

/// `window={size=1x3 stride=1x2 pad=0_0x1_1}` as XLA prints it (defaults left out).
fn window_text(w: &Window) -> String {
    let field = |name: &str,
                 f: &dyn Fn(&WindowDimension) -> String,
                 skip: &dyn Fn(&WindowDimension) -> bool| {
        if w.dimensions.iter().all(skip) {
            String::new()
        } else {
            let v: Vec<String> = w.dimensions.iter().map(f).collect();
            format!(" {name}={}", v.join("x"))
        }
    };
    let mut out = field("size", &|d| d.size.to_string(), &|_| false);
    out += &field("stride", &|d| d.stride.to_string(), &|d| d.stride == 1);
    out += &field(
        "pad",
        &|d| format!("{}_{}", d.padding_low, d.padding_high),
        &|d| d.padding_low == 0 && d.padding_high == 0,
    );
    out += &field("lhs_dilate", &|d| d.base_dilation.to_string(), &|d| {
        d.base_dilation <= 1
    });
    out += &field("rhs_dilate", &|d| d.window_dilation.to_string(), &|d| {
        d.window_dilation <= 1
    });
    format!("window={{{}}}", out.trim_start())
}

/// HLO text for a serialized `HloModuleProtoWithConfig` (`with_config`) or `HloModuleProto`.
pub fn hlo_text_from_proto(bytes: &[u8], with_config: bool) -> Result<String, String> {
    let module = if with_config {
        HloModuleProtoWithConfig::decode(bytes)
            .map_err(|e| e.to_string())?
            .hlo_module
            .ok_or("no hlo_module in HloModuleProtoWithConfig")?
    } else {
        HloModuleProto::decode(bytes).map_err(|e| e.to_string())?
    };
    Ok(print_module(&module))
}

fn print_module(m: &HloModuleProto) -> String {
    let comp_names: HashMap<i64, &str> = m
        .computations
        .iter()
        .map(|c| (c.id, c.name.as_str()))
        .collect();
    let mut out = String::new();
    let entry = m
        .computations
        .iter()
        .find(|c| c.id == m.entry_computation_id || c.name == m.entry_computation_name);
    let _ = write!(out, "HloModule {}", m.name);
    if let Some(e) = entry {
        let _ = write!(out, ", entry_computation_layout={{{}}}", signature(e, true));
    }
    let _ = writeln!(
        out,
        "\n\n// Printed by tpuc from XLA's optimized HloModuleProto ({} computations).",
        m.computations.len()
    );
    for c in &m.computations {
        let is_entry = entry.is_some_and(|e| e.id == c.id);
        print_computation(
            &mut out,
            c,
            is_entry,
            &comp_names,
            m.stack_frame_index.as_ref(),
        );
    }
    out
}

/// `metadata={op_type="..." op_name="..." source_file="..." source_line=N}` as XLA prints it;
/// a source location given as a stack frame is resolved to its file and line.
fn metadata_text(md: &OpMetadata, frames: Option<&StackFrameIndexProto>) -> Option<String> {
    let mut parts = Vec::new();
    if !md.op_type.is_empty() {
        parts.push(format!("op_type={:?}", md.op_type));
    }
    if !md.op_name.is_empty() {
        parts.push(format!("op_name={:?}", md.op_name));
    }
    let mut source = (md.source_file.clone(), md.source_line);
    if source.0.is_empty() && md.stack_frame_id > 0 {
        let at = |v: i32| usize::try_from(v - 1).ok();
        let location = frames.and_then(|f| {
            let frame = f.stack_frames.get(at(md.stack_frame_id)?)?;
            let loc = f.file_locations.get(at(frame.file_location_id)?)?;
            Some((f.file_names.get(at(loc.file_name_id)?)?.clone(), loc.line))
        });
        if let Some(l) = location {
            source = l;
        }
    }
    if !source.0.is_empty() {
        parts.push(format!("source_file={:?}", source.0));
        parts.push(format!("source_line={}", source.1));
    }
    if md.stack_frame_id > 0 {
        parts.push(format!("stack_frame_id={}", md.stack_frame_id));
    }
    (!parts.is_empty()).then(|| format!("metadata={{{}}}", parts.join(" ")))
}

/// `(p0: f32[2]{0}, p1: f32[2]{0}) -> f32[2]{0}`, or, for the layout line, without names.
fn signature(c: &HloComputationProto, layout_line: bool) -> String {
    let mut params: Vec<&HloInstructionProto> = c
        .instructions
        .iter()
        .filter(|i| i.opcode == "parameter")
        .collect();
    params.sort_by_key(|i| i.parameter_number);
    let shape = |i: &HloInstructionProto| {
        i.shape
            .as_ref()
            .map_or("?".into(), |s| shape_text(s, layout_line))
    };
    let ps: Vec<String> = params
        .iter()
        .map(|p| {
            if layout_line {
                shape(p)
            } else {
                format!("{}: {}", p.name, shape(p))
            }
        })
        .collect();
    let root = c
        .instructions
        .iter()
        .find(|i| i.id == c.root_id)
        .or(c.instructions.last());
    format!("({}) -> {}", ps.join(", "), root.map_or("?".into(), shape))
}

fn print_computation(
    out: &mut String,
    c: &HloComputationProto,
    is_entry: bool,
    comp_names: &HashMap<i64, &str>,
    frames: Option<&StackFrameIndexProto>,
) {
    let names: HashMap<i64, &str> = c
        .instructions
        .iter()
        .map(|i| (i.id, i.name.as_str()))
        .collect();
    let fusion = if c.is_fusion_computation {
        "  // fusion"
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "\n{}%{} {} {{{fusion}",
        if is_entry { "ENTRY " } else { "" },
        c.name,
        signature(c, false)
    );
    for i in &c.instructions {
        let operands: Vec<String> = i
            .operand_ids
            .iter()
            .map(|id| format!("%{}", names.get(id).copied().unwrap_or("?")))
            .collect();
        let shape = i.shape.as_ref().map_or("?".into(), |s| shape_text(s, true));
        let inner = match i.opcode.as_str() {
            "parameter" => i.parameter_number.to_string(),
            "constant" => i.literal.as_ref().map_or("{...}".into(), literal_text),
            _ => operands.join(", "),
        };
        let mut attrs: Vec<String> = Vec::new();
        match i.opcode.as_str() {
            "get-tuple-element" => attrs.push(format!("index={}", i.tuple_index)),
            "compare" if !i.comparison_direction.is_empty() => {
                attrs.push(format!("direction={}", i.comparison_direction))
            }
            "slice" if !i.slice_dimensions.is_empty() => {
                let s: Vec<String> = i
                    .slice_dimensions
                    .iter()
                    .map(|d| {
                        if d.stride == 1 {
                            format!("[{}:{}]", d.start, d.limit)
                        } else {
                            format!("[{}:{}:{}]", d.start, d.limit, d.stride)
                        }
                    })
                    .collect();
                attrs.push(format!("slice={{{}}}", s.join(", ")));
            }
            "dynamic-slice" if !i.dynamic_slice_sizes.is_empty() => attrs.push(format!(
                "dynamic_slice_sizes={{{}}}",
                join(&i.dynamic_slice_sizes)
            )),
            "custom-call" => attrs.push(format!("custom_call_target=\"{}\"", i.custom_call_target)),
            _ => {}
        }
        if let Ok(config) = std::str::from_utf8(&i.backend_config) {
            if !config.is_empty() && config != "{}" {
                attrs.push(format!("backend_config={config}"));
            }
        }
        if !i.dimensions.is_empty() {
            attrs.push(format!("dimensions={{{}}}", join(&i.dimensions)));
        }
        if let Some(d) = &i.dot_dimension_numbers {
            for (k, v) in [
                ("lhs_batch_dims", &d.lhs_batch_dimensions),
                ("lhs_contracting_dims", &d.lhs_contracting_dimensions),
                ("rhs_batch_dims", &d.rhs_batch_dimensions),
                ("rhs_contracting_dims", &d.rhs_contracting_dimensions),
            ] {
                if !v.is_empty() {
                    attrs.push(format!("{k}={{{}}}", join(v)));
                }
            }
        }
        if let Some(w) = i.window.as_ref().filter(|w| !w.dimensions.is_empty()) {
            attrs.push(window_text(w));
        }
        if let Some(p) = i
            .padding_config
            .as_ref()
            .filter(|p| !p.dimensions.is_empty())
        {
            let dims: Vec<String> = p
                .dimensions
                .iter()
                .map(|d| {
                    if d.interior_padding != 0 {
                        format!(
                            "{}_{}_{}",
                            d.edge_padding_low, d.edge_padding_high, d.interior_padding
                        )
                    } else {
                        format!("{}_{}", d.edge_padding_low, d.edge_padding_high)
                    }
                })
                .collect();
            attrs.push(format!("padding={}", dims.join("x")));
        }
        if !i.gather_slice_sizes.is_empty() {
            attrs.push(format!("slice_sizes={{{}}}", join(&i.gather_slice_sizes)));
        }
        if !i.fusion_kind.is_empty() {
            attrs.push(format!("kind={}", i.fusion_kind));
        }
        let called: Vec<String> = i
            .called_computation_ids
            .iter()
            .map(|id| format!("%{}", comp_names.get(id).copied().unwrap_or("?")))
            .collect();
        match (i.opcode.as_str(), called.len()) {
            (_, 0) => {}
            ("fusion" | "call" | "async-start", 1) => attrs.push(format!("calls={}", called[0])),
            ("while", 2) => {
                attrs.push(format!("condition={}", called[0]));
                attrs.push(format!("body={}", called[1]));
            }
            (_, 1) => attrs.push(format!("to_apply={}", called[0])),
            _ => attrs.push(format!("calls={{{}}}", called.join(", "))),
        }
        if let Some(md) = i.metadata.as_ref().and_then(|m| metadata_text(m, frames)) {
            attrs.push(md);
        }
        let attrs = if attrs.is_empty() {
            String::new()
        } else {
            format!(", {}", attrs.join(", "))
        };
        let _ = writeln!(
            out,
            "  {}%{} = {shape} {}({inner}){attrs}",
            if i.id == c.root_id { "ROOT " } else { "" },
            i.name,
            i.opcode
        );
    }
    let _ = writeln!(out, "}}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_shape(dims: &[i64]) -> ShapeProto {
        ShapeProto {
            element_type: 11,
            dimensions: dims.to_vec(),
            tuple_shapes: vec![],
            layout: Some(LayoutProto {
                minor_to_major: (0..dims.len() as i64).rev().collect(),
            }),
        }
    }

    fn inst(id: i64, name: &str, opcode: &str, dims: &[i64], ops: &[i64]) -> HloInstructionProto {
        HloInstructionProto {
            id,
            name: name.into(),
            opcode: opcode.into(),
            shape: Some(f32_shape(dims)),
            operand_ids: ops.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn prints_a_module_with_a_fusion() {
        let mut p0 = inst(1, "param_0", "parameter", &[2, 3], &[]);
        p0.parameter_number = 0;
        let fused = HloComputationProto {
            name: "fused_computation".into(),
            id: 10,
            root_id: 2,
            is_fusion_computation: true,
            instructions: vec![p0.clone(), inst(2, "exp.1", "exponential", &[2, 3], &[1])],
        };
        let mut arg = inst(3, "Arg_0.1", "parameter", &[2, 3], &[]);
        arg.parameter_number = 0;
        let mut f = inst(4, "fusion", "fusion", &[2, 3], &[3]);
        f.fusion_kind = "kLoop".into();
        f.called_computation_ids = vec![10];
        let mut rw = inst(6, "reduce-window", "reduce-window", &[2, 2], &[3]);
        rw.window = Some(Window {
            dimensions: vec![
                WindowDimension {
                    size: 1,
                    stride: 1,
                    ..Default::default()
                },
                WindowDimension {
                    size: 3,
                    stride: 2,
                    padding_low: 1,
                    padding_high: 1,
                    ..Default::default()
                },
            ],
        });
        let mut pad = inst(7, "pad", "pad", &[2, 5], &[3]);
        pad.padding_config = Some(PaddingConfig {
            dimensions: vec![
                PaddingConfigDimension::default(),
                PaddingConfigDimension {
                    edge_padding_low: 1,
                    edge_padding_high: 1,
                    ..Default::default()
                },
            ],
        });
        let mut t = inst(5, "transpose", "transpose", &[3, 2], &[4]);
        t.dimensions = vec![1, 0];
        let entry = HloComputationProto {
            name: "main.5".into(),
            id: 11,
            root_id: 5,
            is_fusion_computation: false,
            instructions: vec![arg, f, rw, pad, t],
        };
        let module = HloModuleProto {
            name: "jit_main".into(),
            entry_computation_name: "main.5".into(),
            entry_computation_id: 11,
            computations: vec![fused, entry],
            stack_frame_index: None,
        };
        let bytes = HloModuleProtoWithConfig {
            hlo_module: Some(module),
        }
        .encode_to_vec();
        let text = hlo_text_from_proto(&bytes, true).unwrap();
        assert!(
            text.starts_with(
                "HloModule jit_main, entry_computation_layout={(f32[2,3]{1,0}) -> f32[3,2]{1,0}}"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "%fusion = f32[2,3]{1,0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_computation"
            ),
            "{text}"
        );
        assert!(
            text.contains("ROOT %transpose = f32[3,2]{1,0} transpose(%fusion), dimensions={1,0}"),
            "{text}"
        );
        assert!(
            text.contains("ENTRY %main.5 (Arg_0.1: f32[2,3]) -> f32[3,2] {"),
            "{text}"
        );
        assert!(
            text.contains("ROOT %exp.1 = f32[2,3]{1,0} exponential(%param_0)"),
            "{text}"
        );
        assert!(
            text.contains("reduce-window(%Arg_0.1), window={size=1x3 stride=1x2 pad=0_0x1_1}"),
            "{text}"
        );
        assert!(text.contains("pad(%Arg_0.1), padding=0_0x1_1"), "{text}");
        assert!(hlo_text_from_proto(b"\xff\xff", true).is_err());
    }
}
