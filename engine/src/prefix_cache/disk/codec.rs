//! The file format of one on-disk prefix-cache entry: a finished sequence's tokens, its [`SequenceState`] and
//! its [`Checkpoint`]s.
//!
//! All integers little-endian; `f32` arrays as their raw little-endian bytes; a `vec` is a `u64` element count
//! followed by the elements; an `opt` is a `u8` tag (0 absent, 1 present) followed by the value.
//!
//! ```text
//! prelude  (32 bytes) magic "NBPC", format version u32, header length H u64, body length B u64,
//!                     header checksum u64 = XXH3-64 of the prelude's first 24 bytes and the header
//! header   (H bytes)  model identity digest (16 bytes), tokens vec<u32>,
//!                     checkpoints vec<{pos u64, has_logits u8}>
//! body     (B bytes)  state: pos u64, max_len u64, layers vec<{tag u8: 0 linear attention (conv vec<f32>,
//!                     recurrent vec<f32>) | 1 attention (k, v, index_k, pooled: rows)}>,
//!                     ple opt<{context vec<u32>, conv vec<f32>}>,
//!                     mtp opt<{k, v, index_k, pooled: rows, last_bank vec<f32>, drafted_with opt<u32>}>,
//!                     rope positions vec<u32> (t, h, w of every token; empty while each equals its index);
//!                     then per checkpoint of the header: pos u64, recurrent vec<opt<{conv, recurrent}>>,
//!                     ple opt<...>, mtp_bank opt<vec<f32>>, logits opt<vec<f32>>
//! trailer  (8 bytes)  body checksum u64 = XXH3-64 of the body
//! ```
//!
//! `rows` is one attention cache in its KV cache type ([`crate::model::KvRows`]): the type's id u8 (ggml's type
//! ids: 0 f32, 1 f16, 2 q4_0, 8 q8_0), the row width u64, and the stored bytes vec<u8> (the layout of
//! `model::kv_cache`).
//!
//! The header alone is enough to index an entry (what it covers, where it can resume), so a directory of large
//! entries is scanned without reading their states. Decoding checks everything: magic, version, the file's
//! length against the prelude, both checksums, every tag and count (an array never claims more bytes than are
//! left), and the decoded entry against the model's state shapes ([`ModelIdentity`]): layer kinds, recurrent,
//! PLE and MTP sizes, attention caches of exactly `pos` tokens, checkpoints at or before the state's end and
//! shaped like it. A byte string that is not a valid entry gives a [`CodecError`], never a panic; arrays are
//! allocated only for bytes that are there, so memory follows the input's length, never a count it claims.

use std::io::{self, Read, Write};

use xxhash_rust::xxh3::Xxh3;

use super::Checkpoint;
use super::identity::{LayerShape, ModelIdentity, StateShape};
use crate::model::linear_attn::GdnState;
use crate::model::mtp::MtpState;
use crate::model::ple::PleState;
use crate::model::self_attn::AttnState;
use crate::model::state::LayerState;
use crate::model::{KvCacheType, KvRows, SequenceState, Snapshot};

/// The four bytes every entry starts with.
pub const MAGIC: [u8; 4] = *b"NBPC";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 2;
/// Bytes before the header.
pub const PRELUDE_BYTES: u64 = 32;
/// Bytes after the body.
pub const TRAILER_BYTES: u64 = 8;

/// Why bytes are not a usable entry.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// Reading or writing failed.
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    /// The first four bytes are not [`MAGIC`].
    #[error("not a prefix-cache entry: magic {found:02x?}, expected {MAGIC:02x?}")]
    Magic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// Written in another format version.
    #[error("format version {found}; this build reads version {FORMAT_VERSION}")]
    Version {
        /// The version found.
        found: u32,
    },
    /// The entry's length differs from what its prelude declares (truncated or extended).
    #[error("the entry is {actual} bytes, its prelude declares {declared}")]
    Length {
        /// Bytes the prelude declares (saturated at `u64::MAX`).
        declared: u64,
        /// Bytes there are.
        actual: u64,
    },
    /// The prelude or header does not match its checksum.
    #[error("header checksum mismatch (stored {stored:016x}, computed {computed:016x})")]
    HeaderChecksum {
        /// Stored in the prelude.
        stored: u64,
        /// Computed from the bytes.
        computed: u64,
    },
    /// The body does not match its checksum.
    #[error("body checksum mismatch (stored {stored:016x}, computed {computed:016x})")]
    BodyChecksum {
        /// Stored in the trailer.
        stored: u64,
        /// Computed from the bytes.
        computed: u64,
    },
    /// Written for another model (or another engine state layout).
    #[error("written for model identity {found:032x}, not {expected:032x}")]
    Identity {
        /// The entry's identity digest.
        found: u128,
        /// This model's.
        expected: u128,
    },
    /// A field is out of range or inconsistent with another.
    #[error("malformed entry: {0}")]
    Malformed(String),
}

