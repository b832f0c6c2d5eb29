//! Which ops a session sends to the CPU host kernels (`tpuc_hostkernels`): each kind is on once
//! registered with the plugin, and off on any other plugin than the CPU one (whose buffers are
//! host memory). The engine lowers with these settings.

use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};

use tpuc_runtime::{PjrtError, Plugin};

/// The host-kernel settings of one engine.
pub(crate) struct HostKernels {
    plugin: &'static Plugin,
    /// Whether the plugin is the CPU one; every kind stays off otherwise.
    on_cpu: bool,
    /// f32 products of at least this many multiply-adds go to the host BLAS (0: none).
    gemm_min_macs: AtomicU64,
    /// 2-D f32 convolutions go to oneDNN.
    conv: AtomicBool,
    /// Large f32 layer norms (and CPU attention) go to the host row kernels.
    rows: AtomicBool,
}

impl HostKernels {
    /// Every kind off.
    pub(crate) fn new(plugin: &'static Plugin, on_cpu: bool) -> HostKernels {
        HostKernels {
            plugin,
            on_cpu,
            gemm_min_macs: AtomicU64::new(0),
            conv: AtomicBool::new(false),
            rows: AtomicBool::new(false),
        }
    }

    /// See [`crate::pipeline::Engine::enable_host_gemm`].
    pub(crate) fn enable_gemm(&self, library: &Path, min_macs: u64) -> Result<bool, PjrtError> {
        if min_macs == 0 || !self.on_cpu {
            self.gemm_min_macs.store(0, Relaxed);
            return Ok(min_macs == 0);
        }
        let ok = tpuc_hostkernels::host_blas::register(self.plugin, library)?;
        self.gemm_min_macs
            .store(if ok { min_macs } else { 0 }, Relaxed);
        Ok(ok)
    }

    /// The fewest multiply-adds an f32 product has to go to the host BLAS; None when products
    /// stay in XLA.
    pub(crate) fn gemm_min_macs(&self) -> Option<u64> {
        Some(self.gemm_min_macs.load(Relaxed)).filter(|&m| m > 0)
    }

    /// See [`crate::pipeline::Engine::enable_host_conv`].
    pub(crate) fn enable_conv(&self, library: Option<&str>) -> Result<bool, PjrtError> {
        let ok = match library {
            Some(lib) if self.on_cpu => tpuc_hostkernels::host_conv::register(self.plugin, lib)?,
            _ => false,
        };
        self.conv.store(ok, Relaxed);
        Ok(ok)
    }

    /// Whether 2-D f32 convolutions go to oneDNN.
    pub(crate) fn conv(&self) -> bool {
        self.conv.load(Relaxed)
    }

    /// See [`crate::pipeline::Engine::enable_host_rows`].
    pub(crate) fn enable_rows(&self, on: bool) -> Result<bool, PjrtError> {
        let ok = on
            && self.on_cpu
            && tpuc_hostkernels::host_rows::register(self.plugin)?
            && tpuc_hostkernels::host_attention::register(self.plugin)?;
        self.rows.store(ok, Relaxed);
        Ok(ok)
    }

    /// Whether large f32 layer norms go to the host row kernels.
    pub(crate) fn rows(&self) -> bool {
        self.rows.load(Relaxed)
    }
}
