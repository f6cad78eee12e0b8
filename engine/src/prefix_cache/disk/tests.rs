//! The disk cache on real states of the demo model (4 layers: Gated DeltaNet and attention, PLE; a random MTP
//! block appended):
//! the codec round trip resumes bit for bit, damaged bytes are refused without a panic, and the directory
//! survives restarts, damage, other models, its size bound and concurrent writers (threads and processes).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use rand::{Rng, SeedableRng};

use super::codec::{self, CodecError};
use super::*;
use crate::gguf::GgufFile;
use crate::model::{LoadOptions, LogitsFor, Qwen4Exp};

fn demo_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/nebula-demo.gguf")
}

/// The demo model with a random MTP block appended (deterministic: every test process builds the same file),
/// so its states hold every part.
fn demo() -> &'static Qwen4Exp {
    static MODEL: OnceLock<(tempfile::TempDir, Qwen4Exp)> = OnceLock::new();
    &MODEL
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let path = crate::synth::append_random_mtp(&demo_path(), &dir.path().join("mtp.gguf"), 7).unwrap();
            let model = Qwen4Exp::load(&path).expect("the demo model with MTP loads");
            (dir, model)
        })
        .1
}

fn identity() -> ModelIdentity {
    ModelIdentity::of(demo())
}

/// `n` ordinary tokens from `seed`, with an EOS inside (PLE n-grams cross a segment start).
fn tokens(seed: u32, n: usize) -> Vec<u32> {
    let mut t: Vec<u32> = (0..n as u32).map(|i| 1000 + (seed * 104_729 + i * 7919) % 150_000).collect();
    if n > 6 {
        t[n / 2] = 248_044;
    }
    t
}

/// What the worker keeps of a finished request: `tokens` run in chunks that end at each of `marks` (a
/// checkpoint there; the last with its logits when `logits_at_end`), then one MTP draft so the block's cache
/// holds the drafted row too.
fn entry(tokens: &[u32], marks: &[usize], logits_at_end: bool) -> HostEntry {
    let model = demo();
    let mut state = model.new_state(tokens.len() + 64);
    let mut checkpoints = Vec::new();
    for &end in marks {
        let last = end == tokens.len();
        let want = if last && logits_at_end { LogitsFor::Last } else { LogitsFor::None };
        let from = state.pos;
        let logits = model.forward(&mut state, &tokens[from..end], want).expect("forward");
        let logits = (last && logits_at_end).then_some(logits);
        checkpoints.push(Checkpoint::new(state.snapshot(), logits));
    }
    model.draft(&mut state, 1234, 2, false).expect("the demo model drafts");
    assert_eq!(state.mtp.as_ref().and_then(|m| m.drafted_with), Some(1234));
    HostEntry { tokens: tokens.to_vec(), state, checkpoints }
}

fn encode(e: &HostEntry) -> Vec<u8> {
    let mut out = Vec::new();
    let n = codec::encode(&mut out, &identity(), &e.tokens, &e.state, &e.checkpoints).expect("encodes");
    assert_eq!(n, out.len() as u64);
    assert_eq!(n, codec::encoded_bytes(&e.tokens, &e.state, &e.checkpoints));
    out
}