fn malformed(msg: impl Into<String>) -> CodecError {
    CodecError::Malformed(msg.into())
}

/// Where an entry can resume, as its header lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// Tokens the checkpoint covers.
    pub pos: usize,
    /// Whether the logits after them are kept (resuming there needs no forward).
    pub has_logits: bool,
}

/// An entry's header: enough to index it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryHeader {
    /// The [`ModelIdentity::digest`] it was written under.
    pub identity: u128,
    /// Tokens the state consumed.
    pub tokens: Vec<u32>,
    /// Its checkpoints, in stored order.
    pub checkpoints: Vec<CheckpointInfo>,
    /// Bytes of the whole entry.
    pub file_bytes: u64,
}

// ---------------------------------------------------------------------------------------------------------------
// Writing

/// Where encoded bytes go: counted (to size the body before writing it) or hashed and written.
trait Sink {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()>;

    fn u8(&mut self, v: u8) -> io::Result<()> {
        self.put(&[v])
    }
    fn u64(&mut self, v: usize) -> io::Result<()> {
        self.put(&(v as u64).to_le_bytes())
    }
    fn f32s(&mut self, v: &[f32]) -> io::Result<()> {
        self.u64(v.len())?;
        if cfg!(target_endian = "little") {
            self.put(bytemuck::cast_slice(v))
        } else {
            v.iter().try_for_each(|x| self.put(&x.to_le_bytes()))
        }
    }
    fn u32s(&mut self, v: &[u32]) -> io::Result<()> {
        self.u64(v.len())?;
        if cfg!(target_endian = "little") {
            self.put(bytemuck::cast_slice(v))
        } else {
            v.iter().try_for_each(|x| self.put(&x.to_le_bytes()))
        }
    }
    fn rows(&mut self, r: &KvRows) -> io::Result<()> {
        self.u8(r.ty().id() as u8)?;
        self.u64(r.width())?;
        let bytes = r.bytes(r.len());
        self.u64(bytes.len())?;
        self.put(&bytes)
    }
}

struct Counter(u64);

impl Sink for Counter {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.0 += bytes.len() as u64;
        Ok(())
    }
}

struct Hashing<W> {
    out: W,
    hash: Xxh3,
}

impl<W: Write> Sink for Hashing<W> {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.hash.update(bytes);
        self.out.write_all(bytes)
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.extend_from_slice(bytes);
        Ok(())
    }
}

fn put_gdn(s: &mut impl Sink, g: &GdnState) -> io::Result<()> {
    s.f32s(&g.conv)?;
    s.f32s(&g.recurrent)
}

fn put_attn(s: &mut impl Sink, a: &AttnState) -> io::Result<()> {
    [&a.k, &a.v, &a.index_k, &a.pooled].into_iter().try_for_each(|r| s.rows(r))
}

fn put_ple(s: &mut impl Sink, p: Option<&PleState>) -> io::Result<()> {
    match p {
        Some(p) => {
            s.u8(1)?;
            s.u32s(&p.context)?;
            s.f32s(&p.conv)
        }
        None => s.u8(0),
    }
}

