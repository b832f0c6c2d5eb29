//! Tests against the real CPU plugin (`xla-cpu-pjrt` in the workspace venv,
//! or `$TPUC_PJRT_PLUGIN`).

use std::time::Instant;

use super::*;

const ADD_MUL: &str = r#"
module {
  func.func @main(%a: tensor<2x3xf32>, %b: tensor<2x3xf32>) -> (tensor<2x3xf32>, tensor<2x3xf32>) {
    %0 = stablehlo.add %a, %b : tensor<2x3xf32>
    %1 = stablehlo.multiply %a, %b : tensor<2x3xf32>
    return %0, %1 : tensor<2x3xf32>, tensor<2x3xf32>
  }
}
"#;

const A: [f32; 6] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
const B: [f32; 6] = [0.5, -1.0, 2.0, 10.0, 0.0, -3.0];

fn plugin() -> &'static Plugin {
    let path = default_cpu_plugin_path().expect(
        "CPU PJRT plugin not found: `.venv/bin/pip install --no-deps xla-cpu-pjrt==0.0.1` \
         or set TPUC_PJRT_PLUGIN",
    );
    load_plugin(&path).expect("load CPU plugin")
}

fn client() -> Client {
    Client::new(plugin(), &[]).expect("create client")
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// Uploads a [2, 3] float32 array to device `dev` (with a copy).
fn upload_2x3_on(c: &Client, v: &[f32], dev: usize) -> Buffer {
    let bytes = f32_bytes(v);
    // SAFETY: `bytes` is valid for the call, which copies it.
    unsafe {
        c.buffer_from_host(
            bytes.as_ptr(),
            24,
            ElementType::F32,
            &[2, 3],
            HostBufferSemantics::ImmutableOnlyDuringCall,
            dev,
        )
    }
    .expect("upload")
}

/// Uploads with a copy, which is always safe.
fn upload(client: &Client, bytes: &[u8], ty: ElementType, dims: &[i64]) -> Buffer {
    // SAFETY: `bytes` is valid for the call, which copies it.
    unsafe {
        client.buffer_from_host(
            bytes.as_ptr(),
            bytes.len(),
            ty,
            dims,
            HostBufferSemantics::ImmutableOnlyDuringCall,
            0,
        )
    }
    .expect("upload")
}

fn check_add_mul(outputs: &[Buffer]) {
    assert_eq!(outputs.len(), 2, "two results come back as two buffers");
    for o in outputs {
        assert_eq!(o.dims().unwrap(), vec![2, 3]);
        assert_eq!(o.element_type().unwrap(), ElementType::F32);
    }
    let sum: Vec<f32> = A.iter().zip(B).map(|(a, b)| a + b).collect();
    let prod: Vec<f32> = A.iter().zip(B).map(|(a, b)| a * b).collect();
    assert_eq!(bytes_f32(&outputs[0].to_host_vec().unwrap()), sum);
    assert_eq!(bytes_f32(&outputs[1].to_host_vec().unwrap()), prod);
}

#[test]
fn default_compile_options_encode_to_known_bytes() {
    assert_eq!(
        CompileOptions::default().encode(),
        [0x1a, 0x04, 0x20, 0x01, 0x28, 0x01]
    );
    let spmd = CompileOptions {
        num_replicas: 1,
        num_partitions: 2,
        use_spmd_partitioning: true,
        ..CompileOptions::default()
    };
    assert_eq!(
        spmd.encode(),
        [0x1a, 0x06, 0x20, 0x01, 0x28, 0x02, 0x30, 0x01]
    );
}

#[test]
fn xla_options_encode_as_env_option_overrides() {
    let name = "xla_cpu_experimental_ynn_fusion_type";
    let mut opts = CompileOptions::default();
    opts.xla_options
        .insert(name.into(), XlaOption::Str(String::new()));
    opts.xla_options
        .insert("a_flag".into(), XlaOption::Bool(false));
    // Field 7 (map entries: key = 1, value = 2), entries sorted by name; a oneof field is
    // written even at its default, so `false` and "" are explicit.
    let mut want = vec![0x1a, 0x04, 0x20, 0x01, 0x28, 0x01];
    want.extend([0x3a, 12, 0x0a, 6]);
    want.extend(b"a_flag");
    want.extend([0x12, 0x02, 0x10, 0x00]);
    want.extend([0x3a, 2 + name.len() as u8 + 4, 0x0a, name.len() as u8]);
    want.extend(name.as_bytes());
    want.extend([0x12, 0x02, 0x0a, 0x00]);
    assert_eq!(opts.encode(), want);
    let mut int = CompileOptions::default();
    int.xla_options.insert("n".into(), XlaOption::Int(300));
    assert_eq!(
        int.encode()[6..],
        [0x3a, 0x08, 0x0a, 0x01, b'n', 0x12, 0x03, 0x18, 0xac, 0x02]
    );
}

/// A matrix product and a row sum: XLA:CPU makes YNNPACK fusions of both by default.
const DOT_SUM: &str = r#"
module {
  func.func @main(%a: tensor<64x64xf32>, %b: tensor<64x64xf32>) -> (tensor<64x64xf32>, tensor<64xf32>) {
    %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
    %z = stablehlo.constant dense<0.0> : tensor<f32>
    %1 = stablehlo.reduce(%a init: %z) applies stablehlo.add across dimensions = [1] : (tensor<64x64xf32>, tensor<f32>) -> tensor<64xf32>
    return %0, %1 : tensor<64x64xf32>, tensor<64xf32>
  }
}
"#;

/// The CPU plugin on PyPI built from a newer XLA (tpuc's default CPU plugin where installed),
/// which makes YNNPACK fusions; None where it is not installed.
fn ynn_plugin() -> Option<&'static Plugin> {
    let workspace_root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent()?;
    std::fs::read_dir(workspace_root.join(".venv/lib"))
        .ok()?
        .flatten()
        .map(|e| {
            e.path()
                .join("site-packages/lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so")
        })
        .find(|p| p.is_file())
        .map(|p| load_plugin(&p).expect("load the newer CPU plugin"))
}