fn decode(bytes: &[u8]) -> Result<codec::DecodedEntry, CodecError> {
    codec::decode(bytes, bytes.len() as u64, &identity())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Equal tokens, states and checkpoints (logits compared bit for bit).
fn assert_same(a: &HostEntry, b: &HostEntry) {
    assert_eq!(a.tokens, b.tokens);
    assert!(a.state == b.state, "states differ");
    assert_eq!(a.checkpoints.len(), b.checkpoints.len());
    for (x, y) in a.checkpoints.iter().zip(&b.checkpoints) {
        assert!(x.snapshot == y.snapshot, "snapshots at {} differ", x.snapshot.pos());
        assert_eq!(x.logits.as_deref().map(bits), y.logits.as_deref().map(bits));
    }
}

/// Logits (as bits) of forwarding `more` after resuming at checkpoint `c` of `e`, then the MTP drafts' logits.
fn resume(e: &HostEntry, c: usize, more: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let model = demo();
    let mut st = model.fork_state(&e.state, &e.checkpoints[c].snapshot, e.state.max_len).expect("forks");
    let logits = model.forward(&mut st, more, LogitsFor::All).expect("forward");
    let draft = model.draft(&mut st, 77, 2, true).expect("drafts");
    (bits(&logits), bits(&draft.logits))
}

#[test]
fn a_real_entry_round_trips_and_resumes_bit_for_bit() {
    let t = tokens(1, 24);
    let e = entry(&t, &[5, 12, 24], true);
    assert!(e.state.ple.is_some() && e.state.mtp.is_some(), "the demo model covers PLE and MTP");
    let bytes = encode(&e);
    let d = decode(&bytes).expect("decodes");
    assert_eq!(d.header.tokens, t);
    assert_eq!(d.header.identity, identity().digest());
    let back = HostEntry { tokens: d.header.tokens, state: d.state, checkpoints: d.checkpoints };
    assert_same(&e, &back);
    let more = tokens(2, 5);
    for c in 0..e.checkpoints.len() {
        assert_eq!(resume(&e, c, &more), resume(&back, c, &more), "checkpoint {c}");
    }
    // The header alone gives what the index needs.
    let h = codec::read_header(&bytes[..], bytes.len() as u64).expect("header");
    let at: Vec<(usize, bool)> = h.checkpoints.iter().map(|c| (c.pos, c.has_logits)).collect();
    assert_eq!(at, vec![(5, false), (12, false), (24, true)]);
}

#[test]
fn damaged_bytes_are_refused_never_trusted() {
    let e = entry(&tokens(3, 9), &[4, 9], true);
    let bytes = encode(&e);
    let header_end = (codec::PRELUDE_BYTES + 16 + 8 + 4 * 9 + 8 + 2 * 9) as usize;
    let body_end = bytes.len() - codec::TRAILER_BYTES as usize;
    // Every byte of the prelude, header and trailer, 64 more, and 256 positions spread over the rest.
    let mut at: Vec<usize> = (0..header_end + 64).chain(body_end..bytes.len()).collect();
    at.extend((0..256).map(|i| header_end + (body_end - header_end) * i / 256));
    for &i in &at {
        assert!(decode(&bytes[..i]).is_err(), "truncated to {i} bytes");
        assert!(codec::read_header(&bytes[..i], i as u64).is_err(), "header of the entry truncated to {i}");
        let mut flipped = bytes.clone();
        flipped[i] ^= 1 << (i % 8);
        assert!(decode(&flipped).is_err(), "bit {} of byte {i} flipped", i % 8);
        if i < header_end {
            assert!(codec::read_header(&flipped[..], flipped.len() as u64).is_err(), "header byte {i} flipped");
        }
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(matches!(decode(&longer), Err(CodecError::Length { .. })));
    // Each tag, count and position of the body damaged (every bit of its low byte, one bit of each other byte),
    // with the body checksum made to match: the structure checks alone refuse it. (An entry without logits: 1 MB
    // smaller, the same fields but one count.)
    let e = entry(&tokens(3, 9), &[4, 9], false);
    let bytes = encode(&e);
    let body_end = bytes.len() - codec::TRAILER_BYTES as usize;
    let fields = codec::body_fields(&e.state, &e.checkpoints);
    assert!(fields.len() > 30, "{} fields", fields.len());
    for &(off, width) in &fields {
        for byte in header_end + off as usize..header_end + (off + width) as usize {
            let bits = if byte == header_end + off as usize { 0..8 } else { byte % 8..byte % 8 + 1 };
            for bit in bits {
                let mut bad = bytes.clone();
                bad[byte] ^= 1 << bit;
                let sum = xxhash_rust::xxh3::xxh3_64(&bad[header_end..body_end]);
                bad[body_end..].copy_from_slice(&sum.to_le_bytes());
                assert!(matches!(decode(&bad), Err(CodecError::Malformed(_))), "bit {bit} of body byte {byte}");
            }
        }
    }
    // Random bytes, and random bytes behind a valid magic and version.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for i in 0..2000 {
        let n = rng.random_range(0..512);
        let mut junk: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        if i % 2 == 0 && n >= 8 {
            junk[..8].copy_from_slice(&bytes[..8]);
        }
        assert!(decode(&junk).is_err());
    }
}

#[test]
fn inconsistent_entries_are_not_encoded() {
    let e = entry(&tokens(4, 8), &[8], false);
    let mut out = Vec::new();
    let id = identity();
    let err = codec::encode(&mut out, &id, &e.tokens[..7], &e.state, &e.checkpoints).unwrap_err();
    assert!(matches!(err, CodecError::Malformed(_)), "{err}");
    let mut bad = e.state.clone();
    if let Some(crate::model::state::LayerState::Attention(a)) =
        bad.layers.iter_mut().find(|l| matches!(l, crate::model::state::LayerState::Attention(_)))
    {
        let rows = a.k.len();
        a.k.truncate(rows - 1);
    }
    assert!(codec::encode(&mut out, &id, &e.tokens, &bad, &e.checkpoints).is_err());
    assert!(out.is_empty(), "nothing written for a refused entry");
}

#[test]
fn the_identity_follows_the_file_and_the_load() {
    let a = identity();
    let path = demo().file().path();
    assert_eq!(a, ModelIdentity::of(&Qwen4Exp::load(path).unwrap()), "same file, same identity");
    assert_ne!(a.digest(), a.clone().with_tag("cuda").digest());
    let no_mtp = Qwen4Exp::from_gguf_with(
        Arc::new(GgufFile::open(path).unwrap()),
        LoadOptions { mtp: false, ..Default::default() },
    )
    .unwrap();
    assert_ne!(a.digest(), ModelIdentity::of(&no_mtp).digest(), "states without the MTP cache");
    let plain = ModelIdentity::of(&Qwen4Exp::load(&demo_path()).unwrap());
    assert_ne!(a.digest(), plain.digest(), "another file");
    // The same file rewritten with one weight byte changed (at the start of the data, a sampled block).
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("changed.gguf");
    let mut bytes = std::fs::read(demo_path()).unwrap();
    let data = GgufFile::open(demo_path()).unwrap().data_offset(0).unwrap() as usize;
    bytes[data + 1] ^= 0x01;
    std::fs::write(&copy, &bytes).unwrap();
    let changed = Qwen4Exp::load(&copy).unwrap();
    assert_ne!(plain.digest(), ModelIdentity::of(&changed).digest());

    // An entry of one identity does not decode under another.
    let e = entry(&tokens(5, 6), &[6], false);
    let enc = encode(&e);
    let other = a.with_tag("other");
    assert!(matches!(codec::decode(&enc[..], enc.len() as u64, &other), Err(CodecError::Identity { .. })));
}

/// Counts WARN events on this thread while `f` runs.
fn warnings<T>(f: impl FnOnce() -> T) -> (T, usize) {
    struct Counter(AtomicUsize);
    impl tracing::Subscriber for Counter {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            if *event.metadata().level() == tracing::Level::WARN {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }
    let counter = Arc::new(Counter(AtomicUsize::new(0)));
    let out = tracing::subscriber::with_default(counter.clone(), f);
    (out, counter.0.load(Ordering::SeqCst))
}

fn entry_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "nbpc"))
        .collect();
    v.sort();
    v
}