fn put_body(s: &mut impl Sink, state: &SequenceState, checkpoints: &[Checkpoint]) -> io::Result<()> {
    s.u64(state.pos)?;
    s.u64(state.max_len)?;
    s.u64(state.layers.len())?;
    for l in &state.layers {
        match l {
            LayerState::LinearAttention(g) => {
                s.u8(0)?;
                put_gdn(s, g)?;
            }
            LayerState::Attention(a) => {
                s.u8(1)?;
                put_attn(s, a)?;
            }
        }
    }
    put_ple(s, state.ple.as_ref())?;
    match &state.mtp {
        Some(m) => {
            s.u8(1)?;
            put_attn(s, &m.attn)?;
            s.f32s(&m.last_bank)?;
            match m.drafted_with {
                Some(t) => {
                    s.u8(1)?;
                    s.put(&t.to_le_bytes())?;
                }
                None => s.u8(0)?,
            }
        }
        None => s.u8(0)?,
    }
    let flat: Vec<u32> = state.mrope.explicit().iter().flatten().copied().collect();
    s.u32s(&flat)?;
    for cp in checkpoints {
        let snap = &cp.snapshot;
        s.u64(snap.pos)?;
        s.u64(snap.recurrent.len())?;
        for r in &snap.recurrent {
            match r {
                Some(g) => {
                    s.u8(1)?;
                    put_gdn(s, g)?;
                }
                None => s.u8(0)?,
            }
        }
        put_ple(s, snap.ple.as_ref())?;
        for v in [&snap.mtp_bank, &cp.logits] {
            match v {
                Some(v) => {
                    s.u8(1)?;
                    s.f32s(v)?;
                }
                None => s.u8(0)?,
            }
        }
    }
    Ok(())
}

/// Offsets (from the body's start) and widths of the body's tags, counts and positions: the bytes that steer
/// decoding (array payloads and `max_len` excluded).
#[cfg(test)]
pub(super) fn body_fields(state: &SequenceState, checkpoints: &[Checkpoint]) -> Vec<(u64, u64)> {
    struct Fields(u64, Vec<(u64, u64)>);
    impl Sink for Fields {
        fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
            self.0 += bytes.len() as u64;
            Ok(())
        }
        fn u8(&mut self, v: u8) -> io::Result<()> {
            self.1.push((self.0, 1));
            self.put(&[v])
        }
        fn u64(&mut self, v: usize) -> io::Result<()> {
            self.1.push((self.0, 8));
            self.put(&(v as u64).to_le_bytes())
        }
    }
    let mut f = Fields(0, Vec::new());
    put_body(&mut f, state, checkpoints).expect("recording cannot fail");
    f.1.retain(|&(at, _)| at != 8);
    f.1
}

/// Bytes [`encode`] writes for this entry.
pub fn encoded_bytes(tokens: &[u32], state: &SequenceState, checkpoints: &[Checkpoint]) -> u64 {
    let mut body = Counter(0);
    put_body(&mut body, state, checkpoints).expect("counting cannot fail");
    PRELUDE_BYTES + header_bytes(tokens.len(), checkpoints.len()) + body.0 + TRAILER_BYTES
}

fn header_bytes(tokens: usize, checkpoints: usize) -> u64 {
    16 + 8 + 4 * tokens as u64 + 8 + 9 * checkpoints as u64
}

/// Writes the entry (`tokens` consumed by `state`, with `checkpoints` taken along the way) under `identity` to
/// `out`; returns the bytes written ([`encoded_bytes`]). `out` should be buffered.
///
/// # Errors
/// [`CodecError::Malformed`] when the entry would not decode: `state.pos != tokens.len()`, or a part shaped
/// unlike `identity`'s model (checked as [`decode`] checks); nothing is written then. [`CodecError::Io`] when
/// writing fails (part of the entry may have been written).
pub fn encode<W: Write>(
    out: W,
    identity: &ModelIdentity,
    tokens: &[u32],
    state: &SequenceState,
    checkpoints: &[Checkpoint],
) -> Result<u64, CodecError> {
    check_entry(&identity.shape, tokens.len(), state, checkpoints)?;
    let mut header = Vec::new();
    header.put(&identity.digest().to_le_bytes())?;
    header.u32s(tokens)?;
    header.u64(checkpoints.len())?;
    for cp in checkpoints {
        header.u64(cp.snapshot.pos)?;
        header.u8(cp.logits.is_some() as u8)?;
    }
    debug_assert_eq!(header.len() as u64, header_bytes(tokens.len(), checkpoints.len()));
    let mut body_len = Counter(0);
    put_body(&mut body_len, state, checkpoints)?;

    let mut prelude = Vec::with_capacity(PRELUDE_BYTES as usize);
    prelude.put(&MAGIC)?;
    prelude.put(&FORMAT_VERSION.to_le_bytes())?;
    prelude.u64(header.len())?;
    prelude.put(&body_len.0.to_le_bytes())?;
    let mut h = Xxh3::new();
    h.update(&prelude);
    h.update(&header);
    prelude.put(&h.digest().to_le_bytes())?;

    let mut out = out;
    out.write_all(&prelude)?;
    out.write_all(&header)?;
    let mut body = Hashing { out, hash: Xxh3::new() };
    put_body(&mut body, state, checkpoints)?;
    let Hashing { mut out, hash } = body;
    out.write_all(&hash.digest().to_le_bytes())?;
    out.flush()?;
    Ok(PRELUDE_BYTES + header.len() as u64 + body_len.0 + TRAILER_BYTES)
}

