//! Where the Rust side's logs go.

/// Routes Rust logs: to stderr through `tracing-subscriber` when `TPUC_LOG` is set (its value is
/// the filter), else into Python's `logging` (loggers named after the Rust modules).
pub(crate) fn init_logging() {
    if let Ok(filter) = std::env::var("TPUC_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    } else {
        let _ = pyo3_log::try_init();
    }
}