fn stored(cache: &DiskCache, e: &HostEntry) -> u64 {
    match cache.store(&e.tokens, &e.state, &e.checkpoints).expect("stores") {
        Stored::Written { bytes } => bytes,
        other => panic!("not written: {other:?}"),
    }
}

/// Looks `prompt` up and loads the hit.
fn fetch(cache: &DiskCache, prompt: &[u32]) -> Option<(DiskHit, LoadedEntry)> {
    let hit = cache.lookup(prompt)?;
    let loaded = cache.load(&hit)?;
    Some((hit, loaded))
}

#[test]
fn entries_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens(6, 20);
    let e = entry(&t, &[8, 20], true);
    {
        let cache = DiskCache::open(dir.path(), 1 << 30, identity()).unwrap();
        stored(&cache, &e);
    }
    let cache = DiskCache::open(dir.path(), 1 << 30, identity()).unwrap();
    assert_eq!(cache.len(), 1);
    // A longer prompt resumes at the end (20); the same prompt too, since the end keeps its logits.
    let mut longer = t.clone();
    longer.extend([5, 6, 7]);
    let (hit, loaded) = fetch(&cache, &longer).expect("found after the restart");
    assert_eq!((hit.pos, loaded.checkpoint), (20, 1));
    assert_same(&e, &loaded.entry);
    assert_eq!(cache.lookup(&t).map(|h| h.pos), Some(20));
    // A prompt that diverges at 10 resumes at 8; one that diverges at once finds nothing.
    let mut diverging = t[..10].to_vec();
    diverging.push(9);
    assert_eq!(cache.lookup(&diverging).map(|h| h.pos), Some(8));
    assert_eq!(cache.lookup(&[t[0] + 1, 2, 3]), None);
    assert_eq!(cache.lookup(&t[..8]), None, "a whole prompt needs logits");
}