// ---------------------------------------------------------------------------------------------------------------
// Reading

/// Reads at most `left` more bytes of `r`, hashing them.
struct Source<R> {
    r: R,
    left: u64,
    hash: Xxh3,
    what: &'static str,
}

impl<R: Read> Source<R> {
    fn new(r: R, left: u64, what: &'static str) -> Self {
        Self { r, left, hash: Xxh3::new(), what }
    }

    fn take(&mut self, n: u64) -> Result<(), CodecError> {
        if n > self.left {
            return Err(malformed(format!("the {} needs {n} more bytes, {} are left", self.what, self.left)));
        }
        self.left -= n;
        Ok(())
    }

    fn fill(&mut self, buf: &mut [u8]) -> Result<(), CodecError> {
        self.take(buf.len() as u64)?;
        self.r.read_exact(buf)?;
        self.hash.update(buf);
        Ok(())
    }

    fn u8(&mut self) -> Result<u8, CodecError> {
        let mut b = [0; 1];
        self.fill(&mut b)?;
        Ok(b[0])
    }

    fn u64(&mut self) -> Result<u64, CodecError> {
        let mut b = [0; 8];
        self.fill(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn usize(&mut self, field: &str) -> Result<usize, CodecError> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| malformed(format!("{field} = {v} does not fit this machine")))
    }

    fn flag(&mut self, field: &str) -> Result<bool, CodecError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            t => Err(malformed(format!("{field}: tag {t}, expected 0 or 1"))),
        }
    }

    /// A count of items of at least `min_item` bytes each, refused when they cannot fit in what is left.
    fn count(&mut self, field: &str, min_item: u64) -> Result<usize, CodecError> {
        let n = self.usize(field)?;
        if (n as u64).saturating_mul(min_item) > self.left {
            return Err(malformed(format!("{field}: {n} items cannot fit in the {} bytes left", self.left)));
        }
        Ok(n)
    }

    fn f32s(&mut self, field: &str) -> Result<Vec<f32>, CodecError> {
        let n = self.count(field, 4)?;
        let mut v = vec![0f32; n];
        self.fill(bytemuck::cast_slice_mut(&mut v))?;
        if cfg!(target_endian = "big") {
            v.iter_mut().for_each(|x| *x = f32::from_bits(u32::from_le(x.to_bits())));
        }
        Ok(v)
    }

    fn u32s(&mut self, field: &str) -> Result<Vec<u32>, CodecError> {
        let n = self.count(field, 4)?;
        let mut v = vec![0u32; n];
        self.fill(bytemuck::cast_slice_mut(&mut v))?;
        if cfg!(target_endian = "big") {
            v.iter_mut().for_each(|x| *x = u32::from_le(*x));
        }
        Ok(v)
    }

    fn gdn(&mut self) -> Result<GdnState, CodecError> {
        Ok(GdnState { conv: self.f32s("GDN conv")?, recurrent: self.f32s("GDN recurrent")? })
    }

    /// One attention cache: its type, width and bytes (a whole number of rows).
    fn rows(&mut self, field: &str) -> Result<KvRows, CodecError> {
        let id = self.u8()?;
        let ty = KvCacheType::from_id(u32::from(id))
            .ok_or_else(|| malformed(format!("{field}: KV cache type id {id} (0, 1, 2 or 8)")))?;
        let width = self.usize(field)?;
        let n = self.count(field, 1)?;
        let mut bytes = vec![0u8; n];
        self.fill(&mut bytes)?;
        KvRows::from_bytes(ty, width, bytes).map_err(|e| malformed(format!("{field}: {e}")))
    }

    fn attn(&mut self) -> Result<AttnState, CodecError> {
        Ok(AttnState {
            k: self.rows("attention k")?,
            v: self.rows("attention v")?,
            index_k: self.rows("indexer keys")?,
            pooled: self.rows("pooled keys")?,
        })
    }

    fn ple(&mut self) -> Result<Option<PleState>, CodecError> {
        if !self.flag("PLE")? {
            return Ok(None);
        }
        Ok(Some(PleState { context: self.u32s("PLE context")?, conv: self.f32s("PLE conv")? }))
    }

    fn opt_f32s(&mut self, field: &str) -> Result<Option<Vec<f32>>, CodecError> {
        if self.flag(field)? { self.f32s(field).map(Some) } else { Ok(None) }
    }

    /// Ends the section: every byte consumed. Returns the section's hash.
    fn finish(self) -> Result<u64, CodecError> {
        if self.left != 0 {
            return Err(malformed(format!("{} bytes left over after the {}", self.left, self.what)));
        }
        Ok(self.hash.digest())
    }
}

