//! Ordered metadata key-value store with typed getters whose errors name the key.
//!
//! Integer getters accept any of the eight integer value types as long as the value fits the target type,
//! because llama.cpp's writers are not uniform (e.g. `i32` vs `u32` arrays, `u16` split counts). Float getters
//! accept only floats, bool only bool, strings only strings.

use std::collections::HashMap;

use super::error::{GgufError, GgufErrorKind, Result};
use super::types::{MetadataArray, MetadataValue};

/// The key-value section of a GGUF file, in file order, with lookup by key.
///
/// Keys are unique (the reader rejects duplicates). Errors from the getters carry the file label.
#[derive(Debug, Clone, Default)]
pub struct Metadata {
    label: String,
    entries: Vec<(String, MetadataValue)>,
    index: HashMap<String, usize>,
}

impl Metadata {
    /// An empty store whose errors name `label` (a path or a label).
    pub fn new(label: impl Into<String>) -> Self {
        Self { label: label.into(), entries: Vec::new(), index: HashMap::new() }
    }

    /// Appends an entry; returns `false` (and changes nothing) if the key is already present.
    pub(crate) fn insert(&mut self, key: String, value: MetadataValue) -> bool {
        if self.index.contains_key(&key) {
            return false;
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        true
    }

    /// Whether `key` is present.
    pub(crate) fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// All entries, in file order.
    pub fn entries(&self) -> &[(String, MetadataValue)] {
        &self.entries
    }

    /// Iterates over `(key, value)` in file order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &MetadataValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    fn err(&self, kind: GgufErrorKind) -> GgufError {
        GgufError::new(self.label.clone(), kind)
    }

    fn wrong_type(&self, key: &str, value: &MetadataValue, expected: &'static str) -> GgufError {
        self.err(GgufErrorKind::WrongType { key: key.to_string(), found: value.type_description(), expected })
    }

    /// Looks `key` up and converts it; `Ok(None)` when absent.
    fn convert<'a, T>(
        &'a self,
        key: &str,
        convert: impl FnOnce(&'a MetadataValue) -> Result<T, Problem>,
        expected: &'static str,
        target: &'static str,
    ) -> Result<Option<T>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        convert(value).map(Some).map_err(|problem| match problem {
            Problem::WrongType => self.wrong_type(key, value, expected),
            Problem::OutOfRange(shown) => {
                self.err(GgufErrorKind::OutOfRange { key: key.to_string(), value: shown, target })
            }
        })
    }

    fn required<T>(&self, key: &str, value: Result<Option<T>>) -> Result<T> {
        value?.ok_or_else(|| self.err(GgufErrorKind::MissingKey { key: key.to_string() }))
    }
}

/// Why a value could not be converted (the caller adds the key).
enum Problem {
    WrongType,
    OutOfRange(String),
}

fn integer<T: TryFrom<i128>>(value: &MetadataValue) -> Result<T, Problem> {
    let v = value.as_integer().ok_or(Problem::WrongType)?;
    T::try_from(v).map_err(|_| Problem::OutOfRange(v.to_string()))
}

fn integer_array<T: TryFrom<i128>>(value: &MetadataValue) -> Result<Vec<T>, Problem> {
    let array = value.as_array().ok_or(Problem::WrongType)?;
    if !array.elem_type.is_integer() {
        return Err(Problem::WrongType);
    }
    array
        .values
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let v = e.as_integer().ok_or(Problem::WrongType)?;
            T::try_from(v).map_err(|_| Problem::OutOfRange(format!("element {i} = {v}")))
        })
        .collect()
}

fn f32_value(value: &MetadataValue) -> Result<f32, Problem> {
    match value {
        MetadataValue::F32(v) => Ok(*v),
        _ => Err(Problem::WrongType),
    }
}

fn f64_value(value: &MetadataValue) -> Result<f64, Problem> {
    match value {
        MetadataValue::F32(v) => Ok(f64::from(*v)),
        MetadataValue::F64(v) => Ok(*v),
        _ => Err(Problem::WrongType),
    }
}

fn bool_value(value: &MetadataValue) -> Result<bool, Problem> {
    value.as_bool().ok_or(Problem::WrongType)
}

fn str_value(value: &MetadataValue) -> Result<&str, Problem> {
    value.as_str().ok_or(Problem::WrongType)
}

fn array_value(value: &MetadataValue) -> Result<&MetadataArray, Problem> {
    value.as_array().ok_or(Problem::WrongType)
}

