//! Device buffers.

use std::ptr;
use std::sync::Arc;

use super::api::{pjrt_call, Args, Event};
use super::client_handle::ClientInner;
use super::{sys, ElementType, PjrtError};

/// An array on a device.
pub struct Buffer {
    pub(crate) client: Arc<ClientInner>,
    pub(crate) raw: *mut sys::PJRT_Buffer,
    /// Fires when the runtime no longer reads the host memory the buffer was
    /// made from (non-copying host semantics); awaited on drop.
    pub(crate) host_done: Option<Event>,
}

// SAFETY: PJRT buffers are thread-safe (PjRtBuffer's contract); the handle is
// only passed to PJRT. `host_done` is only touched in `drop`.
unsafe impl Send for Buffer {}
// SAFETY: see `Send`; `&Buffer` methods only make thread-safe PJRT calls.
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("element_type", &self.element_type().ok())
            .field("dims", &self.dims().ok())
            .finish()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        super::LIVE_BUFFERS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        let api = self.client.api();
        let mut args = sys::PJRT_Buffer_Destroy_Args::new();
        args.buffer = self.raw;
        // SAFETY: the buffer is live and not used after this.
        if let Err(e) = unsafe { pjrt_call!(api, PJRT_Buffer_Destroy, &mut args) } {
            tracing::warn!("{e}");
        }
        // After the destroy: a zero-copy buffer releases the host memory only
        // when it is gone, so waiting earlier would never finish.
        if let Some(done) = self.host_done.take() {
            if let Err(e) = done.wait("PJRT_Client_BufferFromHostBuffer (host release)") {
                tracing::warn!("{e}");
            }
        }
    }
}

impl Buffer {
    /// Takes ownership of a buffer handed out by PJRT.
    pub(crate) fn from_raw(
        client: Arc<ClientInner>,
        raw: *mut sys::PJRT_Buffer,
    ) -> Result<Buffer, PjrtError> {
        if raw.is_null() {
            return Err(PjrtError::Other("PJRT returned a null buffer".into()));
        }
        super::LIVE_BUFFERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Buffer {
            client,
            raw,
            host_done: None,
        })
    }

    pub fn dims(&self) -> Result<Vec<i64>, PjrtError> {
        let mut args = sys::PJRT_Buffer_Dimensions_Args::new();
        args.buffer = self.raw;
        // SAFETY: the buffer is live.
        unsafe { pjrt_call!(self.client.api(), PJRT_Buffer_Dimensions, &mut args) }?;
        if args.num_dims == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: the plugin returns `num_dims` dims owned by the buffer,
        // copied here while `self` is alive.
        Ok(unsafe { std::slice::from_raw_parts(args.dims, args.num_dims) }.to_vec())
    }

    pub fn element_type(&self) -> Result<ElementType, PjrtError> {
        let mut args = sys::PJRT_Buffer_ElementType_Args::new();
        args.buffer = self.raw;
        // SAFETY: the buffer is live.
        unsafe { pjrt_call!(self.client.api(), PJRT_Buffer_ElementType, &mut args) }?;
        ElementType::from_raw(args.type_)
            .ok_or_else(|| PjrtError::Other(format!("unsupported PJRT buffer type {}", args.type_)))
    }

    /// Bytes the buffer occupies on its device.
    pub fn on_device_size(&self) -> Result<usize, PjrtError> {
        let mut args = sys::PJRT_Buffer_OnDeviceSizeInBytes_Args::new();
        args.buffer = self.raw;
        // SAFETY: the buffer is live.
        unsafe {
            pjrt_call!(
                self.client.api(),
                PJRT_Buffer_OnDeviceSizeInBytes,
                &mut args
            )
        }?;
        Ok(args.on_device_size_in_bytes)
    }

    /// Address of the buffer's device memory (on the CPU plugin: host memory,
    /// equal to the host pointer when a zero-copy input was not copied).
    /// Only valid while the buffer lives.
    pub fn device_pointer(&self) -> Result<usize, PjrtError> {
        let mut args = sys::PJRT_Buffer_UnsafePointer_Args::new();
        args.buffer = self.raw;
        // SAFETY: the buffer is live.
        unsafe { pjrt_call!(self.client.api(), PJRT_Buffer_UnsafePointer, &mut args) }?;
        Ok(args.buffer_pointer)
    }

    /// Bytes [`Buffer::to_host`] writes (dense, row-major layout).
    pub fn host_size(&self) -> Result<usize, PjrtError> {
        let mut args = sys::PJRT_Buffer_ToHostBuffer_Args::new();
        args.src = self.raw;
        args.dst = ptr::null_mut(); // null asks for the size only
                                    // SAFETY: the buffer is live; with a null `dst` nothing is written.
        unsafe { pjrt_call!(self.client.api(), PJRT_Buffer_ToHostBuffer, &mut args) }?;
        Ok(args.dst_size)
    }

    /// Copies the buffer to host memory (dense, row-major) and waits for
    /// the copy. `len_bytes` must be at least [`Buffer::host_size`].
    ///
    /// # Safety
    /// `dst` must point to `len_bytes` writable bytes not accessed by anyone
    /// else until this returns.
    pub unsafe fn to_host(&self, dst: *mut u8, len_bytes: usize) -> Result<(), PjrtError> {
        let needed = self.host_size()?;
        if len_bytes < needed {
            return Err(PjrtError::Other(format!(
                "destination has {len_bytes} bytes, buffer needs {needed}"
            )));
        }
        // SAFETY: forwarded from the caller; the size was checked above.
        unsafe { self.copy_to_host(dst, needed) }
    }

    /// Copies the buffer into a new vector (dense, row-major bytes).
    pub fn to_host_vec(&self) -> Result<Vec<u8>, PjrtError> {
        let mut out = vec![0u8; self.host_size()?];
        // SAFETY: `out` is a private allocation of exactly the host size.
        unsafe { self.copy_to_host(out.as_mut_ptr(), out.len()) }?;
        Ok(out)
    }

    /// # Safety
    /// `dst` must point to `size` writable bytes, `size` == `host_size()`.
    unsafe fn copy_to_host(&self, dst: *mut u8, size: usize) -> Result<(), PjrtError> {
        if size == 0 {
            return Ok(());
        }
        let api = self.client.api();
        let mut args = sys::PJRT_Buffer_ToHostBuffer_Args::new();
        args.src = self.raw;
        args.dst = dst.cast();
        args.dst_size = size;
        // SAFETY: the buffer is live; the caller vouches for `dst`, which is
        // written only until the event below is ready.
        unsafe { pjrt_call!(api, PJRT_Buffer_ToHostBuffer, &mut args) }?;
        match Event::from_raw(api, args.event) {
            Some(event) => event.wait("PJRT_Buffer_ToHostBuffer (copy)"),
            None => Ok(()),
        }
    }
}