/// The prelude's fields.
struct Prelude {
    header: u64,
    body: u64,
    bytes: [u8; 24],
    header_checksum: u64,
}

fn read_prelude(r: &mut impl Read, file_bytes: u64) -> Result<Prelude, CodecError> {
    let mut p = [0u8; PRELUDE_BYTES as usize];
    if file_bytes < PRELUDE_BYTES {
        return Err(CodecError::Length { declared: PRELUDE_BYTES + TRAILER_BYTES, actual: file_bytes });
    }
    r.read_exact(&mut p)?;
    let word = |at: usize| u64::from_le_bytes(p[at..at + 8].try_into().expect("8 bytes"));
    let magic: [u8; 4] = p[0..4].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(CodecError::Magic { found: magic });
    }
    let version = u32::from_le_bytes(p[4..8].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(CodecError::Version { found: version });
    }
    let (header, body) = (word(8), word(16));
    let declared = PRELUDE_BYTES.saturating_add(header).saturating_add(body).saturating_add(TRAILER_BYTES);
    if declared != file_bytes {
        return Err(CodecError::Length { declared, actual: file_bytes });
    }
    Ok(Prelude { header, body, bytes: p[..24].try_into().expect("24 bytes"), header_checksum: word(24) })
}

fn read_header_after(r: &mut impl Read, prelude: &Prelude, file_bytes: u64) -> Result<EntryHeader, CodecError> {
    let mut s = Source::new(r, prelude.header, "header");
    s.hash.update(&prelude.bytes);
    let mut id = [0u8; 16];
    s.fill(&mut id)?;
    let tokens = s.u32s("tokens")?;
    let n = s.count("checkpoints", 9)?;
    let mut checkpoints = Vec::new();
    for _ in 0..n {
        let pos = s.usize("checkpoint position")?;
        let has_logits = s.flag("checkpoint logits")?;
        checkpoints.push(CheckpointInfo { pos, has_logits });
    }
    let computed = s.finish()?;
    if computed != prelude.header_checksum {
        return Err(CodecError::HeaderChecksum { stored: prelude.header_checksum, computed });
    }
    Ok(EntryHeader { identity: u128::from_le_bytes(id), tokens, checkpoints, file_bytes })
}

/// Reads and checks an entry's prelude and header from the start of `r`, whose total length is `file_bytes`
/// (the file's size). Reads only the first `32 + header length` bytes; the body is not checked.
///
/// # Errors
/// [`CodecError`]: I/O, wrong magic or version, a length that disagrees with `file_bytes`, a malformed header or
/// a header checksum mismatch.
pub fn read_header(mut r: impl Read, file_bytes: u64) -> Result<EntryHeader, CodecError> {
    let prelude = read_prelude(&mut r, file_bytes)?;
    read_header_after(&mut r, &prelude, file_bytes)
}

/// A decoded entry.
#[derive(Debug, Clone)]
pub struct DecodedEntry {
    /// Its header.
    pub header: EntryHeader,
    /// The sequence's state after all of `header.tokens`.
    pub state: SequenceState,
    /// Its checkpoints, in the header's order.
    pub checkpoints: Vec<Checkpoint>,
}

