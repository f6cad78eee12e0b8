//! Per-sequence state: everything the model remembers between calls, with snapshot and restore.
//!
//! Attention layers keep a KV cache and raw indexer keys that only grow, so a snapshot records their length and
//! a restore truncates them. Recurrent parts (Gated DeltaNet conv + `S`, PLE context + conv history) are
//! overwritten in place by every token, so a snapshot copies them. Used for speculative rollback and prefix
//! caching. A model with an MTP block keeps the block's own KV cache here too ([`MtpState`]), so rollback and the
//! prefix cache carry it along.

use super::linear_attn::GdnState;
use super::mtp::MtpState;
use super::ple::PleState;
use super::self_attn::AttnState;

/// Version of what [`SequenceState`] and [`Snapshot`] hold and mean (which parts, their shapes and the math that
/// fills them). States saved by one version are never resumed by another: the on-disk prefix cache
/// ([`crate::prefix_cache::disk`]) mixes it into the model identity its entries are keyed by. Bump it whenever a
/// change makes a state written before it unfit to resume (a new part, a new shape, a changed recurrence).
/// Version 2: attention caches are typed rows ([`crate::model::KvRows`], the KV cache type of the module docs of
/// `kv_cache`), the type part of the identity.
/// Version 3: also every token's 3-D rope position (M-RoPE after images, [`MropeTrack`]).
pub const STATE_LAYOUT_VERSION: u32 = 3;

/// The state of one decoder layer.
#[derive(Debug, Clone, PartialEq)]
pub enum LayerState {
    /// Gated DeltaNet conv history and recurrent state.
    LinearAttention(GdnState),
    /// KV cache and indexer keys.
    Attention(AttnState),
}

/// All state of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceState {
    /// Tokens consumed so far (the next token's position).
    pub pos: usize,
    /// Maximum tokens this sequence may hold.
    pub max_len: usize,
    /// One per trunk layer.
    pub layers: Vec<LayerState>,
    /// PLE context, if the model has PLE.
    pub ple: Option<PleState>,
    /// The MTP block's cache, if the model has an MTP block loaded.
    pub mtp: Option<MtpState>,
    /// The stream a routing override follows for this sequence ([`crate::synth::routing::stream_key`] of its first
    /// token, set when position 0 is consumed; forks keep their source's). Only benchmarks with an override read
    /// it; it is not part of the prefix cache's disk images (a state read back from disk has 0).
    pub routing_stream: u64,
    /// The 3-D rope position of every token consumed (cut by length, like the attention caches).
    pub mrope: MropeTrack,
}

/// The `[t, h, w]` rope positions of a sequence's tokens (M-RoPE). While every token's position equals its
/// index (text only), nothing is stored; the first token with another position (a vision token, or text after
/// one) stores them all from then on. The next text token takes [`MropeTrack::next_text`]: one past the largest
/// position so far, as the reference continues text after an image.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MropeTrack {
    /// Every token's position, or empty while each equals its index.
    explicit: Vec<[u32; 3]>,
    /// One past the largest position component so far (the token count while `explicit` is empty).
    next: u32,
}

impl MropeTrack {
    /// A track of `len` text tokens.
    pub fn text(len: usize) -> Self {
        Self { explicit: Vec::new(), next: len as u32 }
    }

    /// A track of `len` tokens with these positions (a state image read back; empty: the tokens are text at
    /// their indices).
    pub fn from_positions(positions: Vec<[u32; 3]>, len: usize) -> Self {
        if positions.is_empty() {
            return Self::text(len);
        }
        let mut t = Self { explicit: positions, next: 0 };
        t.truncate(len);
        t
    }

    /// The stored positions (empty while they equal the indices).
    pub fn explicit(&self) -> &[[u32; 3]] {
        &self.explicit
    }

    /// The position of token `i` (of a sequence that holds it).
    pub fn position(&self, i: usize) -> [u32; 3] {
        self.explicit.get(i).copied().unwrap_or([i as u32; 3])
    }

    /// The position the next text token takes.
    pub fn next_text(&self) -> u32 {
        self.next
    }

    /// Appends token number `index` (the sequence's length before it) at `p`.
    pub fn push(&mut self, index: usize, p: [u32; 3]) {
        if self.explicit.is_empty() && p == [index as u32; 3] {
            self.next = index as u32 + 1;
            return;
        }
        if self.explicit.is_empty() {
            self.explicit.extend((0..index as u32).map(|i| [i; 3]));
        }
        self.explicit.push(p);
        self.next = self.next.max(p[0].max(p[1]).max(p[2]) + 1);
    }