fn ynn_off() -> CompileOptions {
    let mut off = CompileOptions::default();
    off.xla_options.insert(
        "xla_cpu_experimental_ynn_fusion_type".into(),
        XlaOption::Str(String::new()),
    );
    off
}

#[test]
fn the_plugin_reads_xla_options() {
    let c = client();
    // An option XLA does not have fails the compile, naming it: the overrides are read.
    let mut unknown = CompileOptions::default();
    unknown
        .xla_options
        .insert("no_such_xla_option".into(), XlaOption::Bool(true));
    let err = c.compile(DOT_SUM, &unknown).unwrap_err().to_string();
    assert!(err.contains("no_such_xla_option"), "{err}");
    c.compile(DOT_SUM, &ynn_off()).unwrap();
}

#[test]
fn the_plugin_applies_xla_options_per_compile() {
    let Some(p) = ynn_plugin() else {
        eprintln!(
            "skipped: lammps-jax-pjrt-cpu (the plugin that makes YNNPACK fusions) not installed"
        );
        return;
    };
    let c = Client::new(p, &[]).unwrap();
    let hlo = |opts: &CompileOptions| {
        let exe = c.compile(DOT_SUM, opts).unwrap();
        exe.optimized_hlo_text().unwrap().unwrap()
    };
    let default = hlo(&CompileOptions::default());
    assert_eq!(default.matches("kind=kCustom").count(), 2, "{default}");
    assert!(default.contains("__ynn_fusion"), "{default}");
    let without = hlo(&ynn_off());
    assert!(!without.contains("ynn_fusion"), "{without}");
    assert!(without.contains("dot("), "{without}");
    // The next compile without the option makes them again: the option was one compile's.
    assert_eq!(hlo(&CompileOptions::default()), default);
}

#[test]
fn loads_plugin_once_and_creates_client() {
    let p = plugin();
    assert!(std::ptr::eq(p, plugin()), "same plugin for the same path");
    assert_eq!(p.api_version().0, 0);
    assert!(p.api_version().1 > 0);
    let c = client();
    assert_eq!(c.platform_name().unwrap(), "cpu");
    assert!(!c.platform_version().unwrap().is_empty());
    assert!(c.addressable_device_count() >= 1);
}

#[test]
fn plugin_identity_is_a_stable_file_hash() {
    let p = plugin();
    let id = p.identity();
    assert_ne!(id, [0u8; 32]);
    assert_eq!(id, p.identity());
}

#[test]
fn cpu_device_count_option() {
    let c = Client::new(plugin(), &cpu_device_options(Some(4))).unwrap();
    assert_eq!(c.addressable_device_count(), 4);
    let c = Client::new(plugin(), &cpu_device_options(Some(2))).unwrap();
    assert_eq!(c.addressable_device_count(), 2);
}

#[test]
fn plugin_reports_its_stablehlo_versions() {
    let (current, minimum) = plugin()
        .stablehlo_versions()
        .expect("the CPU plugin reports stablehlo_current_version and stablehlo_minimum_version");
    assert_eq!((current.len(), minimum.len()), (3, 3));
    assert!(
        minimum <= current && current >= vec![1, 0, 0],
        "{minimum:?} {current:?}"
    );
}

#[test]
fn compile_and_execute_copied_inputs() {
    let c = client();
    let exe = c.compile(ADD_MUL, &CompileOptions::default()).unwrap();
    assert_eq!(exe.num_outputs().unwrap(), 2);
    assert_eq!(exe.num_devices(), 1);
    let a = upload(&c, &f32_bytes(&A), ElementType::F32, &[2, 3]);
    let b = upload(&c, &f32_bytes(&B), ElementType::F32, &[2, 3]);
    assert_eq!(a.on_device_size().unwrap(), 24);
    check_add_mul(&exe.execute(&[&a, &b]).unwrap());
    // Inputs are not donated: they stay usable.
    check_add_mul(&exe.execute(&[&a, &b]).unwrap());
    assert_eq!(bytes_f32(&a.to_host_vec().unwrap()), A);
}

