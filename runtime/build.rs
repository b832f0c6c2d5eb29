//! Generates Rust bindings for the PJRT C API (`pjrt_c_api.h`).
//!
//! The header ships with the CPU plugin wheel; it only includes standard C
//! headers, so bindgen needs nothing but libclang.

use std::env;
use std::path::{Path, PathBuf};

const HEADER_ENV: &str = "TPUC_PJRT_HEADER";
const HEADER_IN_WHEEL: &str = "xla_plugins/xla_cpu_pjrt/include/pjrt_c_api.h";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed={HEADER_ENV}");

    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let workspace_root = manifest_dir.parent().expect("runtime/ has a parent");
    let header = find_header(workspace_root);
    println!("cargo:rerun-if-changed={}", header.display());

    let bindings = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .allowlist_item("PJRT_.*")
        // Plain integer constants: the plugin may hand back enum values this
        // header does not know, which would be UB for a Rust enum.
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_debug(false)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate()
        .unwrap_or_else(|e| panic!("bindgen failed on {}: {e}", header.display()));

    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR")).join("pjrt_c_api.rs");
    bindings
        .write_to_file(&out)
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}

fn find_header(workspace_root: &Path) -> PathBuf {
    if let Some(p) = env::var_os(HEADER_ENV) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            panic!("{HEADER_ENV}={} does not name a file", p.display());
        }
        return p;
    }
    // <root>/.venv/lib/python3*/site-packages/xla_plugins/xla_cpu_pjrt/include/pjrt_c_api.h
    let lib = workspace_root.join(".venv/lib");
    let mut candidates: Vec<PathBuf> = std::fs::read_dir(&lib)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join("site-packages").join(HEADER_IN_WHEEL))
        .filter(|p| p.is_file())
        .collect();
    candidates.sort();
    match candidates.pop() {
        Some(p) => p,
        None => panic!(
            "pjrt_c_api.h not found (looked for {}/python3*/site-packages/{HEADER_IN_WHEEL}).\n\
             Install the CPU PJRT plugin into the workspace venv:\n    \
             .venv/bin/pip install --no-deps xla-cpu-pjrt==0.0.1\n\
             or set {HEADER_ENV}=/path/to/pjrt_c_api.h",
            lib.display()
        ),
    }
}