#[test]
fn damaged_entries_are_deleted_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let cache = DiskCache::open(dir.path(), 1 << 30, identity()).unwrap();
    let (a, b, c) = (tokens(7, 10), tokens(8, 10), tokens(9, 10));
    for t in [&a, &b, &c] {
        stored(&cache, &entry(t, &[10], false));
    }
    let path_of = |t: &[u32]| dir.path().join(cache.entry_name(t));
    // A flipped body byte: indexed (the header is fine), refused at load.
    let pa = path_of(&a);
    let mut bytes = std::fs::read(&pa).unwrap();
    let n = bytes.len();
    bytes[n - 100] ^= 0x10;
    std::fs::write(&pa, &bytes).unwrap();
    let mut prompt = a.clone();
    prompt.push(1);
    let hit = cache.lookup(&prompt).expect("the header is intact");
    let (loaded, warned) = warnings(|| cache.load(&hit));
    assert!(loaded.is_none() && warned == 1, "refused with one warning");
    assert!(!pa.exists(), "deleted");
    assert!(cache.lookup(&prompt).is_none());
    // A truncated file and one with a damaged header: skipped when the directory is opened again.
    let pb = path_of(&b);
    let len = std::fs::metadata(&pb).unwrap().len();
    std::fs::File::options().write(true).open(&pb).unwrap().set_len(len - 1).unwrap();
    let pc = path_of(&c);
    let mut bytes = std::fs::read(&pc).unwrap();
    bytes[codec::PRELUDE_BYTES as usize + 20] ^= 0x01;
    std::fs::write(&pc, &bytes).unwrap();
    drop(cache);
    let (cache, warned) = warnings(|| DiskCache::open(dir.path(), 1 << 30, identity()).unwrap());
    assert_eq!(warned, 2);
    assert!(cache.is_empty() && entry_files(dir.path()).is_empty());
    for t in [&b, &c] {
        let mut p = t.clone();
        p.push(1);
        assert!(cache.lookup(&p).is_none());
    }
}

#[test]
fn entries_of_another_model_are_never_returned() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens(10, 12);
    let e = entry(&t, &[12], true);
    let ours = DiskCache::open(dir.path(), 1 << 30, identity()).unwrap();
    let bytes = stored(&ours, &e);
    let (theirs, warned) =
        warnings(|| DiskCache::open(dir.path(), 1 << 30, identity().with_tag("another file")).unwrap());
    assert_eq!(warned, 1, "one warning about the other model's entries");
    assert!(theirs.lookup(&t).is_none() && theirs.is_empty());
    assert_eq!(theirs.bytes(), bytes, "they count toward the shared bound");
    // Even pointed at the file, the other identity refuses it (and leaves it for its owner).
    let hit = ours.lookup(&t).unwrap();
    assert!(theirs.load(&hit).is_none());
    assert!(ours.load(&hit).is_some(), "still there for its own model");
}

#[test]
fn the_bound_evicts_the_least_recently_used_first() {
    let dir = tempfile::tempdir().unwrap();
    let es: Vec<HostEntry> = (0..4).map(|i| entry(&tokens(20 + i, 16), &[8, 16], false)).collect();
    let size = codec::encoded_bytes(&es[0].tokens, &es[0].state, &es[0].checkpoints);
    assert!(es.iter().all(|e| codec::encoded_bytes(&e.tokens, &e.state, &e.checkpoints) == size));
    let max = 3 * size;
    let cache = DiskCache::open(dir.path(), max, identity()).unwrap();
    let prompt = |i: usize| {
        let mut p = es[i].tokens.clone();
        p.push(3);
        p
    };
    for e in &es[..3] {
        stored(&cache, e);
    }
    assert!(fetch(&cache, &prompt(0)).is_some(), "entry 0 used: entry 1 is now the least recently used");
    stored(&cache, &es[3]);
    assert!(cache.bytes() <= max);
    assert_eq!(entry_files(dir.path()).len(), 3);
    assert!(cache.lookup(&prompt(1)).is_none(), "entry 1 went");
    for i in [2, 0, 3] {
        assert!(fetch(&cache, &prompt(i)).is_some(), "entry {i} stays");
    }
    // The order is on disk: a smaller bound at the next open drops the least recently used, now entry 2.
    drop(cache);
    let cache = DiskCache::open(dir.path(), 2 * size, identity()).unwrap();
    assert!(cache.lookup(&prompt(2)).is_none());
    assert!(cache.lookup(&prompt(0)).is_some() && cache.lookup(&prompt(3)).is_some());
    assert!(cache.bytes() <= 2 * size);
    // An entry larger than the whole bound is not written.
    let dir = tempfile::tempdir().unwrap();
    let small = DiskCache::open(dir.path(), size - 1, identity()).unwrap();
    let e = &es[1];
    assert_eq!(small.store(&e.tokens, &e.state, &e.checkpoints).unwrap(), Stored::TooLarge { bytes: size });
    assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none(), "nothing written");
}