/// 64-byte aligned storage for zero-copy tests.
#[repr(C, align(64))]
struct Aligned([u8; 128]);

#[test]
fn execute_zero_copy_and_until_transfer_inputs() {
    let c = client();
    let exe = c.compile(ADD_MUL, &CompileOptions::default()).unwrap();
    let mut a_store = Box::new(Aligned([0; 128]));
    let mut b_store = Box::new(Aligned([0; 128]));
    for offset in [0usize, 4, 16, 32] {
        a_store.0[offset..offset + 24].copy_from_slice(&f32_bytes(&A));
        b_store.0[offset..offset + 24].copy_from_slice(&f32_bytes(&B));
        let a_ptr = a_store.0[offset..].as_ptr();
        let b_ptr = b_store.0[offset..].as_ptr();
        // SAFETY: the stores outlive the buffers (dropped at the end of the
        // loop body) and are not modified while they live.
        let (a, b) = unsafe {
            (
                c.buffer_from_host(
                    a_ptr,
                    24,
                    ElementType::F32,
                    &[2, 3],
                    HostBufferSemantics::ImmutableZeroCopy,
                    0,
                )
                .unwrap(),
                c.buffer_from_host(
                    b_ptr,
                    24,
                    ElementType::F32,
                    &[2, 3],
                    HostBufferSemantics::ImmutableUntilTransferCompletes,
                    0,
                )
                .unwrap(),
            )
        };
        let aliased = a.device_pointer().unwrap() == a_ptr as usize;
        println!("zero-copy input at 64-byte alignment + {offset}: aliased = {aliased}");
        if offset == 0 {
            assert!(aliased, "an aligned zero-copy input is not copied");
        }
        check_add_mul(&exe.execute(&[&a, &b]).unwrap());
    }
}

#[test]
fn serialize_deserialize_roundtrip() {
    let c = client();
    let exe = c.compile(ADD_MUL, &CompileOptions::default()).unwrap();
    assert!(!exe.is_deserialized());
    let blob = exe.serialize().unwrap();
    let t = Instant::now();
    let exe2 = c.deserialize(&blob).unwrap();
    println!("deserialize: {:?} for {} bytes", t.elapsed(), blob.len());
    assert!(exe2.is_deserialized());
    assert_eq!(exe2.num_outputs().unwrap(), 2);
    let a = upload(&c, &f32_bytes(&A), ElementType::F32, &[2, 3]);
    let b = upload(&c, &f32_bytes(&B), ElementType::F32, &[2, 3]);
    let r1: Vec<Vec<u8>> = exe
        .execute(&[&a, &b])
        .unwrap()
        .iter()
        .map(|o| o.to_host_vec().unwrap())
        .collect();
    let r2: Vec<Vec<u8>> = exe2
        .execute(&[&a, &b])
        .unwrap()
        .iter()
        .map(|o| o.to_host_vec().unwrap())
        .collect();
    assert_eq!(r1, r2);
    // Also works in another client of the same plugin.
    let c2 = client();
    let exe3 = c2.deserialize(&blob).unwrap();
    let a = upload(&c2, &f32_bytes(&A), ElementType::F32, &[2, 3]);
    let b = upload(&c2, &f32_bytes(&B), ElementType::F32, &[2, 3]);
    check_add_mul(&exe3.execute(&[&a, &b]).unwrap());
}

#[test]
fn malformed_module_reports_parser_message() {
    let c = client();
    let err = c
        .compile("module { func.func @main( -> }", &CompileOptions::default())
        .unwrap_err();
    let msg = err.to_string();
    println!("{msg}");
    assert!(
        matches!(
            err,
            PjrtError::Call {
                function: "PJRT_Client_Compile",
                ..
            }
        ),
        "{msg}"
    );
    assert!(msg.contains("expected"), "parser message missing: {msg}");

    // Parses, but does not verify (operand types differ).
    let bad = "module { func.func @main(%a: tensor<2xf32>, %b: tensor<3xf32>) -> tensor<2xf32> { \
               %0 = stablehlo.add %a, %b : (tensor<2xf32>, tensor<3xf32>) -> tensor<2xf32> \
               return %0 : tensor<2xf32> } }";
    let err = c.compile(bad, &CompileOptions::default()).unwrap_err();
    println!("{err}");
    assert!(matches!(err, PjrtError::Call { .. }));
}