    /// Keeps the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        if self.explicit.is_empty() {
            self.next = self.next.min(len as u32);
            return;
        }
        self.explicit.truncate(len);
        self.next = self.explicit.iter().map(|p| p[0].max(p[1]).max(p[2]) + 1).max().unwrap_or(0);
        if self.explicit.iter().enumerate().all(|(i, p)| *p == [i as u32; 3]) {
            self.explicit.clear();
            self.next = len as u32;
        }
    }

    /// The first `len` tokens' track.
    pub fn prefix(&self, len: usize) -> Self {
        let mut t = Self { explicit: self.explicit[..len.min(self.explicit.len())].to_vec(), next: self.next };
        t.truncate(len);
        t
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.explicit.len() * 12
    }
}

/// A restorable copy of a [`SequenceState`] at some position.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub(crate) pos: usize,
    pub(crate) recurrent: Vec<Option<GdnState>>,
    pub(crate) ple: Option<PleState>,
    /// The MTP block's pending hidden input ([`MtpState::last_bank`]) at `pos` (its cache is cut by length).
    pub(crate) mtp_bank: Option<Vec<f32>>,
}

impl Snapshot {
    /// Position the snapshot was taken at.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Approximate bytes held by this snapshot (its recurrent and PLE copies).
    pub fn bytes(&self) -> usize {
        let rec: usize = self.recurrent.iter().flatten().map(|g| g.conv.len() + g.recurrent.len()).sum();
        let ple = self.ple.as_ref().map_or(0, |p| p.conv.len() + p.context.len());
        let mtp = self.mtp_bank.as_ref().map_or(0, Vec::len);
        4 * (rec + ple + mtp)
    }
}

impl SequenceState {
    /// Captures the state (copies the recurrent parts; attention caches are remembered by length).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            pos: self.pos,
            recurrent: self
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::LinearAttention(g) => Some(g.clone()),
                    LayerState::Attention(_) => None,
                })
                .collect(),
            ple: self.ple.clone(),
            mtp_bank: self.mtp.as_ref().map(|m| m.last_bank.clone()),
        }
    }

    /// Approximate bytes held by this state.
    pub fn bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::LinearAttention(g) => 4 * (g.conv.len() + g.recurrent.len()),
                LayerState::Attention(a) => a.held_bytes(),
            })
            .sum();
        let ple = self.ple.as_ref().map_or(0, |p| 4 * p.conv.len());
        let mtp = self.mtp.as_ref().map_or(0, |m| m.attn.held_bytes() + 4 * m.last_bank.len());
        layers + ple + mtp + self.mrope.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::MropeTrack;

    /// The track a state carries through snapshots, forks and host images (on every backend; the GPU's device
    /// table is filled from it): text stores nothing, the first image token stores every position from then on,
    /// text after it continues from the image's largest position, and a cut (restore, rollback) or a prefix (fork)
    /// gives the track of the kept tokens, back to nothing stored when only text is left.
    #[test]
    fn the_track_stores_image_positions_and_cuts_back_to_text() {
        let mut t = MropeTrack::default();
        for i in 0..3 {
            t.push(i, [t.next_text(); 3]);
        }
        assert!(t.explicit().is_empty() && t.next_text() == 3 && t.bytes() == 0);
        // A 2 x 3 image at p = 3: positions (3, 3 + r, 3 + c); text then continues at 3 + max(2, 3) = 6.
        for r in 0..2u32 {
            for c in 0..3u32 {
                let i = 3 + (r * 3 + c) as usize;
                t.push(i, [3, 3 + r, 3 + c]);
            }
        }
        assert_eq!(t.next_text(), 6);
        t.push(9, [t.next_text(); 3]);
        assert_eq!(t.explicit().len(), 10);
        assert_eq!((t.position(1), t.position(8), t.position(9)), ([1; 3], [3, 4, 5], [6; 3]));
        // A prefix inside the image keeps its positions; one before it is text again.
        let p = t.prefix(5);
        assert_eq!((p.explicit().len(), p.next_text(), p.position(4)), (5, 5, [3, 3, 4]));
        let q = t.prefix(3);
        assert!(q.explicit().is_empty());
        assert_eq!((q.next_text(), q.position(2)), (3, [2; 3]));
        // A cut is the prefix in place; a host image read back is the same track.
        let mut cut = t.clone();
        cut.truncate(5);
        assert_eq!(cut, p);
        assert_eq!(MropeTrack::from_positions(t.explicit().to_vec(), 10), t);
        assert_eq!(MropeTrack::from_positions(Vec::new(), 4), MropeTrack::text(4));
    }
}