#[test]
fn a_longer_sequence_replaces_the_entries_it_covers() {
    let dir = tempfile::tempdir().unwrap();
    let cache = DiskCache::open(dir.path(), 1 << 30, identity()).unwrap();
    let long = tokens(30, 20);
    stored(&cache, &entry(&long[..12], &[12], false));
    stored(&cache, &entry(&long, &[12, 20], false));
    assert_eq!(cache.len(), 1);
    assert_eq!(entry_files(dir.path()).len(), 1);
    let (_, loaded) = fetch(&cache, &long[..15]).unwrap();
    assert_eq!(loaded.entry.tokens, long);
    // The same tokens stored again replace the file.
    stored(&cache, &entry(&long, &[20], false));
    assert_eq!(entry_files(dir.path()).len(), 1);
    assert_eq!(cache.lookup(&long[..15]), None, "the new file has no checkpoint at 12");
}

#[test]
fn abandoned_temporaries_are_removed_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let abandoned = dir.path().join(format!("abc-1-2-3{TEMP_SUFFIX}"));
    std::fs::write(&abandoned, b"half an entry").unwrap();
    let in_progress = dir.path().join(format!("def-1-2-3{TEMP_SUFFIX}"));
    let held = std::fs::File::create(&in_progress).unwrap();
    held.lock().unwrap();
    let unrelated = dir.path().join("notes.txt");
    std::fs::write(&unrelated, b"not ours").unwrap();
    let cache = DiskCache::open(dir.path(), 1 << 30, identity()).unwrap();
    assert!(!abandoned.exists(), "an unlocked temporary is removed");
    assert!(in_progress.exists(), "a temporary its writer holds stays");
    assert!(unrelated.exists(), "other files are left alone");
    assert!(cache.is_empty());
}

/// Checks the directory after concurrent writers: every entry decodes, the bound holds, no temporary is left.
fn check_dir(dir: &Path, max: u64) {
    let mut total = 0;
    for p in entry_files(dir) {
        let bytes = std::fs::read(&p).unwrap();
        total += bytes.len() as u64;
        decode(&bytes).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }
    assert!(total <= max, "{total} bytes over the bound {max}");
    let temps = std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_str().unwrap().ends_with(TEMP_SUFFIX));
    assert_eq!(temps.count(), 0, "temporaries left");
}

/// Entries of writer `w`: `n` sequences of 10 tokens, each with one checkpoint.
fn writer_entries(w: u32, n: u32) -> Vec<HostEntry> {
    (0..n).map(|i| entry(&tokens(1000 + w * 100 + i, 10), &[10], false)).collect()
}

#[test]
fn concurrent_writers_in_threads_corrupt_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let size = {
        let e = &writer_entries(0, 1)[0];
        codec::encoded_bytes(&e.tokens, &e.state, &e.checkpoints)
    };
    let max = 10 * size;
    let shared = DiskCache::open(dir.path(), max, identity()).unwrap();
    let entries: Vec<Vec<HostEntry>> = (0..4).map(|w| writer_entries(w, 4)).collect();
    std::thread::scope(|s| {
        for (w, es) in entries.iter().enumerate() {
            let shared = &shared;
            let dir = dir.path();
            s.spawn(move || {
                // Two writers share one handle; two open their own, as another process would.
                let own;
                let cache = if w % 2 == 0 {
                    shared
                } else {
                    own = DiskCache::open(dir, max, identity()).unwrap();
                    &own
                };
                for e in es {
                    stored(cache, e);
                    cache.lookup(&e.tokens);
                }
            });
        }
    });
    check_dir(dir.path(), max);
    shared.refresh().unwrap();
    assert_eq!(shared.len(), entry_files(dir.path()).len());
    assert!(!shared.is_empty() && shared.bytes() <= max);
}