/// Reads a whole entry from `r` (the file's `file_bytes` bytes) and checks it: everything [`read_header`]
/// checks, the identity against `identity`, the body's structure and checksum, and the entry's shapes against
/// `identity`'s model.
///
/// # Errors
/// As [`read_header`], plus [`CodecError::Identity`] for an entry of another model, [`CodecError::Malformed`]
/// for a malformed body or one shaped unlike the model, [`CodecError::BodyChecksum`].
pub fn decode(mut r: impl Read, file_bytes: u64, identity: &ModelIdentity) -> Result<DecodedEntry, CodecError> {
    let prelude = read_prelude(&mut r, file_bytes)?;
    let header = read_header_after(&mut r, &prelude, file_bytes)?;
    if header.identity != identity.digest() {
        return Err(CodecError::Identity { found: header.identity, expected: identity.digest() });
    }
    let mut s = Source::new(&mut r, prelude.body, "body");
    let pos = s.usize("state position")?;
    let max_len = s.usize("state max_len")?;
    let n_layers = s.count("layers", 1)?;
    let model_layers = identity.shape.layers.len();
    if n_layers != model_layers {
        return Err(malformed(format!("{n_layers} layer states, the model has {model_layers}")));
    }
    let mut layers = Vec::new();
    for _ in 0..n_layers {
        layers.push(match s.u8()? {
            0 => LayerState::LinearAttention(s.gdn()?),
            1 => LayerState::Attention(s.attn()?),
            t => return Err(malformed(format!("layer tag {t}, expected 0 or 1"))),
        });
    }
    let ple = s.ple()?;
    let mtp = if s.flag("MTP state")? {
        let attn = s.attn()?;
        let last_bank = s.f32s("MTP bank")?;
        let drafted_with = if s.flag("MTP drafted_with")? {
            let mut b = [0u8; 4];
            s.fill(&mut b)?;
            Some(u32::from_le_bytes(b))
        } else {
            None
        };
        Some(MtpState { attn, last_bank, drafted_with })
    } else {
        None
    };
    let flat = s.u32s("rope positions")?;
    if !flat.is_empty() && flat.len() != pos * 3 {
        return Err(malformed(format!("{} rope position values for {pos} tokens", flat.len())));
    }
    let positions = flat.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect();
    let mrope = crate::model::MropeTrack::from_positions(positions, pos);
    let state = SequenceState { pos, max_len, layers, ple, mtp, routing_stream: 0, mrope };
    // No capacity reserved from counts read: what is allocated follows the bytes actually parsed.
    let mut checkpoints = Vec::new();
    for info in &header.checkpoints {
        let pos = s.usize("checkpoint position")?;
        let n = s.count("checkpoint layers", 1)?;
        if n != model_layers {
            return Err(malformed(format!("a checkpoint of {n} layers, the model has {model_layers}")));
        }
        let mut recurrent = Vec::new();
        for _ in 0..n {
            recurrent.push(if s.flag("checkpoint layer")? { Some(s.gdn()?) } else { None });
        }
        let ple = s.ple()?;
        let mtp_bank = s.opt_f32s("checkpoint MTP bank")?;
        let logits = s.opt_f32s("checkpoint logits")?;
        if pos != info.pos || logits.is_some() != info.has_logits {
            return Err(malformed(format!(
                "checkpoint at {pos} (logits {}) differs from the header's {info:?}",
                logits.is_some()
            )));
        }
        checkpoints.push(Checkpoint::new(Snapshot { pos, recurrent, ple, mtp_bank }, logits));
    }
    let computed = s.finish()?;
    let mut stored = [0u8; 8];
    r.read_exact(&mut stored)?;
    let stored = u64::from_le_bytes(stored);
    if computed != stored {
        return Err(CodecError::BodyChecksum { stored, computed });
    }
    check_entry(&identity.shape, header.tokens.len(), &state, &checkpoints)?;
    Ok(DecodedEntry { header, state, checkpoints })
}

// ---------------------------------------------------------------------------------------------------------------
// Shapes

fn check_gdn(g: &GdnState, shape: &LayerShape, at: &str) -> Result<(), CodecError> {
    match *shape {
        LayerShape::LinearAttention { conv, recurrent } if g.conv.len() == conv && g.recurrent.len() == recurrent => {
            Ok(())
        }
        LayerShape::LinearAttention { conv, recurrent } => Err(malformed(format!(
            "{at}: GDN state of {} + {} values, the model's has {conv} + {recurrent}",
            g.conv.len(),
            g.recurrent.len()
        ))),
        LayerShape::Attention { .. } => Err(malformed(format!("{at}: a GDN state where the model has attention"))),
    }
}