fn f32_array(value: &MetadataValue) -> Result<Vec<f32>, Problem> {
    typed_array(value, |e| match e {
        MetadataValue::F32(x) => Some(*x),
        _ => None,
    })
}

fn bool_array(value: &MetadataValue) -> Result<Vec<bool>, Problem> {
    typed_array(value, MetadataValue::as_bool)
}

fn string_array(value: &MetadataValue) -> Result<Vec<&str>, Problem> {
    typed_array(value, MetadataValue::as_str)
}

fn typed_array<'a, T>(
    value: &'a MetadataValue,
    elem: impl Fn(&'a MetadataValue) -> Option<T>,
) -> Result<Vec<T>, Problem> {
    let array = value.as_array().ok_or(Problem::WrongType)?;
    array.values.iter().map(|e| elem(e).ok_or(Problem::WrongType)).collect()
}

/// Generates a required getter and its `_opt` twin for each line. Used for [`Metadata`] and, delegating, for
/// [`super::GgufFile`].
macro_rules! metadata_getters {
    ($($name:ident / $opt:ident -> $t:ty, $conv:expr, $expected:literal, $target:literal, $what:literal;)*) => {
        $(
            #[doc = concat!("The value of `key` as ", $what, ".")]
            ///
            /// # Errors
            /// [`GgufErrorKind::MissingKey`] when absent, [`GgufErrorKind::WrongType`] for another type,
            /// [`GgufErrorKind::OutOfRange`] for an integer that does not fit. The errors name the key.
            pub fn $name(&self, key: &str) -> Result<$t> {
                self.required(key, self.$opt(key))
            }

            #[doc = concat!("The value of `key` as ", $what, ", or `None` when absent.")]
            ///
            /// # Errors
            /// As the required variant, except that a missing key is `Ok(None)`.
            pub fn $opt(&self, key: &str) -> Result<Option<$t>> {
                self.convert(key, $conv, $expected, $target)
            }
        )*
    };
}

