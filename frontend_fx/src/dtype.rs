use serde::{Deserialize, Serialize};

/// Element types, named as PyTorch names them (`torch.float32` -> `"float32"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    Float64,
    Float32,
    Float16,
    Bfloat16,
    Int64,
    Int32,
    Int16,
    Int8,
    Uint8,
    /// Only as the result of `hash_tensor` (Python keeps every other uint64 op in PyTorch).
    Uint64,
    Bool,
    Complex64,
    Complex128,
}

impl DType {
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::Float64 | DType::Float32 | DType::Float16 | DType::Bfloat16
        )
    }

    pub fn is_complex(self) -> bool {
        matches!(self, DType::Complex64 | DType::Complex128)
    }

    /// The real type of a complex dtype's parts (the dtype itself when not complex).
    pub fn real_part(self) -> DType {
        match self {
            DType::Complex64 => DType::Float32,
            DType::Complex128 => DType::Float64,
            d => d,
        }
    }

    /// The complex dtype whose parts are this float dtype (complex64 for narrower floats).
    pub fn to_complex(self) -> DType {
        match self {
            DType::Float64 | DType::Complex128 => DType::Complex128,
            _ => DType::Complex64,
        }
    }

    pub fn byte_size(self) -> usize {
        match self {
            DType::Complex128 => 16,
            DType::Float64 | DType::Int64 | DType::Uint64 | DType::Complex64 => 8,
            DType::Float32 | DType::Int32 => 4,
            DType::Float16 | DType::Bfloat16 | DType::Int16 => 2,
            DType::Int8 | DType::Uint8 | DType::Bool => 1,
        }
    }

    /// PyTorch's name (`float32`), the same string the wire format uses.
    pub fn name(self) -> &'static str {
        match self {
            DType::Float64 => "float64",
            DType::Float32 => "float32",
            DType::Float16 => "float16",
            DType::Bfloat16 => "bfloat16",
            DType::Int64 => "int64",
            DType::Int32 => "int32",
            DType::Int16 => "int16",
            DType::Int8 => "int8",
            DType::Uint8 => "uint8",
            DType::Uint64 => "uint64",
            DType::Bool => "bool",
            DType::Complex64 => "complex64",
            DType::Complex128 => "complex128",
        }
    }

    pub fn from_name(name: &str) -> Option<DType> {
        Some(match name {
            "float64" | "double" => DType::Float64,
            "float32" | "float" => DType::Float32,
            "float16" | "half" => DType::Float16,
            "bfloat16" => DType::Bfloat16,
            "int64" | "long" => DType::Int64,
            "int32" | "int" => DType::Int32,
            "int16" | "short" => DType::Int16,
            "int8" => DType::Int8,
            "uint8" => DType::Uint8,
            "uint64" => DType::Uint64,
            "bool" => DType::Bool,
            "complex64" | "cfloat" => DType::Complex64,
            "complex128" | "cdouble" => DType::Complex128,
            _ => return None,
        })
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