#[test]
fn loading_a_non_plugin_fails_cleanly() {
    let dir = std::env::temp_dir().join(format!("tpuc-pjrt-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let junk = dir.join("junk.so");
    std::fs::write(&junk, b"not an ELF file").unwrap();
    let err = load_plugin(&junk).unwrap_err();
    assert!(matches!(err, PjrtError::Load { .. }), "{err}");
    println!("{err}");
    std::fs::remove_dir_all(&dir).ok();

    let missing = load_plugin(std::path::Path::new("/nonexistent/plugin.so")).unwrap_err();
    assert!(matches!(missing, PjrtError::Load { .. }), "{missing}");

    // An executable (PIE) cannot be dlopen'ed.
    if std::path::Path::new("/bin/ls").exists() {
        let err = load_plugin(std::path::Path::new("/bin/ls")).unwrap_err();
        assert!(matches!(err, PjrtError::Load { .. }), "{err}");
        println!("{err}");
    }
    // A real shared library without the entry point.
    for lib in [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib64/libm.so.6",
    ] {
        if std::path::Path::new(lib).exists() {
            let err = load_plugin(std::path::Path::new(lib)).unwrap_err();
            assert!(
                err.to_string()
                    .contains("not a PJRT plugin: no GetPjrtApi symbol"),
                "{err}"
            );
            break;
        }
    }
}

#[test]
fn bf16_i64_pred_roundtrip() {
    let c = client();
    let module = r#"
module {
  func.func @main(%x: tensor<3xbf16>, %i: tensor<2x2xi64>, %p: tensor<4xi1>)
      -> (tensor<3xbf16>, tensor<2x2xi64>, tensor<4xi1>) {
    %0 = stablehlo.add %x, %x : tensor<3xbf16>
    %1 = stablehlo.multiply %i, %i : tensor<2x2xi64>
    %2 = stablehlo.not %p : tensor<4xi1>
    return %0, %1, %2 : tensor<3xbf16>, tensor<2x2xi64>, tensor<4xi1>
  }
}
"#;
    let exe = c.compile(module, &CompileOptions::default()).unwrap();
    let bf16 = |x: f32| ((x.to_bits() >> 16) as u16).to_ne_bytes();
    let x: Vec<u8> = [1.5f32, -2.0, 0.25].into_iter().flat_map(bf16).collect();
    let ints: [i64; 4] = [3, -4, 1 << 20, i64::from(i32::MAX)];
    let i: Vec<u8> = ints.iter().flat_map(|v| v.to_ne_bytes()).collect();
    let p: Vec<u8> = vec![1, 0, 0, 1];
    let xb = upload(&c, &x, ElementType::BF16, &[3]);
    let ib = upload(&c, &i, ElementType::S64, &[2, 2]);
    let pb = upload(&c, &p, ElementType::Pred, &[4]);
    // Inputs round-trip unchanged.
    assert_eq!(xb.to_host_vec().unwrap(), x);
    assert_eq!(ib.to_host_vec().unwrap(), i);
    assert_eq!(pb.to_host_vec().unwrap(), p);
    let out = exe.execute(&[&xb, &ib, &pb]).unwrap();
    assert_eq!(out.len(), 3);
    assert_eq!(out[0].element_type().unwrap(), ElementType::BF16);
    assert_eq!(out[1].element_type().unwrap(), ElementType::S64);
    assert_eq!(out[2].element_type().unwrap(), ElementType::Pred);
    let want_x: Vec<u8> = [3.0f32, -4.0, 0.5].into_iter().flat_map(bf16).collect();
    assert_eq!(out[0].to_host_vec().unwrap(), want_x);
    let want_i: Vec<u8> = ints.iter().flat_map(|v| (v * v).to_ne_bytes()).collect();
    assert_eq!(out[1].to_host_vec().unwrap(), want_i);
    assert_eq!(out[2].to_host_vec().unwrap(), vec![0, 1, 1, 0]);
}

#[test]
fn bad_calls_are_errors_not_crashes() {
    let c = client();
    let exe = c.compile(ADD_MUL, &CompileOptions::default()).unwrap();
    let bytes = f32_bytes(&A);
    // Wrong byte count for the shape.
    // SAFETY: `bytes` is valid for the call.
    let r = unsafe {
        c.buffer_from_host(
            bytes.as_ptr(),
            20,
            ElementType::F32,
            &[2, 3],
            HostBufferSemantics::ImmutableOnlyDuringCall,
            0,
        )
    };
    assert!(r.is_err());
    // Device out of range.
    // SAFETY: as above.
    let r = unsafe {
        c.buffer_from_host(
            bytes.as_ptr(),
            24,
            ElementType::F32,
            &[2, 3],
            HostBufferSemantics::ImmutableOnlyDuringCall,
            99,
        )
    };
    assert!(r.is_err());
    let a = upload(&c, &bytes, ElementType::F32, &[2, 3]);
    // Wrong number of arguments.
    let err = exe.execute(&[&a]).unwrap_err();
    println!("{err}");
    // Wrong shape.
    let small = upload(&c, &bytes[..8], ElementType::F32, &[2]);
    let err = exe.execute(&[&a, &small]).unwrap_err();
    println!("{err}");
    // Buffer of another client.
    let other = client();
    let foreign = upload(&other, &bytes, ElementType::F32, &[2, 3]);
    assert!(exe.execute(&[&a, &foreign]).is_err());
    // Destination too small.
    let mut dst = [0u8; 8];
    // SAFETY: `dst` has 8 writable bytes; the call fails before writing.
    assert!(unsafe { a.to_host(dst.as_mut_ptr(), dst.len()) }.is_err());
}

#[test]
fn execute_sharded_over_two_replicas() {
    let c = Client::new(plugin(), &cpu_device_options(Some(4))).unwrap();
    let opts = CompileOptions {
        num_replicas: 2,
        ..CompileOptions::default()
    };
    let exe = c.compile(ADD_MUL, &opts).unwrap();
    assert_eq!(exe.num_devices(), 2);
    let a0 = upload_2x3_on(&c, &A, 0);
    let b0 = upload_2x3_on(&c, &B, 0);
    let a1 = upload_2x3_on(&c, &B, 1);
    let b1 = upload_2x3_on(&c, &A, 1);
    let out = exe
        .execute_sharded(&[vec![&a0, &b0], vec![&a1, &b1]])
        .unwrap();
    assert_eq!(out.len(), 2);
    check_add_mul(&out[0]);
    // Swapped operands: the same sums and products.
    check_add_mul(&out[1]);
}

#[test]
fn concurrent_execution_from_threads() {
    let c = client();
    let exe = c.compile(ADD_MUL, &CompileOptions::default()).unwrap();
    let a = upload(&c, &f32_bytes(&A), ElementType::F32, &[2, 3]);
    let b = upload(&c, &f32_bytes(&B), ElementType::F32, &[2, 3]);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..50 {
                    check_add_mul(&exe.execute(&[&a, &b]).unwrap());
                }
            });
        }
    });
}

