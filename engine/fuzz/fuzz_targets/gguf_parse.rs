//! Fuzzes the GGUF parser: any input must give a `GgufFile` or a `GgufError`, never a panic, an out-of-bounds
//! read, an allocation out of proportion to the input (run with `-malloc_limit_mb`), or a hang. Accepted files
//! must also uphold the reader's guarantees: every tensor's data slice has `n_bytes` bytes, element counts do not
//! overflow, and the typed getters never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nebula_engine::gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    match GgufFile::from_bytes("fuzz.gguf", data.to_vec()) {
        Ok(file) => {
            let _ = file.architecture();
            for (key, _) in file.metadata().iter() {
                let _ = file.get_u32(key);
                let _ = file.get_i64(key);
                let _ = file.get_f32(key);
                let _ = file.get_f64(key);
                let _ = file.get_bool(key);
                let _ = file.get_str(key);
                let _ = file.get_u32_array(key);
                let _ = file.get_u64_array(key);
                let _ = file.get_i32_array(key);
                let _ = file.get_f32_array(key);
                let _ = file.get_bool_array(key);
                let _ = file.get_string_array(key);
                if let Err(e) = file.get_u8(key) {
                    let _ = e.to_string();
                }
            }
            let mut total = 0u64;
            for t in file.tensors() {
                let bytes = file.tensor_data(t);
                assert_eq!(bytes.len() as u64, t.n_bytes);
                assert!(t.n_elements() <= i64::MAX as u64);
                assert_eq!(t.ggml_type.tensor_bytes(&t.dims), Some(t.n_bytes));
                assert!(std::ptr::eq(file.tensor(&t.name).unwrap(), t));
                total += t.n_bytes;
            }
            assert!(total <= data.len() as u64);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
