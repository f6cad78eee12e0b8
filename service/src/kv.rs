//! The KV cache settings of a run (the cache type and the CUDA hot window): a flag or the config over the
//! profile's over the defaults, and what they mean in memory.

use std::path::Path;

use nebula_engine::model::KvCacheType;

/// The KV cache settings in effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSettings {
    /// How the attention caches store their rows.
    pub cache_type: KvCacheType,
    /// The CUDA hot window, tokens, when one was given (a flag, the config or the profile); `None` keeps
    /// `tuning.cuda.kv_window`.
    pub window: Option<usize>,
}

/// The profile's `kv_cache_type` and `kv_window` (a profile written before they existed has neither).
///
/// Errors: a `kv_cache_type` that is not a type (the message names the value).
pub fn from_profile(profile: &serde_json::Value) -> Result<(Option<KvCacheType>, Option<usize>), String> {
    let ty = match profile.get("kv_cache_type").and_then(|v| v.as_str()) {
        Some(t) => Some(t.parse::<KvCacheType>().map_err(|e| format!("the profile's kv_cache_type: {e}"))?),
        None => None,
    };
    let window = profile.get("kv_window").and_then(|v| v.as_u64()).map(|w| w as usize);
    Ok((ty, window))
}

/// The settings of a command without a config file (`nebula bench model`): `ty` and `window` (flags) over the
/// profile's (when `profile` is given) over `f32` and no window.
///
/// Errors: the profile cannot be read or holds an unknown type.
pub fn resolve(profile: Option<&Path>, ty: Option<KvCacheType>, window: Option<usize>) -> anyhow::Result<KvSettings> {
    let (pty, pwindow) = match profile {
        Some(p) => from_profile(&crate::placement::read_profile_value(p).map_err(anyhow::Error::msg)?)
            .map_err(anyhow::Error::msg)?,
        None => (None, None),
    };
    Ok(KvSettings { cache_type: ty.or(pty).unwrap_or_default(), window: window.or(pwindow) })
}

/// Checks a hot window against the prefill chunk: a pass over `max_prefill` tokens must fit in the ring with the
/// block it completes (`backend::cuda::kv_cache`).
///
/// Errors: the two numbers, and what to change.
pub fn check_window(window: usize, max_prefill: usize) -> Result<(), String> {
    if window > 0 && max_prefill + 4 > window {
        return Err(format!(
            "kv_window = {window} tokens cannot take prefill chunks of max_prefill = {max_prefill} tokens (a chunk \
             and a block of 4 must fit in the window): raise kv_window or lower max_prefill"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_over_the_profile_over_the_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("profile.toml");
        std::fs::write(&p, "kv_cache_type = \"q8_0\"\nkv_window = 65536\n").unwrap();
        let s = resolve(Some(&p), None, None).unwrap();
        assert_eq!(s, KvSettings { cache_type: KvCacheType::Q8_0, window: Some(65536) });
        let s = resolve(Some(&p), Some(KvCacheType::Q4_0), Some(0)).unwrap();
        assert_eq!(s, KvSettings { cache_type: KvCacheType::Q4_0, window: Some(0) });
        assert_eq!(resolve(None, None, None).unwrap(), KvSettings { cache_type: KvCacheType::F32, window: None });
        std::fs::write(&p, "kv_cache_type = \"q3_k\"\n").unwrap();
        let e = resolve(Some(&p), None, None).unwrap_err().to_string();
        assert!(e.contains("q3_k"), "{e}");
    }

    #[test]
    fn a_window_must_hold_a_prefill_chunk() {
        assert!(check_window(0, 1 << 20).is_ok());
        assert!(check_window(65536, 2048).is_ok());
        let e = check_window(2048, 2048).unwrap_err();
        assert!(e.contains("2048") && e.contains("max_prefill"), "{e}");
    }
}