#[test]
fn optional_introspection() {
    let c = client();
    let exe = c.compile(ADD_MUL, &CompileOptions::default()).unwrap();
    match exe.optimized_program() {
        Ok((format, code)) => {
            println!("optimized program: format {format:?}, {} bytes", code.len())
        }
        Err(e) => println!("optimized program: {e}"),
    }
    println!(
        "optimized hlo text: {:?}",
        exe.optimized_hlo_text().map(|o| o.map(|s| s.len()))
    );
    println!("fingerprint: {:?}", exe.fingerprint());
}

#[test]
fn timing_report() {
    let c = client();
    let t = Instant::now();
    let exe = c.compile(ADD_MUL, &CompileOptions::default()).unwrap();
    let compile = t.elapsed();
    let bytes_a = f32_bytes(&A);
    let a = upload(&c, &bytes_a, ElementType::F32, &[2, 3]);
    let b = upload(&c, &f32_bytes(&B), ElementType::F32, &[2, 3]);
    let n = 200u32;
    let t = Instant::now();
    for _ in 0..n {
        drop(exe.execute(&[&a, &b]).unwrap());
    }
    let execute = t.elapsed() / n;
    let t = Instant::now();
    for _ in 0..n {
        drop(upload(&c, &bytes_a, ElementType::F32, &[2, 3]));
    }
    let h2d = t.elapsed() / n;
    let out = exe.execute(&[&a, &b]).unwrap();
    let t = Instant::now();
    for _ in 0..n {
        out[0].to_host_vec().unwrap();
    }
    let d2h = t.elapsed() / n;
    println!(
        "compile {compile:?}, execute {execute:?}, host->device {h2d:?}, device->host {d2h:?}"
    );
}

#[test]
fn reserializing_a_deserialized_executable_is_refused() {
    // The CPU plugin re-serializes a deserialized executable into a smaller
    // blob that later fails in Execute ("Function ... not found"), so such a
    // blob must never reach a cache.
    let c = client();
    let blob = c
        .compile(ADD_MUL, &CompileOptions::default())
        .unwrap()
        .serialize()
        .unwrap();
    let err = c.deserialize(&blob).unwrap().serialize().unwrap_err();
    assert!(err.to_string().contains("deserialized"), "{err}");
}

#[test]
fn empty_and_scalar_buffers() {
    let c = client();
    let empty = upload(&c, &[], ElementType::F32, &[0, 3]);
    assert_eq!(empty.dims().unwrap(), vec![0, 3]);
    assert_eq!(empty.to_host_vec().unwrap(), Vec::<u8>::new());
    let scalar = upload(&c, &1.5f32.to_ne_bytes(), ElementType::F32, &[]);
    assert_eq!(scalar.dims().unwrap(), Vec::<i64>::new());
    assert_eq!(scalar.to_host_vec().unwrap(), 1.5f32.to_ne_bytes());
}

