//! Sealed reasoning: the thinking text the server hands to a client in a form only this server can read back, so
//! that a client which keeps no reasoning in clear (the Responses API's `include: ["reasoning.encrypted_content"]`
//! with `store: false`, the Messages API's thinking `signature`) still gives the model its earlier thinking when
//! it replays the conversation.
//!
//! A sealed blob is `base64(nonce || ciphertext || tag)` of XChaCha20-Poly1305 (RFC 8439 with a 192-bit nonce)
//! over the UTF-8 text, with a `nebula-reasoning-v1` associated-data label. The key is `reasoning_seal_key` (32
//! bytes, 64 hex digits) or a random key drawn when the process starts. A blob that does not open (another
//! server's, another process's, or altered) is reported as such; callers ignore it with a warning.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};

/// Associated data bound into every blob, so blobs of another purpose do not open as reasoning.
const LABEL: &[u8] = b"nebula-reasoning-v1";

/// Nonce length of XChaCha20-Poly1305, bytes.
const NONCE_LEN: usize = 24;

/// Seals and opens reasoning text with one key.
#[derive(Clone)]
pub struct ReasoningSeal {
    cipher: XChaCha20Poly1305,
}

impl std::fmt::Debug for ReasoningSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReasoningSeal { .. }")
    }
}

/// Parses a 64-hex-digit key. Errors: the wrong length or a non-hex character.
pub fn parse_key(hex: &str) -> Result<[u8; 32], String> {
    let hex = hex.trim();
    if hex.len() != 64 {
        return Err(format!("expected 64 hex digits (32 bytes), got {} characters", hex.len()));
    }
    let mut key = [0u8; 32];
    for (i, byte) in key.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
            .map_err(|_| format!("not a hex digit pair at position {}", 2 * i))?;
    }
    Ok(key)
}

impl ReasoningSeal {
    /// A seal with a random key (this process only).
    pub fn random() -> Self {
        Self::from_key(rand::random::<[u8; 32]>())
    }

    /// A seal with the configured key (64 hex digits). Errors: see [`parse_key`].
    pub fn from_hex(hex: &str) -> Result<Self, String> {
        parse_key(hex).map(Self::from_key)
    }

    fn from_key(key: [u8; 32]) -> Self {
        Self { cipher: XChaCha20Poly1305::new(&key.into()) }
    }

    /// `text` sealed: base64 of nonce, ciphertext and tag.
    pub fn seal(&self, text: &str) -> String {
        let nonce: [u8; NONCE_LEN] = rand::random();
        let sealed = self
            .cipher
            .encrypt(XNonce::from_slice(&nonce), Payload { msg: text.as_bytes(), aad: LABEL })
            .unwrap_or_default();
        let mut blob = nonce.to_vec();
        blob.extend(sealed);
        STANDARD.encode(blob)
    }

    /// The text of a blob made by [`ReasoningSeal::seal`] with the same key. Errors: not base64, too short, or
    /// it does not authenticate (another key, or altered).
    pub fn open(&self, blob: &str) -> Result<String, &'static str> {
        let bytes = STANDARD.decode(blob.trim()).map_err(|_| "not base64")?;
        if bytes.len() < NONCE_LEN + 16 {
            return Err("too short");
        }
        let (nonce, sealed) = bytes.split_at(NONCE_LEN);
        let text = self
            .cipher
            .decrypt(XNonce::from_slice(nonce), Payload { msg: sealed, aad: LABEL })
            .map_err(|_| "it was sealed by another key or altered")?;
        String::from_utf8(text).map_err(|_| "not UTF-8")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_text_opens_with_its_key_only() {
        let seal = ReasoningSeal::random();
        let blob = seal.seal("The user greets me.");
        assert_ne!(blob, seal.seal("The user greets me."), "a fresh nonce each time");
        assert_eq!(seal.open(&blob).unwrap(), "The user greets me.");
        assert!(ReasoningSeal::random().open(&blob).is_err());
        let mut altered = STANDARD.decode(&blob).unwrap();
        *altered.last_mut().unwrap() ^= 1;
        assert!(seal.open(&STANDARD.encode(altered)).is_err());
        assert!(seal.open("not base64 !").is_err());
        assert!(seal.open("").is_err());
        let keyed = ReasoningSeal::from_hex(&"ab".repeat(32)).unwrap();
        let again = ReasoningSeal::from_hex(&"ab".repeat(32)).unwrap();
        assert_eq!(again.open(&keyed.seal("x")).unwrap(), "x");
        assert!(ReasoningSeal::from_hex("abc").is_err());
        assert!(ReasoningSeal::from_hex(&"zz".repeat(32)).is_err());
    }
}