/// The process side of [`concurrent_writers_in_processes_corrupt_nothing`]: stores the entries of writer
/// `NEBULA_DISK_CACHE_TEST_WRITER` into `NEBULA_DISK_CACHE_TEST_DIR`. Does nothing when run by itself.
#[test]
#[ignore = "a helper process of concurrent_writers_in_processes_corrupt_nothing"]
fn writer_process() {
    let (Ok(dir), Ok(w), Ok(max)) = (
        std::env::var("NEBULA_DISK_CACHE_TEST_DIR"),
        std::env::var("NEBULA_DISK_CACHE_TEST_WRITER"),
        std::env::var("NEBULA_DISK_CACHE_TEST_MAX"),
    ) else {
        return;
    };
    let cache = DiskCache::open(dir, max.parse().unwrap(), identity()).unwrap();
    for e in writer_entries(w.parse().unwrap(), 6) {
        stored(&cache, &e);
    }
}

#[test]
fn concurrent_writers_in_processes_corrupt_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let size = {
        let e = &writer_entries(0, 1)[0];
        codec::encoded_bytes(&e.tokens, &e.state, &e.checkpoints)
    };
    let max = 8 * size;
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<std::process::Child> = (1..=2)
        .map(|w| {
            std::process::Command::new(&exe)
                .args(["prefix_cache::disk::tests::writer_process", "--exact", "--ignored", "--test-threads=1"])
                .env("NEBULA_DISK_CACHE_TEST_DIR", dir.path())
                .env("NEBULA_DISK_CACHE_TEST_WRITER", w.to_string())
                .env("NEBULA_DISK_CACHE_TEST_MAX", max.to_string())
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let cache = DiskCache::open(dir.path(), max, identity()).unwrap();
    for e in writer_entries(0, 6) {
        stored(&cache, &e);
    }
    // Wait for the writers; a hung one is killed rather than hanging the suite.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    for c in &mut children {
        let status = loop {
            if let Some(s) = c.try_wait().unwrap() {
                break s;
            }
            if std::time::Instant::now() > deadline {
                c.kill().unwrap();
                panic!("a writer process hung");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert!(status.success(), "a writer process failed: {status}");
    }
    check_dir(dir.path(), max);
    // The files were written by three processes; every one still on disk loads here.
    cache.refresh().unwrap();
    let files = entry_files(dir.path()).len();
    assert!(files >= 1 && cache.len() == files);
    let mut loaded = 0;
    for w in 0..3 {
        for e in writer_entries(w, 6) {
            let mut p = e.tokens.clone();
            p.push(1);
            if let Some((_, l)) = fetch(&cache, &p) {
                assert_same(&e, &l.entry);
                loaded += 1;
            }
        }
    }
    assert_eq!(loaded, files);
}

/// A state of each quantized KV cache type round-trips bit for bit (its caches stored as their own bytes), its
/// model identity differs from the f32 one (an entry is never resumed under another cache type), and an entry
/// whose rows are of another type than the identity says is refused.
#[test]
fn quantized_cache_states_round_trip_under_their_own_identity() {
    use crate::model::KvCacheType;
    let path = demo().file().path();
    let toks = tokens(3, 40);
    for ty in [KvCacheType::F16, KvCacheType::Q8_0, KvCacheType::Q4_0] {
        let opts = LoadOptions { kv_cache: ty, ..Default::default() };
        let model = Qwen4Exp::from_gguf_with(Arc::new(GgufFile::open(path).unwrap()), opts).unwrap();
        let id = ModelIdentity::of(&model);
        assert_ne!(id.digest(), identity().digest(), "{ty}: the identity follows the cache type");
        let mut state = model.new_state(64);
        model.forward(&mut state, &toks, LogitsFor::None).unwrap();
        let checkpoints = vec![Checkpoint::new(state.snapshot(), None)];
        let mut out = Vec::new();
        codec::encode(&mut out, &id, &toks, &state, &checkpoints).unwrap();
        let back = codec::decode(&out[..], out.len() as u64, &id).unwrap();
        assert_eq!(back.state, state, "{ty}: the decoded state differs");
        assert!(matches!(codec::decode(&out[..], out.len() as u64, &identity()), Err(CodecError::Identity { .. })));
        // The f32 model's state under this identity: rows of another type than its shapes say.
        let mut f32_state = demo().new_state(64);
        demo().forward(&mut f32_state, &toks, LogitsFor::None).unwrap();
        f32_state.mtp = None;
        let err = codec::encode(&mut Vec::new(), &id, &toks, &f32_state, &[]).unwrap_err();
        assert!(matches!(err, CodecError::Malformed(_)), "{ty}: {err}");
    }
}
