//! Host kernels for XLA's CPU plugin: custom calls that run a few ops faster than the plugin's
//! own code, registered with a plugin as typed XLA FFI handlers (through the runtime's
//! [`tpuc_runtime::Plugin::register_ffi_handler`]).
//!
//! - [`host_blas`]: f32 products through the BLAS PyTorch uses (MKL), whole or cut into
//!   one-thread pieces.
//! - [`host_conv`]: f32 convolutions and their gradients through oneDNN.
//! - [`host_rows`]: row kernels (layer norm).
//! - [`host_attention`]: attention of one head at a time in one-thread units.
//! - [`spin_helpers`]: the helper threads that join a kernel's units and stay awake briefly.
//! - `xla_ffi`: the XLA FFI plumbing they share (call frames, buffers, errors, registration once
//!   per plugin).
//!
//! The compiler decides where a custom call replaces an op (`tpuc_compiler`'s lowering); the
//! session registers the kernels with its plugin before compiling.

pub mod host_attention;
pub mod host_blas;
pub mod host_conv;
pub mod host_rows;
pub mod spin_helpers;
mod xla_ffi;