impl Metadata {
    metadata_getters! {
        get_u8 / get_u8_opt -> u8, integer::<u8>, "an integer", "u8", "a u8 (from any integer type that fits)";
        get_u16 / get_u16_opt -> u16, integer::<u16>, "an integer", "u16",
            "a u16 (from any integer type that fits)";
        get_u32 / get_u32_opt -> u32, integer::<u32>, "an integer", "u32",
            "a u32 (from any integer type that fits)";
        get_i32 / get_i32_opt -> i32, integer::<i32>, "an integer", "i32",
            "an i32 (from any integer type that fits)";
        get_u64 / get_u64_opt -> u64, integer::<u64>, "an integer", "u64",
            "a u64 (from any integer type that fits)";
        get_i64 / get_i64_opt -> i64, integer::<i64>, "an integer", "i64",
            "an i64 (from any integer type that fits)";
        get_usize / get_usize_opt -> usize, integer::<usize>, "an integer", "usize",
            "a usize (from any integer type that fits)";
        get_f32 / get_f32_opt -> f32, f32_value, "f32", "f32", "an f32 (only type f32)";
        get_f64 / get_f64_opt -> f64, f64_value, "a float", "f64", "an f64 (from f32 or f64)";
        get_bool / get_bool_opt -> bool, bool_value, "bool", "bool", "a bool";
        get_str / get_str_opt -> &str, str_value, "a string", "string", "a string";
        get_array / get_array_opt -> &MetadataArray, array_value, "an array", "array", "an array";
        get_u32_array / get_u32_array_opt -> Vec<u32>, integer_array::<u32>, "an array of integers", "u32",
            "a vector of u32 (elements of any integer type that fit)";
        get_i32_array / get_i32_array_opt -> Vec<i32>, integer_array::<i32>, "an array of integers", "i32",
            "a vector of i32 (elements of any integer type that fit)";
        get_u64_array / get_u64_array_opt -> Vec<u64>, integer_array::<u64>, "an array of integers", "u64",
            "a vector of u64 (elements of any integer type that fit)";
        get_i64_array / get_i64_array_opt -> Vec<i64>, integer_array::<i64>, "an array of integers", "i64",
            "a vector of i64 (elements of any integer type that fit)";
        get_f32_array / get_f32_array_opt -> Vec<f32>, f32_array, "an array of f32", "f32",
            "a vector of f32 (only element type f32)";
        get_bool_array / get_bool_array_opt -> Vec<bool>, bool_array, "an array of bool", "bool",
            "a vector of bool";
        get_string_array / get_string_array_opt -> Vec<&str>, string_array, "an array of strings", "string",
            "a vector of string slices";
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::types::ValueType;

    fn store() -> Metadata {
        let mut m = Metadata::new("t.gguf");
        assert!(m.insert("u16".into(), MetadataValue::U16(7)));
        assert!(m.insert("neg".into(), MetadataValue::I32(-1)));
        assert!(m.insert("big".into(), MetadataValue::U64(u64::MAX)));
        assert!(m.insert("s".into(), MetadataValue::String("qwen4exp".into())));
        assert!(m.insert("f".into(), MetadataValue::F32(1e-6)));
        assert!(m.insert("i32s".into(), vec![11i32, 11, 10, 0].into()));
        assert!(m.insert("negs".into(), vec![1i32, -2].into()));
        assert!(m.insert("strs".into(), vec!["a", "b"].into()));
        assert!(m.insert("bools".into(), vec![true, false].into()));
        assert!(!m.insert("s".into(), MetadataValue::Bool(true)), "duplicate insert must be refused");
        m
    }

    #[test]
    fn integer_getters_widen_and_narrow_when_the_value_fits() {
        let m = store();
        assert_eq!(m.get_u32("u16").unwrap(), 7);
        assert_eq!(m.get_i64("u16").unwrap(), 7);
        assert_eq!(m.get_i32("neg").unwrap(), -1);
        assert_eq!(m.get_u64("big").unwrap(), u64::MAX);
        assert_eq!(m.get_u32_array("i32s").unwrap(), vec![11, 11, 10, 0]);
        assert_eq!(m.get_u64_array("i32s").unwrap(), vec![11, 11, 10, 0]);
        assert_eq!(m.get_i32_array("negs").unwrap(), vec![1, -2]);
    }

    #[test]
    fn out_of_range_and_wrong_type_errors_name_the_key() {
        let m = store();
        let e = m.get_u32("neg").unwrap_err();
        assert!(matches!(e.kind(), GgufErrorKind::OutOfRange { key, target: "u32", .. } if key == "neg"));
        assert_eq!(e.to_string(), "t.gguf: key 'neg' holds -1, which does not fit in u32");
        let e = m.get_u32("big").unwrap_err();
        assert!(matches!(e.kind(), GgufErrorKind::OutOfRange { .. }));
        let e = m.get_u32("s").unwrap_err();
        assert_eq!(e.to_string(), "t.gguf: key 's' has type string, expected an integer");
        let e = m.get_u32_array("negs").unwrap_err();
        assert_eq!(e.to_string(), "t.gguf: key 'negs' holds element 1 = -2, which does not fit in u32");
        let e = m.get_string_array("i32s").unwrap_err();
        assert_eq!(e.to_string(), "t.gguf: key 'i32s' has type array of i32, expected an array of strings");
        assert!(matches!(m.get_f32("u16").unwrap_err().kind(), GgufErrorKind::WrongType { .. }));
        assert!(matches!(m.get_bool("u16").unwrap_err().kind(), GgufErrorKind::WrongType { .. }));
        assert!(matches!(m.get_f32_array("i32s").unwrap_err().kind(), GgufErrorKind::WrongType { .. }));
    }

    #[test]
    fn missing_keys_error_or_give_none() {
        let m = store();
        let e = m.get_u32("qwen4exp.block_count").unwrap_err();
        assert!(matches!(e.kind(), GgufErrorKind::MissingKey { key } if key == "qwen4exp.block_count"));
        assert_eq!(e.to_string(), "t.gguf: missing metadata key 'qwen4exp.block_count'");
        assert_eq!(m.get_u32_opt("absent").unwrap(), None);
        assert_eq!(m.get_u32_opt("u16").unwrap(), Some(7));
        assert!(m.get_u32_opt("s").is_err(), "a present key of the wrong type is an error even for _opt");
    }

    #[test]
    fn other_getters() {
        let m = store();
        assert_eq!(m.get_str("s").unwrap(), "qwen4exp");
        assert_eq!(m.get_f32("f").unwrap(), 1e-6);
        assert_eq!(m.get_f64("f").unwrap(), f64::from(1e-6f32));
        assert_eq!(m.get_string_array("strs").unwrap(), vec!["a", "b"]);
        assert_eq!(m.get_bool_array("bools").unwrap(), vec![true, false]);
        assert_eq!(m.get_array("strs").unwrap().elem_type, ValueType::String);
        let keys: Vec<&str> = m.iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["u16", "neg", "big", "s", "f", "i32s", "negs", "strs", "bools"]);
    }
}
