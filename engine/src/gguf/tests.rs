//! Tests against the outside truth (fixtures written and read by the PyPI `gguf` package, see `testdata/README.md`)
//! and hand-made hostile files.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::*;

fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/gguf/testdata")
}

fn read_json(name: &str) -> Value {
    let text = std::fs::read_to_string(testdata().join(name)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("nebula-gguf-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The dump format of scripts/gguf_check.py, produced from our reader.

fn value_json(v: &MetadataValue) -> Value {
    match v {
        MetadataValue::U8(x) => json!(x),
        MetadataValue::I8(x) => json!(x),
        MetadataValue::U16(x) => json!(x),
        MetadataValue::I16(x) => json!(x),
        MetadataValue::U32(x) => json!(x),
        MetadataValue::I32(x) => json!(x),
        MetadataValue::F32(x) => json!(x.to_bits()),
        MetadataValue::Bool(x) => json!(x),
        MetadataValue::String(x) => json!(x),
        MetadataValue::Array(a) => json!({
            "elem_type": a.elem_type.id(),
            "values": a.values.iter().map(value_json).collect::<Vec<_>>(),
        }),
        MetadataValue::U64(x) => json!(x),
        MetadataValue::I64(x) => json!(x),
        MetadataValue::F64(x) => json!(x.to_bits()),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Dump of one single-part file, as `gguf_check.py` prints it.
fn dump(file: &GgufFile) -> Value {
    let data_offset = file.data_offset(0).unwrap();
    json!({
        "name": file.path().file_name().unwrap().to_str().unwrap(),
        "version": file.version(),
        "alignment": file.alignment(),
        "data_offset": data_offset,
        "kv": file.metadata().iter().map(|(k, v)| json!({
            "key": k, "type": v.value_type().id(), "value": value_json(v),
        })).collect::<Vec<_>>(),
        "tensors": file.tensors().map(|t| json!({
            "name": t.name,
            "dims": t.dims,
            "type": t.ggml_type.id(),
            "offset": t.file_offset() - data_offset,
            "n_bytes": t.n_bytes,
            "data_hex": hex(file.tensor_data(t)),
        })).collect::<Vec<_>>(),
    })
}

/// Compares two dumps of one file entry by entry, for readable failures.
fn assert_same_dump(ours: &Value, truth: &Value) {
    let name = truth["name"].as_str().unwrap();
    for field in ["name", "version", "alignment", "data_offset"] {
        assert_eq!(ours[field], truth[field], "{name}: {field}");
    }
    let (ok, tk) = (ours["kv"].as_array().unwrap(), truth["kv"].as_array().unwrap());
    for (o, t) in ok.iter().zip(tk) {
        assert_eq!(o, t, "{name}: metadata entry");
    }
    assert_eq!(ok.len(), tk.len(), "{name}: number of metadata entries");
    let (ot, tt) = (ours["tensors"].as_array().unwrap(), truth["tensors"].as_array().unwrap());
    for (o, t) in ot.iter().zip(tt) {
        assert_eq!(o, t, "{name}: tensor");
    }
    assert_eq!(ot.len(), tt.len(), "{name}: number of tensors");
}

// ---------------------------------------------------------------------------------------------------------------
// Types against gguf-py.

#[test]
fn ggml_types_match_gguf_py() {
    let table = read_json("ggml_types.json");
    let types = table["ggml_types"].as_array().unwrap();
    let mut known = std::collections::HashSet::new();
    for t in types {
        let id = t["id"].as_u64().unwrap() as u32;
        known.insert(id);
        let ty = GgmlType::from_id(id).unwrap_or_else(|| panic!("id {id} ({}) unknown to GgmlType", t["name"]));
        assert_eq!(ty.id(), id);
        assert_eq!(ty.name(), t["name"].as_str().unwrap(), "name of id {id}");
        assert_eq!(ty.block_size() as u64, t["block_size"].as_u64().unwrap(), "block size of {ty}");
        assert_eq!(ty.type_size() as u64, t["type_size"].as_u64().unwrap(), "block bytes of {ty}");
    }
    for id in 0..=1024u32 {
        assert_eq!(GgmlType::from_id(id).is_some(), known.contains(&id), "id {id}");
    }
    assert_eq!(GgmlType::ALL.len(), types.len());
    assert_eq!(u64::from(GGUF_VERSION), table["gguf_version"].as_u64().unwrap());
    assert_eq!(DEFAULT_ALIGNMENT, table["default_alignment"].as_u64().unwrap());

    let py_names = |vt: ValueType| match vt {
        ValueType::U8 => "UINT8",
        ValueType::I8 => "INT8",
        ValueType::U16 => "UINT16",
        ValueType::I16 => "INT16",
        ValueType::U32 => "UINT32",
        ValueType::I32 => "INT32",
        ValueType::F32 => "FLOAT32",
        ValueType::Bool => "BOOL",
        ValueType::String => "STRING",
        ValueType::Array => "ARRAY",
        ValueType::U64 => "UINT64",
        ValueType::I64 => "INT64",
        ValueType::F64 => "FLOAT64",
    };
    let value_types = table["value_types"].as_array().unwrap();
    assert_eq!(value_types.len(), ValueType::ALL.len());
    for v in value_types {
        let vt = ValueType::from_id(v["id"].as_u64().unwrap() as u32).unwrap();
        assert_eq!(py_names(vt), v["name"].as_str().unwrap());
    }
    assert_eq!(ValueType::from_id(13), None);
}

#[test]
fn row_bytes() {
    assert_eq!(GgmlType::Q4_K.row_bytes(2560), Some(10 * 144));
    assert_eq!(GgmlType::Q4_K.row_bytes(160), None, "160 is not a multiple of 256");
    assert_eq!(GgmlType::IQ4_NL.row_bytes(160), Some(5 * 18));
    assert_eq!(GgmlType::F32.row_bytes(u64::MAX), None, "overflow");
    assert_eq!(GgmlType::BF16.tensor_bytes(&[160, 320_001_536]), Some(102_400_491_520));
    assert_eq!(GgmlType::F32.tensor_bytes(&[]), Some(4));
    assert_eq!(GgmlType::F32.tensor_bytes(&[1 << 40, 1 << 40]), None);
}

// ---------------------------------------------------------------------------------------------------------------
// Reading files written by gguf-py.

#[test]
fn reads_every_gguf_py_fixture_like_gguf_py() {
    let expected = read_json("expected.json");
    let files = expected["files"].as_array().unwrap();
    assert_eq!(files.len(), 6);
    for truth in files {
        let name = truth["name"].as_str().unwrap();
        let bytes = std::fs::read(testdata().join(name)).unwrap();
        let file = GgufFile::from_bytes(name, bytes).unwrap();
        assert_same_dump(&dump(&file), truth);
    }
}

#[test]
fn opens_with_mmap_and_reads_through_the_getters() {
    let path = testdata().join("all_types.gguf");
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.path(), path);
    assert_eq!(f.n_parts(), 1);
    assert_eq!(f.architecture().unwrap(), "qwen4exp");
    assert_eq!(f.get_u32("qwen4exp.block_count").unwrap(), 48);
    assert_eq!(f.get_u32_array("qwen4exp.rope.dimension_sections").unwrap(), [11, 11, 10, 0]);
    assert_eq!(
        f.get_u64_array("qwen4exp.ple.layer_multipliers").unwrap(),
        [23703573157769, 20109073645365, 8052911324071]
    );
    assert_eq!(f.get_string_array("tokenizer.ggml.tokens").unwrap()[1], "<|im_start|>");
    assert_eq!(f.get_str("test.string").unwrap(), "héllo ✓ 世界 \u{1f600}");
    assert_eq!(f.get_str("test.string_empty").unwrap(), "");
    assert!(f.get_f32("test.f32_nan").unwrap().is_nan());
    assert_eq!(f.get_f32("test.f32_neg_zero").unwrap().to_bits(), (-0.0f32).to_bits());
    assert_eq!(f.get_f64("test.f64").unwrap(), std::f64::consts::PI);
    assert_eq!(f.get_u64("test.u64").unwrap(), u64::MAX);
    assert_eq!(f.get_i64("test.i64").unwrap(), i64::MIN);
    assert_eq!(f.get_i32("test.i8").unwrap(), -128);
    assert!(f.get_bool("test.bool_true").unwrap());
    assert_eq!(f.get_bool_array("test.arr_bool").unwrap(), [true, false, true]);
    assert_eq!(f.get_f32_array("test.arr_f32").unwrap(), [1.5, -2.25, f32::INFINITY]);
    assert_eq!(f.get_i32_array("test.arr_i8").unwrap(), [-128, 0, 127]);
    let nested = f.get_array("test.arr_arr_str").unwrap();
    assert_eq!(nested.elem_type, ValueType::Array);
    assert_eq!(nested.values[1], MetadataValue::from(vec!["y", "z"]));
    assert_eq!(f.get_u32_opt("qwen4exp.absent").unwrap(), None);
    let e = f.get_u32("test.string").unwrap_err();
    assert_eq!(e.to_string(), format!("{}: key 'test.string' has type string, expected an integer", path.display()));

    let t = f.tensor("q8_0_3d.weight").unwrap();
    assert_eq!(
        (t.dims.as_slice(), t.ggml_type, t.n_bytes, t.n_elements()),
        (&[32, 2, 2][..], GgmlType::Q8_0, 136, 128)
    );
    assert_eq!(t.file_offset() % 32, 0);
    assert_eq!(f.tensor_data(t).len(), 136);
    let scalar = f.tensor("scalar").unwrap();
    assert_eq!((scalar.n_dims(), scalar.n_elements()), (0, 1));
    assert_eq!(f.tensor_data(scalar), 0.5f32.to_le_bytes());
    let names: Vec<&str> = f.tensors().map(|t| t.name.as_str()).collect();
    assert_eq!(names.first(), Some(&"f32.weight"));
    assert_eq!(names.len(), 15);
    assert!(f.tensor("absent").is_none());
    // The mmap path and the in-memory path agree.
    let mem = GgufFile::from_bytes("all_types.gguf", std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(dump(&f), dump(&mem));
}

#[test]
#[should_panic(expected = "does not belong to")]
fn tensor_data_refuses_a_tensor_info_from_another_file() {
    let a = GgufFile::from_bytes("a", std::fs::read(testdata().join("all_types.gguf")).unwrap()).unwrap();
    let b = GgufFile::from_bytes("b", std::fs::read(testdata().join("align64.gguf")).unwrap()).unwrap();
    let foreign = a.tensors().nth(5).unwrap().clone();
    let _ = b.tensor_data(&foreign);
}

#[test]
fn version_2_is_read_and_big_endian_is_refused() {
    let mut bytes = std::fs::read(testdata().join("all_types.gguf")).unwrap();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let f = GgufFile::from_bytes("v2.gguf", bytes).unwrap();
    assert_eq!(f.version(), 2);
    assert_eq!(f.n_tensors(), 15);

    let e = GgufFile::open(testdata().join("big_endian.gguf")).unwrap_err();
    assert!(matches!(e.kind(), GgufErrorKind::BigEndian { version: 3 }), "{e}");
    assert!(e.to_string().contains("big-endian GGUF file"), "{e}");
}

// ---------------------------------------------------------------------------------------------------------------
// Split models.

fn copy_split_fixture(dir: &Path, name: &str) -> Vec<PathBuf> {
    (1..=3)
        .map(|i| {
            let to = dir.join(format!("{name}-{i:05}-of-00003.gguf"));
            std::fs::copy(testdata().join(format!("split-{i:05}-of-00003.gguf")), &to).unwrap();
            to
        })
        .collect()
}

#[test]
fn opens_a_gguf_py_split_model_from_any_part() {
    let expected = read_json("expected.json");
    let parts: Vec<&Value> = expected["files"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["name"].as_str().unwrap().starts_with("split-"))
        .collect();
    assert_eq!(parts.len(), 3);
    for start in 1..=3 {
        let f = GgufFile::open(testdata().join(format!("split-{start:05}-of-00003.gguf"))).unwrap();
        assert_eq!(f.path(), testdata().join("split-00001-of-00003.gguf"), "path() is part 1");
        assert_eq!(f.n_parts(), 3);
        assert_eq!(f.part_paths().nth(2).unwrap(), testdata().join("split-00003-of-00003.gguf"));
        assert_eq!(f.get_str("general.name").unwrap(), "split test", "metadata comes from part 1");
        assert_eq!(f.get_u32("split.count").unwrap(), 3);
        let names: Vec<&str> = f.tensors().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["t0", "t1", "t2", "t3", "t4"]);
        let splits: Vec<usize> = f.tensors().map(|t| t.split_index()).collect();
        assert_eq!(splits, [0, 0, 1, 2, 2]);
        for (part, truth) in parts.iter().enumerate() {
            for t in truth["tensors"].as_array().unwrap() {
                let ours = f.tensor(t["name"].as_str().unwrap()).unwrap();
                assert_eq!(ours.split_index(), part);
                assert_eq!(hex(f.tensor_data(ours)), t["data_hex"].as_str().unwrap());
                assert_eq!(ours.file_offset() - f.data_offset(part).unwrap(), t["offset"].as_u64().unwrap());
            }
        }
    }
}

#[test]
fn split_errors_name_the_part_and_the_problem() {
    let dir = TempDir::new("split-errors");

    let parts = copy_split_fixture(dir.path(), "missing");
    std::fs::remove_file(&parts[1]).unwrap();
    let e = GgufFile::open(&parts[0]).unwrap_err();
    assert!(
        matches!(e.kind(), GgufErrorKind::MissingSplitPart { part } if part.ends_with("missing-00002-of-00003.gguf"))
    );
    assert_eq!(e.to_string(), format!("{}: missing split part '{}'", parts[0].display(), parts[1].display()));

    // Part 2's bytes under part 3's name: split.no says 1 where 2 is due.
    let parts = copy_split_fixture(dir.path(), "swapped");
    std::fs::copy(&parts[1], &parts[2]).unwrap();
    let e = GgufFile::open(&parts[0]).unwrap_err();
    assert!(matches!(e.kind(), GgufErrorKind::SplitMismatch { .. }), "{e}");
    assert!(e.to_string().contains("'split.no' should be 2, but it is 1"), "{e}");

    // The file name says 4 parts, the keys say 3.
    for i in 1..=4 {
        std::fs::copy(
            testdata().join("split-00001-of-00003.gguf"),
            dir.path().join(format!("four-{i:05}-of-00004.gguf")),
        )
        .unwrap();
    }
    let e = GgufFile::open(dir.path().join("four-00001-of-00004.gguf")).unwrap_err();
    assert!(e.to_string().contains("the file name says 4 parts, but 'split.count' is 3"), "{e}");

    // Part 1 renamed so that the others cannot be found.
    let lone = dir.path().join("renamed.gguf");
    std::fs::copy(testdata().join("split-00001-of-00003.gguf"), &lone).unwrap();
    let e = GgufFile::open(&lone).unwrap_err();
    assert!(matches!(e.kind(), GgufErrorKind::SplitMismatch { .. }));
    assert!(e.to_string().contains("'split.count' = 3, but the file name does not follow"), "{e}");

    // split.tensors.count that disagrees with the parts.
    let parts = copy_split_fixture(dir.path(), "count");
    let mut bytes = std::fs::read(&parts[0]).unwrap();
    let key = b"split.tensors.count";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4;
    bytes[at..at + 4].copy_from_slice(&6i32.to_le_bytes());
    std::fs::write(&parts[0], bytes).unwrap();
    let e = GgufFile::open(&parts[0]).unwrap_err();
    assert!(e.to_string().contains("'split.tensors.count' is 6, but the 3 parts hold 5 tensors"), "{e}");

    // A tensor name in two parts.
    let dup = dir.path().join("dup");
    let mut w = GgufWriter::create(&dup, 32).unwrap();
    w.split_max_bytes(1);
    w.add_tensor("a", &[4], GgmlType::F32).unwrap();
    w.add_tensor("b", &[4], GgmlType::F32).unwrap();
    let mut d = w.begin_data().unwrap();
    d.write_tensor("a", &[0; 16]).unwrap();
    d.write_tensor("b", &[0; 16]).unwrap();
    let paths = d.finish().unwrap();
    let mut bytes = std::fs::read(&paths[1]).unwrap();
    let at = bytes.windows(9).position(|w| w == b"\x01\x00\x00\x00\x00\x00\x00\x00b").unwrap() + 8;
    bytes[at] = b'a';
    std::fs::write(&paths[1], bytes).unwrap();
    let e = GgufFile::open(&paths[0]).unwrap_err();
    assert!(matches!(e.kind(), GgufErrorKind::DuplicateTensor { name } if name == "a"), "{e}");

    let e = GgufFile::open(dir.path().join("absent.gguf")).unwrap_err();
    assert!(matches!(e.kind(), GgufErrorKind::Io { .. }), "{e}");
}

// ---------------------------------------------------------------------------------------------------------------
// Writing: byte-identical to gguf-py, and read back by gguf-py.

/// Rewrites `file` (all its metadata except `split.*`, all tensors) with our writer.
fn rewrite(file: &GgufFile, path: &Path, split_max_bytes: Option<u64>) -> Vec<PathBuf> {
    let mut w = GgufWriter::create(path, file.alignment() as u32).unwrap();
    if let Some(max) = split_max_bytes {
        w.split_max_bytes(max);
    }
    for (k, v) in file.metadata().iter().filter(|(k, _)| !k.starts_with("split.")) {
        w.add_kv(k, v.clone()).unwrap();
    }
    for t in file.tensors() {
        w.add_tensor(&t.name, &t.dims, t.ggml_type).unwrap();
    }
    let mut d = w.begin_data().unwrap();
    for t in file.tensors() {
        // Chunked, to exercise the chunk path.
        d.begin_tensor(&t.name).unwrap();
        for chunk in file.tensor_data(t).chunks(7) {
            d.write_chunk(chunk).unwrap();
        }
        d.end_tensor().unwrap();
    }
    d.finish().unwrap()
}

#[test]
fn our_writer_reproduces_gguf_py_files_byte_for_byte() {
    let dir = TempDir::new("rewrite");
    for name in ["all_types.gguf", "align64.gguf", "no_tensors.gguf"] {
        let original = std::fs::read(testdata().join(name)).unwrap();
        let file = GgufFile::from_bytes(name, original.clone()).unwrap();
        let written = rewrite(&file, &dir.path().join(name), None);
        assert_eq!(written, [dir.path().join(name)]);
        assert!(std::fs::read(&written[0]).unwrap() == original, "{name}: our bytes differ from gguf-py's");
    }
    let split = GgufFile::open(testdata().join("split-00001-of-00003.gguf")).unwrap();
    let written = rewrite(&split, &dir.path().join("split.gguf"), Some(128));
    assert_eq!(written.len(), 3);
    for (i, path) in written.iter().enumerate() {
        let name = format!("split-{:05}-of-00003.gguf", i + 1);
        assert_eq!(path, &dir.path().join(&name));
        let original = std::fs::read(testdata().join(&name)).unwrap();
        assert!(std::fs::read(path).unwrap() == original, "{name}: our bytes differ from gguf-py's");
    }
}

/// Deterministic bytes (xorshift64).
fn pseudo_random(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The values of `rust_writer.gguf`: what gguf-py cannot write (empty arrays) and what it does not usually write
/// (every ggml type, alignment 16).
fn rust_fixture_metadata() -> Vec<(&'static str, MetadataValue)> {
    let arr = |t: ValueType, v: Vec<MetadataValue>| MetadataValue::Array(MetadataArray::new(t, v));
    vec![
        ("general.architecture", "qwen4exp".into()),
        ("t.u8", 200u8.into()),
        ("t.i8", (-5i8).into()),
        ("t.u16", 60000u16.into()),
        ("t.i16", (-30000i16).into()),
        ("t.u32", 4_000_000_000u32.into()),
        ("t.i32", (-2_000_000_000i32).into()),
        ("t.f32", f32::NAN.into()),
        ("t.bool", true.into()),
        ("t.string", "ünïcödé".into()),
        ("t.string_empty", "".into()),
        ("t.u64", (u64::MAX - 1).into()),
        ("t.i64", (i64::MIN + 1).into()),
        ("t.f64", (-0.0f64).into()),
        ("t.arr_empty_u32", arr(ValueType::U32, vec![])),
        ("t.arr_empty_string", arr(ValueType::String, vec![])),
        ("t.arr_of_empty", arr(ValueType::Array, vec![arr(ValueType::F32, vec![]), arr(ValueType::F32, vec![])])),
        ("t.arr_i16", vec![1i16, -1, i16::MAX].into()),
        ("t.arr_u16", vec![7u16, 8].into()),
        ("t.arr_i64", vec![i64::MIN, 0].into()),
        ("t.arr_f64", vec![f64::INFINITY, 1e-300].into()),
        ("t.arr_f32", vec![0.5f32, f32::NEG_INFINITY].into()),
        ("t.arr_bool", vec![false, true].into()),
        (
            "t.arr_arr_arr",
            arr(ValueType::Array, vec![arr(ValueType::Array, vec![vec![1u8, 2].into(), vec!["x"].into()])]),
        ),
        ("qwen4exp.attention.compress_ratios", vec![0i32, 0, 0, 4].into()),
        ("qwen4exp.attention.recurrent_layers", vec![true, true, true, false].into()),
    ]
}

/// Writes `rust_writer.gguf` (alignment 16, one tensor per ggml type plus a scalar and a 4-D tensor) and the split
/// set `rust_writer_split-0000N-of-00003.gguf` (alignment 64, 100-byte parts) into `dir`.
fn write_rust_fixtures(dir: &Path) -> Vec<PathBuf> {
    let mut w = GgufWriter::create(dir.join("rust_writer.gguf"), 16).unwrap();
    for (k, v) in rust_fixture_metadata() {
        w.add_kv(k, v).unwrap();
    }
    let mut tensors: Vec<(String, Vec<u64>, GgmlType)> = GgmlType::ALL
        .iter()
        .map(|&t| (format!("{}.weight", t.name().to_lowercase()), vec![2 * t.block_size() as u64, 3], t))
        .collect();
    tensors.push(("scalar".into(), vec![], GgmlType::I32));
    tensors.push(("four_d".into(), vec![2, 3, 1, 2], GgmlType::F16));
    for (name, dims, ty) in &tensors {
        w.add_tensor(name, dims, *ty).unwrap();
    }
    let mut d = w.begin_data().unwrap();
    for (i, (name, dims, ty)) in tensors.iter().enumerate() {
        let n = ty.tensor_bytes(dims).unwrap() as usize;
        d.write_tensor(name, &pseudo_random(i as u64 + 1, n)).unwrap();
    }
    let mut paths = d.finish().unwrap();

    let mut w = GgufWriter::create(dir.join("rust_writer_split.gguf"), 64).unwrap();
    w.split_max_bytes(100);
    w.add_kv("general.architecture", "qwen4exp").unwrap();
    let split_tensors = [
        ("s0", 10u64, GgmlType::F32),
        ("s1", 10, GgmlType::F32),
        ("s2", 150, GgmlType::F16),
        ("s3", 32, GgmlType::Q4_0),
    ];
    for (name, ne0, ty) in split_tensors {
        w.add_tensor(name, &[ne0], ty).unwrap();
    }
    let mut d = w.begin_data().unwrap();
    for (i, (name, ne0, ty)) in split_tensors.into_iter().enumerate() {
        d.write_tensor(name, &pseudo_random(100 + i as u64, ty.row_bytes(ne0).unwrap() as usize)).unwrap();
    }
    paths.extend(d.finish().unwrap());
    paths
}

/// Our writer's output is committed (`rust_writer*.gguf`) together with what gguf-py's GGUFReader read from it
/// (`rust_writer.py.json`, from `scripts/gguf_check.py`). This test checks that the writer still produces exactly
/// those bytes and that our reader reads them as gguf-py did. After an intended writer change, regenerate both
/// (see `testdata/README.md`): `NEBULA_REGEN_GGUF_FIXTURES=1 cargo test -p nebula-engine --lib
/// gguf::tests::our_writer_output_matches_what_gguf_py_read`, then the `gguf_check.py` command there.
#[test]
fn our_writer_output_matches_what_gguf_py_read() {
    let dir = TempDir::new("rust-fixtures");
    let regen = std::env::var_os("NEBULA_REGEN_GGUF_FIXTURES").is_some();
    let out = if regen { testdata() } else { dir.path().to_path_buf() };
    let written = write_rust_fixtures(&out);
    let names: Vec<String> = written.iter().map(|p| p.file_name().unwrap().to_str().unwrap().to_string()).collect();
    assert_eq!(
        names,
        [
            "rust_writer.gguf",
            "rust_writer_split-00001-of-00003.gguf",
            "rust_writer_split-00002-of-00003.gguf",
            "rust_writer_split-00003-of-00003.gguf"
        ]
    );
    for name in &names {
        let committed = std::fs::read(testdata().join(name)).unwrap();
        assert!(std::fs::read(out.join(name)).unwrap() == committed, "{name}: writer output changed");
    }
    let truth = read_json("rust_writer.py.json");
    let files = truth["files"].as_array().unwrap();
    assert_eq!(files.len(), names.len());
    for (name, truth) in names.iter().zip(files) {
        let file = GgufFile::from_bytes(name, std::fs::read(testdata().join(name)).unwrap()).unwrap();
        assert_same_dump(&dump(&file), truth);
    }
    // The split set as a whole.
    let f = GgufFile::open(testdata().join("rust_writer_split-00002-of-00003.gguf")).unwrap();
    assert_eq!(f.n_parts(), 3);
    assert_eq!(f.tensors().map(|t| t.split_index()).collect::<Vec<_>>(), [0, 0, 1, 2]);
    assert_eq!(f.get_u32("general.alignment").unwrap(), 64);
    for i in 0..3 {
        assert_eq!(f.data_offset(i).unwrap() % 64, 0);
    }
    assert_eq!(f.tensor_data_by_name("s2").unwrap(), pseudo_random(102, 300));
    // The metadata values survive the round trip exactly (NaN compared by bits through the dump).
    let single = GgufFile::open(testdata().join("rust_writer.gguf")).unwrap();
    for (k, v) in rust_fixture_metadata() {
        assert_eq!(value_json(single.get(k).unwrap()), value_json(&v), "{k}");
    }
    assert_eq!(single.metadata().entries().last().unwrap().0, "general.alignment");
}

/// Live cross-check with gguf-py: writes our fixtures to a temp dir and runs `scripts/gguf_check.py --expect` on
/// them with our reader's dump. Needs `python3` with `gguf` and `numpy`, hence ignored by default; run with
/// `cargo test -p nebula-engine --lib gguf::tests::gguf_py_reads_our_writer_live -- --ignored`.
#[test]
#[ignore = "needs python3 with the gguf package: cargo test -p nebula-engine --lib gguf::tests::gguf_py_reads_our_writer_live -- --ignored"]
fn gguf_py_reads_our_writer_live() {
    let dir = TempDir::new("live");
    let written = write_rust_fixtures(dir.path());
    let ours: Vec<Value> = written
        .iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_str().unwrap();
            dump(&GgufFile::from_bytes(name, std::fs::read(p).unwrap()).unwrap())
        })
        .collect();
    let expect = dir.path().join("ours.json");
    std::fs::write(&expect, serde_json::to_string(&json!({ "files": ours })).unwrap()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gguf_check.py");
    let out =
        std::process::Command::new("python3").arg(script).arg("--expect").arg(&expect).args(&written).output().unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

#[test]
fn split_writer_handles_oversized_tensors_and_chunks_across_parts() {
    let dir = TempDir::new("split-writer");
    let mut w = GgufWriter::create(dir.path().join("big.gguf"), 32).unwrap();
    w.split_max_bytes(1000);
    w.add_kv("general.architecture", "qwen4exp").unwrap();
    let sizes = [600u64, 300, 5000, 100, 950, 10];
    for (i, n) in sizes.iter().enumerate() {
        w.add_tensor(format!("t{i}"), &[*n], GgmlType::I8).unwrap();
    }
    let mut d = w.begin_data().unwrap();
    for (i, n) in sizes.iter().enumerate() {
        let data = pseudo_random(i as u64, *n as usize);
        d.begin_tensor(&format!("t{i}")).unwrap();
        for chunk in data.chunks(333) {
            d.write_chunk(chunk).unwrap();
        }
        d.end_tensor().unwrap();
    }
    assert_eq!(d.next_tensor(), None);
    let paths = d.finish().unwrap();
    // [600, 300] [5000] [100] [950, 10]? No: 950 + 10 <= 1000, and 100 + 950 > 1000.
    assert_eq!(paths.len(), 4);
    assert_eq!(paths[3], dir.path().join("big-00004-of-00004.gguf"));
    let f = GgufFile::open(&paths[0]).unwrap();
    assert_eq!(f.tensors().map(|t| t.split_index()).collect::<Vec<_>>(), [0, 0, 1, 2, 3, 3]);
    for (i, n) in sizes.iter().enumerate() {
        assert_eq!(f.tensor_data_by_name(&format!("t{i}")).unwrap(), pseudo_random(i as u64, *n as usize));
    }
    assert_eq!(f.get_u32("split.tensors.count").unwrap(), 6);
    for p in &paths[1..] {
        let part = GgufFile::from_bytes("part", std::fs::read(p).unwrap()).unwrap();
        let keys: Vec<&str> = part.metadata().iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["split.no", "split.count", "split.tensors.count"]);
    }

    // Splitting that fits in one part still uses the split names.
    let mut w = GgufWriter::create(dir.path().join("one.gguf"), 32).unwrap();
    w.split_max_bytes(1 << 30);
    w.add_tensor("t", &[1], GgmlType::F32).unwrap();
    let mut d = w.begin_data().unwrap();
    d.write_tensor("t", &[0; 4]).unwrap();
    let paths = d.finish().unwrap();
    assert_eq!(paths, [dir.path().join("one-00001-of-00001.gguf")]);
    assert_eq!(GgufFile::open(&paths[0]).unwrap().n_parts(), 1);
}

// ---------------------------------------------------------------------------------------------------------------
// Hostile files.

/// Builds GGUF bytes by hand.
#[derive(Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(4).u32(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for d in dims {
            self.u64(*d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to 32 and appends `n` data bytes.
    fn data(&mut self, n: usize) -> &mut Self {
        self.0.resize(self.0.len().next_multiple_of(32) + n, 0xAB);
        self
    }
    fn parse(&self) -> Result<GgufFile> {
        GgufFile::from_bytes("hostile.gguf", self.0.clone())
    }
    fn err(&self) -> GgufError {
        self.parse().expect_err("hostile file accepted")
    }
}

#[test]
fn a_hand_made_minimal_file_is_valid() {
    let mut r = Raw::header(3, 1, 1);
    r.kv_u32("k", 1).tensor("t", &[8], GgmlType::F32.id(), 0).data(32);
    let f = r.parse().unwrap();
    assert_eq!(f.tensor_data_by_name("t").unwrap(), [0xAB; 32]);
}

#[test]
fn bad_magic_and_versions() {
    for bytes in [&b""[..], b"GG", b"GGUG\x03\0\0\0", b"\0\0\0\0GGUF"] {
        let e = GgufFile::from_bytes("x.gguf", bytes.to_vec()).unwrap_err();
        assert!(matches!(e.kind(), GgufErrorKind::BadMagic { .. }), "{e}");
    }
    let e = GgufFile::from_bytes("x.gguf", b"GGML\x03\0\0\0".to_vec()).unwrap_err();
    assert_eq!(e.to_string(), "x.gguf: not a GGUF file: the first bytes are [47, 47, 4d, 4c], expected \"GGUF\"");
    let e = Raw::header(1, 0, 0).err();
    assert!(matches!(e.kind(), GgufErrorKind::UnsupportedVersion { version: 1 }));
    assert!(e.to_string().contains("v1 used 32-bit counts"), "{e}");
    assert!(matches!(Raw::header(4, 0, 0).err().kind(), GgufErrorKind::UnsupportedVersion { version: 4 }));
    assert!(matches!(Raw::header(0, 0, 0).err().kind(), GgufErrorKind::UnsupportedVersion { version: 0 }));
    assert!(matches!(Raw::header(3u32.swap_bytes(), 0, 0).err().kind(), GgufErrorKind::BigEndian { version: 3 }));
    assert!(Raw::header(3, 0, 0).parse().is_ok(), "an empty v3 file is valid");
}

/// Every prefix of valid files must be an error, except those that still hold every tensor's bytes (only the
/// trailing padding is cut), which must parse. Nothing may panic.
#[test]
fn every_truncation_of_valid_files_is_an_error() {
    for name in ["all_types.gguf", "align64.gguf", "split-00002-of-00003.gguf", "no_tensors.gguf", "rust_writer.gguf"] {
        let bytes = std::fs::read(testdata().join(name)).unwrap();
        let full = GgufFile::from_bytes(name, bytes.clone()).unwrap();
        let data_end = full.tensors().map(|t| t.file_offset() + t.n_bytes).max();
        let mut first_ok = None;
        for len in 0..=bytes.len() {
            match GgufFile::from_bytes(name, bytes[..len].to_vec()) {
                Ok(_) => {
                    first_ok.get_or_insert(len);
                }
                Err(e) => {
                    assert!(first_ok.is_none(), "{name}: prefix {len} fails ({e}) after a shorter one parsed");
                    assert!(
                        matches!(
                            e.kind(),
                            GgufErrorKind::BadMagic { .. }
                                | GgufErrorKind::Truncated { .. }
                                | GgufErrorKind::LengthBeyondEnd { .. }
                                | GgufErrorKind::CountBeyondEnd { .. }
                                | GgufErrorKind::TensorBeyondEnd { .. }
                        ),
                        "{name}: prefix {len}: unexpected {e}"
                    );
                }
            }
        }
        if let Some(end) = data_end {
            assert_eq!(first_ok.map(|l| l as u64), Some(end), "{name}: shortest valid prefix");
        }
    }
}

#[test]
fn truncation_messages_name_the_key_and_offset() {
    let bytes = std::fs::read(testdata().join("all_types.gguf")).unwrap();
    let find = |key: &[u8]| bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    // Two bytes into the u32 value of qwen4exp.block_count (after the key and its 4-byte type).
    let value_at = find(b"qwen4exp.block_count") + 4;
    let e = GgufFile::from_bytes("model.gguf", bytes[..value_at + 2].to_vec()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("model.gguf: truncated while reading the value of key 'qwen4exp.block_count' at offset {value_at}")
    );
    // Inside the last token string ("\u{120}hello", 7 bytes) of tokenizer.ggml.tokens.
    let last = find("\u{120}hello".as_bytes()) - 7;
    let e = GgufFile::from_bytes("model.gguf", bytes[..last + 3].to_vec()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "model.gguf: the value of key 'tokenizer.ggml.tokens' at offset {} claims 7 bytes, but only 3 bytes \
             remain in the file",
            last - 8
        )
    );
}

#[test]
fn huge_counts_and_lengths_are_refused_before_allocating() {
    let e = Raw::header(3, u64::MAX, 0).err();
    assert!(matches!(e.kind(), GgufErrorKind::CountBeyondEnd { count: u64::MAX, .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "hostile.gguf: the tensor count at offset 8 claims 18446744073709551615 entries of at least 24 bytes each, \
         but only 8 bytes remain in the file"
    );
    let e = Raw::header(3, 1 << 63, 0).err();
    assert!(matches!(e.kind(), GgufErrorKind::CountBeyondEnd { .. }), "{e}");
    let e = Raw::header(3, 0, 1 << 62).err();
    assert!(matches!(e.kind(), GgufErrorKind::CountBeyondEnd { .. }), "{e}");

    let mut r = Raw::header(3, 0, 1);
    r.u64(1 << 63).u64(0).u64(0);
    let e = r.err();
    assert!(matches!(e.kind(), GgufErrorKind::LengthBeyondEnd { length, .. } if *length == 1 << 63), "{e}");
    assert!(
        e.to_string().contains("the key of metadata entry #0 at offset 24 claims 9223372036854775808 bytes"),
        "{e}"
    );

    let mut r = Raw::header(3, 0, 1);
    r.str("s").u32(ValueType::String.id()).u64(u64::MAX).u64(0);
    let e = r.err();
    assert!(matches!(e.kind(), GgufErrorKind::LengthBeyondEnd { what, .. } if what == "the value of key 's'"), "{e}");

    for (elem, count) in [(ValueType::U8, 1u64 << 40), (ValueType::String, 1 << 60), (ValueType::Array, u64::MAX / 2)] {
        let mut r = Raw::header(3, 0, 1);
        r.str("arr").u32(ValueType::Array.id()).u32(elem.id()).u64(count).u64(0).u64(0);
        let e = r.err();
        assert!(matches!(e.kind(), GgufErrorKind::CountBeyondEnd { what, .. } if what.contains("'arr'")), "{e}");
    }

    let mut r = Raw::header(3, 1, 0);
    r.u64(u64::MAX - 3).u64(0).u64(0).u64(0);
    assert!(matches!(r.err().kind(), GgufErrorKind::LengthBeyondEnd { .. }));
}

#[test]
fn the_metadata_value_cap_is_enforced() {
    let mut r = Raw::header(3, 0, 1);
    r.str("tokenizer.ggml.token_type").u32(ValueType::Array.id()).u32(ValueType::U8.id()).u64(MAX_METADATA_VALUES);
    r.0.resize(r.0.len() + MAX_METADATA_VALUES as usize, 0);
    let e = r.err();
    assert!(matches!(e.kind(), GgufErrorKind::TooManyValues { key, .. } if key == "tokenizer.ggml.token_type"), "{e}");
}

#[test]
fn tensor_shape_errors() {
    let f32 = GgmlType::F32.id();
    type KindCheck<'a> = &'a dyn Fn(&GgufErrorKind) -> bool;
    let cases: Vec<(Raw, KindCheck)> = vec![
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("five", &[1, 1, 1, 1, 1], f32, 0).data(4);
                r
            },
            &|k| matches!(k, GgufErrorKind::TooManyDims { n_dims: 5, .. }),
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.str("many").u32(u32::MAX);
                r
            },
            &|k| matches!(k, GgufErrorKind::TooManyDims { .. }),
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("zero", &[4, 0], f32, 0).data(16);
                r
            },
            &|k| matches!(k, GgufErrorKind::ZeroDim { axis: 1, .. }),
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("ovf", &[1 << 32, 1 << 32], f32, 0).data(16);
                r
            },
            &|k| matches!(k, GgufErrorKind::TensorSizeOverflow { .. }),
        ),
        (
            {
                // 2^62 elements fit in i64, but 2^64 bytes do not.
                let mut r = Raw::header(3, 1, 0);
                r.tensor("bytes_ovf", &[1 << 31, 1 << 31], f32, 0).data(16);
                r
            },
            &|k| matches!(k, GgufErrorKind::TensorSizeOverflow { .. }),
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("elems_ovf", &[1 << 62, 2, 1, 1], GgmlType::I8.id(), 0).data(16);
                r
            },
            &|k| matches!(k, GgufErrorKind::TensorSizeOverflow { .. }),
        ),
        (
            {
                let mut r = Raw::header(3, 1, 0);
                r.tensor("q", &[48], GgmlType::Q4_0.id(), 0).data(64);
                r
            },
            &|k| matches!(k, GgufErrorKind::RowNotBlockMultiple { ne0: 48, ggml_type: GgmlType::Q4_0, .. }),
        ),
    ];
    for (raw, check) in cases {
        let e = raw.err();
        assert!(check(e.kind()), "unexpected {e}");
    }
}