/// Checks an attention cache of `rows` tokens.
fn check_attn(a: &AttnState, shape: &LayerShape, rows: usize, at: &str) -> Result<(), CodecError> {
    let LayerShape::Attention { kv_width, index_dim, ratio, kv_type, index_type } = *shape else {
        return Err(malformed(format!("{at}: an attention cache where the model has Gated DeltaNet")));
    };
    let blocks = rows.checked_div(ratio).unwrap_or(0);
    let raw = if ratio > 0 { rows } else { 0 };
    let want = [
        (kv_type, kv_width, rows),
        (kv_type, kv_width, rows),
        (index_type, index_dim, raw),
        (index_type, index_dim, blocks),
    ];
    let got = [&a.k, &a.v, &a.index_k, &a.pooled].map(|r| (r.ty(), r.width(), r.len()));
    if want != got {
        return Err(malformed(format!(
            "{at}: attention caches (type, width, rows) {got:?} for {rows} tokens, expected {want:?}"
        )));
    }
    Ok(())
}

fn check_ple(p: &Option<PleState>, shape: Option<(usize, usize)>, at: &str) -> Result<(), CodecError> {
    match (p, shape) {
        (None, None) => Ok(()),
        (Some(p), Some((context, conv))) if p.context.len() == context && p.conv.len() == conv => Ok(()),
        _ => Err(malformed(format!("{at}: PLE state unlike the model's ({shape:?})"))),
    }
}

/// Checks that an entry is what a model of `shape` could have produced: `state` after `tokens` tokens, the
/// checkpoints taken from it on the way.
fn check_entry(
    shape: &StateShape,
    tokens: usize,
    state: &SequenceState,
    checkpoints: &[Checkpoint],
) -> Result<(), CodecError> {
    let pos = state.pos;
    if pos != tokens || pos > state.max_len {
        return Err(malformed(format!("state at {pos} with max_len {}, for {tokens} tokens", state.max_len)));
    }
    if state.layers.len() != shape.layers.len() {
        return Err(malformed(format!("{} layer states, the model has {}", state.layers.len(), shape.layers.len())));
    }
    for (i, (l, sh)) in state.layers.iter().zip(&shape.layers).enumerate() {
        match l {
            LayerState::LinearAttention(g) => check_gdn(g, sh, &format!("layer {i}"))?,
            LayerState::Attention(a) => check_attn(a, sh, pos, &format!("layer {i}"))?,
        }
    }
    check_ple(&state.ple, shape.ple, "state")?;
    match (&state.mtp, &shape.mtp) {
        (None, _) => {}
        (Some(m), Some((attn, bank))) => {
            // The block's cache holds at most the rows before the pending token (and that one once drafted
            // from); fewer when not aligned, which drafting and forking refuse by themselves.
            let rows = m.attn.len();
            if rows > pos {
                return Err(malformed(format!("MTP cache of {rows} rows at position {pos}")));
            }
            check_attn(&m.attn, attn, rows, "MTP cache")?;
            if !m.last_bank.is_empty() && m.last_bank.len() != *bank {
                return Err(malformed(format!("MTP bank of {} values, expected 0 or {bank}", m.last_bank.len())));
            }
        }
        (Some(_), None) => return Err(malformed("an MTP state, but the model has no MTP block loaded")),
    }
    for cp in checkpoints {
        let snap = &cp.snapshot;
        let at = format!("checkpoint at {}", snap.pos);
        if snap.pos > pos || snap.recurrent.len() != shape.layers.len() {
            return Err(malformed(format!("{at}: {} layers, for a state at {pos}", snap.recurrent.len())));
        }
        for (r, sh) in snap.recurrent.iter().zip(&shape.layers) {
            match (r, sh) {
                (Some(g), _) => check_gdn(g, sh, &at)?,
                (None, LayerShape::Attention { .. }) => {}
                (None, LayerShape::LinearAttention { .. }) => {
                    return Err(malformed(format!("{at}: a Gated DeltaNet layer without its state")));
                }
            }
        }
        check_ple(&snap.ple, shape.ple, &at)?;
        match (&snap.mtp_bank, &state.mtp, &shape.mtp) {
            (None, None, _) => {}
            (Some(b), Some(_), Some((_, bank))) if b.is_empty() || b.len() == *bank => {}
            _ => return Err(malformed(format!("{at}: MTP bank unlike the state's"))),
        }
        if let Some(l) = &cp.logits
            && l.is_empty()
        {
            return Err(malformed(format!("{at}: empty logits")));
        }
    }
    Ok(())
}