#[test]
fn functions_beyond_an_old_plugins_table_are_missing_not_read() {
    // A table that ends just before PJRT_Client_Create, as an older plugin's
    // would, with a null PJRT_Plugin_Initialize.
    let raw = sys::PJRT_Api {
        struct_size: std::mem::offset_of!(sys::PJRT_Api, PJRT_Client_Create),
        pjrt_api_version: sys::PJRT_Api_Version {
            struct_size: sys::PJRT_Api_Version_STRUCT_SIZE as usize,
            major_version: 0,
            minor_version: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    // SAFETY: `raw` outlives `api`, which is only used in this test.
    let api = unsafe { api::Api::new(&raw) }.unwrap();
    assert_eq!(api.version(), (0, 1));
    let err = api::pjrt_fn!(&api, PJRT_Client_Create).unwrap_err();
    assert!(
        matches!(
            err,
            PjrtError::Missing {
                function: "PJRT_Client_Create",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "PJRT plugin (API 0.1) does not provide PJRT_Client_Create"
    );
    let err = api::pjrt_fn!(&api, PJRT_Plugin_Initialize).unwrap_err();
    assert!(matches!(err, PjrtError::Missing { .. }), "{err}");
}

/// A sum over a dim split across two partitions: XLA's SPMD partitioner must insert the
/// all-reduce, and every device gets the full (replicated) result.
const SPMD_SUM: &str = r#"
module @m attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<4x3xf32> {mhlo.sharding = "{devices=[2,1]0,1}"})
      -> (tensor<3xf32> {mhlo.sharding = "{replicated}"}) {
    %c = stablehlo.constant dense<0.0> : tensor<f32>
    %r = stablehlo.reduce(%arg0 init: %c) applies stablehlo.add across dimensions = [0]
      : (tensor<4x3xf32>, tensor<f32>) -> tensor<3xf32>
    return %r : tensor<3xf32>
  }
}
"#;

#[test]
fn spmd_partitioned_sum_all_reduces_across_devices() {
    let c = Client::new(plugin(), &cpu_device_options(Some(4))).unwrap();
    let opts = CompileOptions {
        num_replicas: 1,
        num_partitions: 2,
        use_spmd_partitioning: true,
        ..CompileOptions::default()
    };
    let exe = c.compile(SPMD_SUM, &opts).unwrap();
    assert_eq!(exe.num_devices(), 2);
    // Rows 0-1 of the global [4, 3] array on device 0, rows 2-3 on device 1.
    let (a0, a1) = (upload_2x3_on(&c, &A, 0), upload_2x3_on(&c, &B, 1));
    let out = exe.execute_sharded(&[vec![&a0], vec![&a1]]).unwrap();
    let expected: Vec<f32> = (0..3).map(|j| A[j] + A[3 + j] + B[j] + B[3 + j]).collect();
    for device in &out {
        assert_eq!(device[0].dims().unwrap(), vec![3]);
        assert_eq!(bytes_f32(&device[0].to_host_vec().unwrap()), expected);
    }
    let hlo = exe.optimized_hlo_text().unwrap().unwrap();
    assert!(hlo.contains("all-reduce("), "{hlo}");
}

/// `stablehlo.composite` (what the `composites` fusion pass makes lowering emit): two call sites
/// share one private decomposition function, in the generic form tpuc prints. The plugin must
/// compile it and compute the decomposition.
const COMPOSITE: &str = r#"
"builtin.module"() ({
  "func.func"() <{function_type = (tensor<2x3xf32>, tensor<2x3xf32>) -> (tensor<2x3xf32>, tensor<2x3xf32>), sym_name = "main"}> ({
  ^bb0(%a: tensor<2x3xf32>, %b: tensor<2x3xf32>):
    %0 = "stablehlo.composite"(%a, %b) {name = "tpuc.add_mul", composite_attributes = {k = 2 : i64}, decomposition = @tpuc.add_mul.0, version = 0 : i32} : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
    %1 = "stablehlo.composite"(%0, %b) {name = "tpuc.add_mul", composite_attributes = {k = 2 : i64}, decomposition = @tpuc.add_mul.0, version = 0 : i32} : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
    "func.return"(%0, %1) : (tensor<2x3xf32>, tensor<2x3xf32>) -> ()
  }) : () -> ()
  "func.func"() <{function_type = (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>, sym_name = "tpuc.add_mul.0", sym_visibility = "private"}> ({
  ^bb0(%x: tensor<2x3xf32>, %y: tensor<2x3xf32>):
    %s = "stablehlo.add"(%x, %y) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
    %p = "stablehlo.multiply"(%s, %y) : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>
    "func.return"(%p) : (tensor<2x3xf32>) -> ()
  }) : () -> ()
}) : () -> ()
"#;

#[test]
fn composite_with_shared_decomposition_runs() {
    let c = client();
    let exe = c.compile(COMPOSITE, &CompileOptions::default()).unwrap();
    let a = upload(&c, &f32_bytes(&A), ElementType::F32, &[2, 3]);
    let b = upload(&c, &f32_bytes(&B), ElementType::F32, &[2, 3]);
    let out = exe.execute(&[&a, &b]).unwrap();
    let first: Vec<f32> = A.iter().zip(B).map(|(a, b)| (a + b) * b).collect();
    let second: Vec<f32> = first.iter().zip(B).map(|(x, b)| (x + b) * b).collect();
    assert_eq!(bytes_f32(&out[0].to_host_vec().unwrap()), first);
    assert_eq!(bytes_f32(&out[1].to_host_vec().unwrap()), second);
}

#[test]
fn views_of_host_memory_execute_in_place() {
    let c = client();
    let exe = c.compile(ADD_MUL, &CompileOptions::default()).unwrap();
    let mut a_store = Box::new(Aligned([0; 128]));
    let mut b_store = Box::new(Aligned([0; 128]));
    a_store.0[..24].copy_from_slice(&f32_bytes(&A));
    b_store.0[..24].copy_from_slice(&f32_bytes(&B));
    {
        // SAFETY: the stores outlive the views (dropped at the end of this block) and are not
        // modified while they live; nothing is donated.
        let (a, b) = unsafe {
            (
                c.view_of_device_memory(a_store.0.as_mut_ptr(), ElementType::F32, &[2, 3], 0)
                    .unwrap(),
                c.view_of_device_memory(b_store.0.as_mut_ptr(), ElementType::F32, &[2, 3], 0)
                    .unwrap(),
            )
        };
        assert_eq!(a.device_pointer().unwrap(), a_store.0.as_ptr() as usize);
        assert_eq!(a.dims().unwrap(), vec![2, 3]);
        check_add_mul(&exe.execute(&[&a, &b]).unwrap());
        check_add_mul(&exe.execute(&[&a, &b]).unwrap());
    }
    // A view leaves the memory alone when it goes: the memory is still ours.
    assert_eq!(bytes_f32(&a_store.0[..24]), A);
}

#[test]
fn execute_with_and_without_polling_the_completion_event() {
    let c = client();
    let exe = c.compile(ADD_MUL, &CompileOptions::default()).unwrap();
    let a = upload(&c, &f32_bytes(&A), ElementType::F32, &[2, 3]);
    let b = upload(&c, &f32_bytes(&B), ElementType::F32, &[2, 3]);
    let old = execute_spin();
    for spin in [0, 1, 1000] {
        set_execute_spin(std::time::Duration::from_micros(spin));
        check_add_mul(&exe.execute(&[&a, &b]).unwrap());
    }
    set_execute_spin(old);
}

/// The runner with host arrays in and out: aliased, viewed or uploaded inputs, outputs copied
/// into host memory, and a call that does not fit the signature refused with its reason.
#[test]
fn runner_runs_with_host_memory_in_and_out() {
    let c = client();
    let exe = c.compile(ADD_MUL, &CompileOptions::default()).unwrap();
    let runner = Runner::new(c.clone()).unwrap();
    assert_eq!(runner.host_zero_copy(), !runner::discrete_device_forced());
    let t = (vec![2, 3], ElementType::F32);
    let sig = Signature {
        inputs: vec![t.clone(), t.clone()],
        outputs: vec![t.clone(), t],
        aliased_inputs: vec![],
    };
    let (a, b) = (f32_bytes(&A), f32_bytes(&B));
    let host = |bytes: &[u8]| HostArray {
        ptr: bytes.as_ptr() as usize,
        nbytes: bytes.len(),
        element: ElementType::F32,
        shape: vec![2, 3],
    };
    let mut sum = vec![0u8; 24];
    let mut prod = vec![0u8; 24];
    let outs = [
        HostArray {
            ptr: sum.as_mut_ptr() as usize,
            ..host(&sum)
        },
        HostArray {
            ptr: prod.as_mut_ptr() as usize,
            ..host(&prod)
        },
    ];
    // A resident `b` on the device, `a` from host memory.
    // SAFETY: `b` outlives the buffer.
    let (resident, _) = unsafe { runner.upload_resident(&host(&b), 0) }.unwrap();
    let args = [RunArg::Host(host(&a)), RunArg::Device(&resident)];
    // SAFETY: inputs and outputs are live vectors of 24 bytes; outputs alias nothing.
    unsafe { runner.run(&exe, &sig, &args, &outs) }.unwrap();
    let want_sum: Vec<f32> = A.iter().zip(&B).map(|(x, y)| x + y).collect();
    let want_prod: Vec<f32> = A.iter().zip(&B).map(|(x, y)| x * y).collect();
    assert_eq!(bytes_f32(&sum), want_sum);
    assert_eq!(bytes_f32(&prod), want_prod);

    // The bare-address path: outputs come back as buffers, read in place or fetched.
    let ptrs = [PtrArg::Host(a.as_ptr() as usize), PtrArg::Device(&resident)];
    // SAFETY: `a` is 24 live bytes of the input type.
    let bufs = unsafe { runner.execute_ptrs(&exe, &sig, &ptrs, None) }.unwrap();
    let mut got = vec![0u8; 24];
    // SAFETY: `got` is 24 writable bytes.
    unsafe { runner.fetch(&bufs[1], got.as_mut_ptr() as usize, 24) }.unwrap();
    assert_eq!(bytes_f32(&got), want_prod);

    // A host argument of another type is refused before anything runs, with both types.
    let wrong = HostArray {
        element: ElementType::S32,
        ..host(&a)
    };
    // SAFETY: nothing is uploaded (the type check fails first).
    let err = unsafe {
        runner.run(
            &exe,
            &sig,
            &[RunArg::Host(wrong), RunArg::Device(&resident)],
            &outs,
        )
    }
    .unwrap_err();
    assert!(
        matches!(&err, RunError::Call(m) if m == "input 0: executable expects float32[2, 3], got int32[2, 3]"),
        "{err}"
    );
    // SAFETY: nothing runs (the arity check fails first).
    let err = unsafe { runner.run(&exe, &sig, &args[..1], &outs) }.unwrap_err();
    assert!(matches!(err, RunError::Call(_)), "{err}");
    // SAFETY: nothing is uploaded (no such device).
    assert!(unsafe { runner.upload_resident(&host(&a), 99) }.is_err());
}

/// `a + b` written into `a` (`tf.aliasing_output`): the form of a training step's update.
const ADD_INTO_A: &str = r#"
module {
  func.func @main(%a: tensor<2x3xf32> {tf.aliasing_output = 0 : i32}, %b: tensor<2x3xf32>) -> tensor<2x3xf32> {
    %0 = stablehlo.add %a, %b : tensor<2x3xf32>
    return %0 : tensor<2x3xf32>
  }
}
"#;

/// What the CPU plugin does with an argument aliased to an output, by how the argument was
/// made (what `Runner::execute_ptrs` relies on to write a training step's state in place).
#[test]
fn aliased_arguments_donated_or_kept() {
    let c = client();
    let exe = c.compile(ADD_INTO_A, &CompileOptions::default()).unwrap();
    let sum: Vec<f32> = A.iter().zip(&B).map(|(a, b)| a + b).collect();
    let b = upload(&c, &f32_bytes(&B), ElementType::F32, &[2, 3]);

    // Not donated (listed as non-donatable): the plugin writes a new buffer, `a` is unchanged.
    let a = upload(&c, &f32_bytes(&A), ElementType::F32, &[2, 3]);
    let out = exe.execute(&[&a, &b]).unwrap();
    assert_eq!(bytes_f32(&out[0].to_host_vec().unwrap()), sum);
    assert_ne!(
        out[0].device_pointer().unwrap(),
        a.device_pointer().unwrap()
    );
    assert_eq!(bytes_f32(&a.to_host_vec().unwrap()), A);

    // A copied buffer, donated: the output is that buffer's memory.
    let a = upload(&c, &f32_bytes(&A), ElementType::F32, &[2, 3]);
    let a_ptr = a.device_pointer().unwrap();
    let out = exe.execute_donating(&[&a, &b], &[true, false]).unwrap();
    assert_eq!(bytes_f32(&out[0].to_host_vec().unwrap()), sum);
    assert_eq!(out[0].device_pointer().unwrap(), a_ptr);

    // A view of host memory (what tpuc runs a CPU tensor's memory as), donated: the output is
    // written into that memory.
    let mut store = Box::new(Aligned([0; 128]));
    store.0[..24].copy_from_slice(&f32_bytes(&A));
    let ptr = store.0.as_mut_ptr();
    // SAFETY: `store` outlives the view and the output, and nothing else touches it meanwhile.
    let view = unsafe { c.view_of_device_memory(ptr, ElementType::F32, &[2, 3], 0) }.unwrap();
    let out = exe.execute_donating(&[&view, &b], &[true, false]).unwrap();
    let out_ptr = out[0].device_pointer().unwrap();
    assert_eq!(bytes_f32(&out[0].to_host_vec().unwrap()), sum);
    drop(out);
    drop(view);
    println!(
        "donated view: output at the viewed memory = {}, memory updated = {}",
        out_ptr == ptr as usize,
        bytes_f32(&store.0[..24]) == sum
    );

    // A zero-copy host buffer, donated.
    store.0[..24].copy_from_slice(&f32_bytes(&A));
    // SAFETY: as above.
    let zc = unsafe {
        c.buffer_from_host(
            store.0.as_ptr(),
            24,
            ElementType::F32,
            &[2, 3],
            HostBufferSemantics::ImmutableZeroCopy,
            0,
        )
    }
    .unwrap();
    let r = exe.execute_donating(&[&zc, &b], &[true, false]);
    match &r {
        Ok(out) => println!(
            "donated zero-copy buffer: output at the host memory = {}, memory updated = {}",
            out[0].device_pointer().unwrap() == store.0.as_ptr() as usize,
            bytes_f32(&store.0[..24]) == sum
        ),
        Err(e) => println!("donated zero-copy buffer: refused: {e}"),
    }
}
