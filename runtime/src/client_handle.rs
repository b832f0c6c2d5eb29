//! The `PJRT_Client` handle that a [`crate::Client`] and every buffer and executable made from
//! it share: the PJRT client is destroyed when the last of them is gone.

use super::api::{pjrt_call, Api, Args};
use super::plugin::Plugin;
use super::sys;

pub(crate) struct ClientInner {
    pub(crate) plugin: &'static Plugin,
    pub(crate) raw: *mut sys::PJRT_Client,
    /// Addressable devices; owned by the client, fixed for its life.
    pub(crate) devices: Vec<*mut sys::PJRT_Device>,
}

// SAFETY: PJRT clients are thread-safe (PjRtClient's contract), and the device
// pointers are immutable handles owned by the client.
unsafe impl Send for ClientInner {}
// SAFETY: see `Send`.
unsafe impl Sync for ClientInner {}

impl ClientInner {
    pub(crate) fn api(&self) -> &'static Api {
        &self.plugin.api
    }
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let mut args = sys::PJRT_Client_Destroy_Args::new();
        args.client = self.raw;
        // SAFETY: no executable or buffer of this client is left (they hold
        // an Arc to it), and the pointer is not used again.
        if let Err(e) = unsafe { pjrt_call!(self.api(), PJRT_Client_Destroy, &mut args) } {
            tracing::warn!("{e}");
        }
    }
}
