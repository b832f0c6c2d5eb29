//! The typed graph IR that tpuc builds from an AOTAutograd FX graph.
//!
//! Python serializes the FX graph (core ATen, parameters as inputs, FakeTensor metadata) to
//! JSON in the format described by [`wire`]; [`import`] turns it into a [`Graph`]: a petgraph
//! of ops with typed results and symbolic dims kept symbolic. Anything the importer does not
//! understand becomes an [`ImportError`] that names the node and the op.

pub mod dot;
mod dtype;
mod graph;
mod import;
mod loc;
mod symbolic;
pub mod wire;

pub use dtype::DType;
pub use graph::{Arg, Graph, Input, InputKind, Node, NodeId, Output, TensorType, ValueRef};
pub use import::{import, import_json, ImportError, HIGHER_ORDER};
pub use loc::{Frame, SourceLoc};
pub use symbolic::{Dim, SymExpr, SymbolError};