#[test]
fn unknown_type_ids_are_named() {
    for retired in [4u32, 5, 31, 36, 42, u32::MAX] {
        let mut r = Raw::header(3, 1, 0);
        r.tensor("blk.0.attn_qkv.weight", &[32], retired, 0).data(64);
        let e = r.err();
        assert_eq!(
            e.to_string(),
            format!("hostile.gguf: tensor 'blk.0.attn_qkv.weight' has unknown ggml type id {retired}")
        );
    }
    let mut r = Raw::header(3, 0, 1);
    r.str("qwen4exp.block_count").u32(13).u32(48);
    assert_eq!(r.err().to_string(), "hostile.gguf: key 'qwen4exp.block_count' has unknown value type id 13");
    let mut r = Raw::header(3, 0, 1);
    r.str("arr").u32(ValueType::Array.id()).u32(99).u64(0);
    assert!(matches!(r.err().kind(), GgufErrorKind::UnknownValueType { type_id: 99, key } if key == "arr"));
}

#[test]
fn data_beyond_the_end_misaligned_or_overlapping_is_refused() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("blk.3.attn_q.weight", &[16], GgmlType::F32.id(), 32).data(64);
    let e = r.err();
    // Header 24 + tensor info (8 + 19 + 4 + 8 + 4 + 8 = 51) = 75, data section at 96, tensor at 128..192.
    assert_eq!(
        e.to_string(),
        "hostile.gguf: tensor 'blk.3.attn_q.weight' data [128..192) lies beyond the end of the file (160 bytes)"
    );

    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[16], GgmlType::F32.id(), u64::MAX - 31).data(64);
    assert!(matches!(r.err().kind(), GgufErrorKind::TensorBeyondEnd { start: u64::MAX, end: u64::MAX, .. }));

    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[1], GgmlType::F32.id(), 4).data(64);
    assert!(matches!(r.err().kind(), GgufErrorKind::MisalignedOffset { offset: 4, alignment: 32, .. }));

    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[16], GgmlType::F32.id(), 0).tensor("b", &[4], GgmlType::F32.id(), 32).data(96);
    let e = r.err();
    assert!(
        matches!(e.kind(), GgufErrorKind::TensorOverlap { tensor, other, .. } if tensor == "b" && other == "a"),
        "{e}"
    );

    let mut r = Raw::header(3, 2, 0);
    r.tensor("a", &[8], GgmlType::F32.id(), 0).tensor("b", &[4], GgmlType::F32.id(), 32).data(64);
    assert!(r.parse().is_ok(), "adjacent tensors do not overlap");
}

