//! Split models: file names `<prefix>-%05d-of-%05d.gguf` and the `split.*` keys, as written by llama.cpp's
//! `gguf-split` and gguf-py's `GGUFWriter(split_max_size=...)`.
//!
//! Every part is a complete GGUF file. Part 1 holds the model's metadata; every part holds `split.no` (0-based
//! part index, u16), `split.count` (number of parts, u16) and `split.tensors.count` (tensors over all parts, i32),
//! and its own tensors.

use std::path::{Path, PathBuf};

/// Key: 0-based index of this part.
pub const KEY_SPLIT_NO: &str = "split.no";
/// Key: number of parts.
pub const KEY_SPLIT_COUNT: &str = "split.count";
/// Key: number of tensors over all parts.
pub const KEY_SPLIT_TENSORS_COUNT: &str = "split.tensors.count";

/// A path that follows the split naming pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitPath {
    /// Everything before `-NNNNN-of-NNNNN.gguf`, e.g. `models/qwen` for `models/qwen-00002-of-00004.gguf`.
    pub prefix: PathBuf,
    /// 1-based part number.
    pub no: u32,
    /// Number of parts.
    pub count: u32,
}

impl SplitPath {
    /// Parses `path` if its file name is `<prefix>-NNNNN-of-MMMMM.gguf` with `1 <= NNNNN <= MMMMM`, numbers printed
    /// as `%05d` (at least five digits, no extra leading zeros beyond that).
    pub fn parse(path: &Path) -> Option<SplitPath> {
        let file_name = path.file_name()?.to_str()?;
        let stem = file_name.strip_suffix(".gguf")?;
        let (head, count) = stem.rsplit_once("-of-")?;
        let (name, no) = head.rsplit_once('-')?;
        let no = parse_number(no)?;
        let count = parse_number(count)?;
        if name.is_empty() || no == 0 || no > count {
            return None;
        }
        Some(SplitPath { prefix: path.with_file_name(name), no, count })
    }

    /// The path of part `no` (1-based) of this set.
    pub fn part(&self, no: u32) -> PathBuf {
        part_path(&self.prefix, no, self.count)
    }
}

/// `<prefix>-{no:05}-of-{count:05}.gguf`.
pub fn part_path(prefix: &Path, no: u32, count: u32) -> PathBuf {
    let mut name = prefix.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!("-{no:05}-of-{count:05}.gguf"));
    prefix.with_file_name(name)
}

/// A `%05d` number: ASCII digits, at least five, canonical (re-printing gives the same text).
fn parse_number(s: &str) -> Option<u32> {
    if s.len() < 5 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u32 = s.parse().ok()?;
    (format!("{n:05}") == s).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_split_names() {
        let p = SplitPath::parse(Path::new("/m/qwen-00002-of-00004.gguf")).unwrap();
        assert_eq!(p, SplitPath { prefix: "/m/qwen".into(), no: 2, count: 4 });
        assert_eq!(p.part(1), Path::new("/m/qwen-00001-of-00004.gguf"));
        assert_eq!(part_path(Path::new("x"), 123456, 123456), Path::new("x-123456-of-123456.gguf"));
        assert_eq!(SplitPath::parse(Path::new("x-123456-of-123456.gguf")).unwrap().no, 123456);
        assert_eq!(SplitPath::parse(Path::new("a-b-00001-of-00001.gguf")).unwrap().prefix, Path::new("a-b"));
    }

    #[test]
    fn rejects_other_names() {
        for name in [
            "qwen.gguf",
            "qwen-0001-of-00004.gguf",
            "qwen-00005-of-00004.gguf",
            "qwen-00000-of-00004.gguf",
            "qwen-000001-of-00004.gguf",
            "qwen-00001-of-00004.bin",
            "-00001-of-00004.gguf",
            "qwen-0000a-of-00004.gguf",
            "qwen-+0001-of-00004.gguf",
        ] {
            assert_eq!(SplitPath::parse(Path::new(name)), None, "{name}");
        }
    }
}