#[test]
fn duplicates_are_refused() {
    let mut r = Raw::header(3, 0, 2);
    r.kv_u32("general.x", 1).kv_u32("general.x", 2);
    assert_eq!(r.err().to_string(), "hostile.gguf: duplicate metadata key 'general.x'");
    let mut r = Raw::header(3, 2, 0);
    r.tensor("t", &[8], GgmlType::F32.id(), 0).tensor("t", &[8], GgmlType::F32.id(), 32).data(64);
    assert_eq!(r.err().to_string(), "hostile.gguf: duplicate tensor name 't'");
}

#[test]
fn nesting_is_capped() {
    let nested = |levels: u32| {
        let mut r = Raw::header(3, 0, 1);
        r.str("deep").u32(ValueType::Array.id());
        for _ in 1..levels {
            r.u32(ValueType::Array.id()).u64(1);
        }
        r.u32(ValueType::U8.id()).u64(1).u8(7);
        r
    };
    let f = nested(MAX_ARRAY_DEPTH).parse().unwrap();
    let mut v = f.get("deep").unwrap();
    for _ in 0..MAX_ARRAY_DEPTH {
        v = &v.as_array().unwrap().values[0];
    }
    assert_eq!(v, &MetadataValue::U8(7));
    let e = nested(MAX_ARRAY_DEPTH + 1).err();
    assert!(matches!(e.kind(), GgufErrorKind::NestingTooDeep { .. }), "{e}");
    assert_eq!(e.to_string(), "hostile.gguf: key 'deep': arrays nested deeper than 8 levels");
}

#[test]
fn alignment_must_be_a_power_of_two() {
    for (value_type, bytes) in [
        (4u32, 0u32.to_le_bytes().to_vec()),
        (4, 48u32.to_le_bytes().to_vec()),
        (10, (1u64 << 33).to_le_bytes().to_vec()),
    ] {
        let mut r = Raw::header(3, 0, 1);
        r.str("general.alignment").u32(value_type);
        r.0.extend_from_slice(&bytes);
        assert!(matches!(r.err().kind(), GgufErrorKind::BadAlignment { .. }), "type {value_type} {bytes:?}");
    }
    let mut r = Raw::header(3, 0, 1);
    r.str("general.alignment").u32(ValueType::String.id()).str("32");
    assert!(r.err().to_string().contains("'general.alignment' has type string, expected u32"));
    // Any integer type holding a power of two is accepted.
    let mut r = Raw::header(3, 1, 1);
    r.str("general.alignment").u32(ValueType::U64.id()).u64(8).tensor("t", &[1], GgmlType::F32.id(), 0);
    r.0.resize(r.0.len().next_multiple_of(8) + 8, 0);
    assert_eq!(r.parse().unwrap().alignment(), 8);
}

#[test]
fn invalid_bools_and_utf8_are_refused() {
    let mut r = Raw::header(3, 0, 1);
    r.str("b").u32(ValueType::Bool.id()).u8(2);
    assert!(matches!(r.err().kind(), GgufErrorKind::InvalidBool { byte: 2, .. }));
    let mut r = Raw::header(3, 0, 1);
    r.u64(2).u8(0xff).u8(0xfe).u32(4).u32(0);
    let e = r.err();
    assert!(matches!(e.kind(), GgufErrorKind::InvalidUtf8 { offset: 32, .. }), "{e}");
}

/// Inputs that crashed, hung or exhausted memory under the fuzzer (`engine/fuzz`), kept as regressions: each must
/// now be refused with an error, without panicking.
#[test]
fn fuzzer_regressions() {
    let dir = testdata().join("regressions");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("testdata/regressions exists") {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if name == "README.md" {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let result = std::panic::catch_unwind(|| GgufFile::from_bytes(&name, bytes).map(|_| ()));
        let result = result.unwrap_or_else(|_| panic!("{name}: panicked"));
        let e = result.expect_err("a fuzzer regression input parsed");
        eprintln!("{e}");
        // The inputs found by the mutation check (README.md) must hit the guard that the mutant had removed.
        if name.starts_with("oom-98d02ef2") {
            assert!(matches!(e.kind(), GgufErrorKind::CountBeyondEnd { .. }), "{e}");
        }
        if name.starts_with("crash-0cbe0150") {
            assert!(matches!(e.kind(), GgufErrorKind::TensorBeyondEnd { .. }), "{e}");
        }
        n += 1;
    }
    assert!(n >= 2, "the committed regression inputs are missing");
    eprintln!("{n} fuzzer regression inputs refused");
}

#[test]
fn vocabulary_sized_metadata_round_trips() {
    let dir = TempDir::new("vocab");
    let path = dir.path().join("vocab.gguf");
    let tokens: Vec<String> = (0..248_320).map(|i| format!("tok{i}")).collect();
    let merges: Vec<String> = (0..247_587).map(|i| format!("a{i} b{i}")).collect();
    let mut w = GgufWriter::create(&path, 32).unwrap();
    w.add_kv("tokenizer.ggml.tokens", tokens.clone()).unwrap();
    w.add_kv("tokenizer.ggml.merges", merges.clone()).unwrap();
    w.add_kv("tokenizer.ggml.token_type", vec![1i32; tokens.len()]).unwrap();
    w.begin_data().unwrap().finish().unwrap();
    let t = std::time::Instant::now();
    let f = GgufFile::open(&path).unwrap();
    let elapsed = t.elapsed();
    assert_eq!(f.get_string_array("tokenizer.ggml.tokens").unwrap(), tokens);
    assert_eq!(f.get_string_array("tokenizer.ggml.merges").unwrap()[247_586], "a247586 b247586");
    assert_eq!(f.get_u32_array("tokenizer.ggml.token_type").unwrap().len(), 248_320);
    eprintln!("parsed {} bytes of metadata in {elapsed:?}", std::fs::metadata(&path).unwrap().len());
}
