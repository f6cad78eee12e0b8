//! Picking the next token from logits: greedy, temperature, top-k, top-p (nucleus), min-p, with a seeded RNG.
//!
//! Order of the filters, as llama.cpp and vLLM apply them: top-k, then temperature-scaled softmax, then top-p,
//! then min-p (relative to the most likely token), then a draw. Temperature 0 (or top-k 1) is greedy argmax,
//! with ties broken toward the lower id. Masked logits (`-inf`, e.g. vocabulary rows no token has) are never
//! chosen.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha12Rng;

/// Sampling settings of one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability mass reaches `top_p` (1 = no limit).
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely token's (0 = off).
    pub min_p: f32,
    /// Seed of the random generator; `None` seeds from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    /// Greedy.
    fn default() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: None }
    }
}

impl SamplingParams {
    /// Checks every field's range; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("temperature must be a finite number >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        Ok(())
    }

    /// True when the choice is deterministic argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// A sampler with its own random stream (one per request, so a seeded request is reproducible whatever else
/// the server does).
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha12Rng,
}

/// Index of the largest finite value, lowest index on ties; `None` if every value is `-inf` or NaN.
pub fn argmax(logits: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() || v == f32::NEG_INFINITY {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|b| b.0)
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => ChaCha12Rng::seed_from_u64(s),
            None => ChaCha12Rng::from_os_rng(),
        };
        Self { params, rng }
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses a token id from `logits` (one row, `vocab` values). `None` only if no token is possible.
    pub fn sample(&mut self, logits: &[f32]) -> Option<u32> {
        let p = self.params;
        if p.is_greedy() {
            return argmax(logits).map(|i| i as u32);
        }
        let mut cand: Vec<(u32, f32)> =
            logits.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v)).collect();
        if cand.is_empty() {
            return None;
        }
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_logit);
            cand.truncate(p.top_k);
        }
        cand.sort_unstable_by(by_logit);
        // Softmax at temperature, in f64 for a stable cumulative sum.
        let max = cand[0].1 as f64;
        let t = p.temperature as f64;
        let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 as f64 - max) / t).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, &q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        let mass: f64 = probs[..keep].iter().sum();
        let mut r = self.rng.random::<f64>() * mass;
        for (c, &q) in cand[..keep].iter().zip(&probs[..keep]) {
            if r < q {
                return Some(c.0);
            }
            r -= q;
        }
        Some(cand[keep - 1].0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, min_p, seed: Some(7) }
    }

    #[test]
    fn greedy_takes_the_lowest_id_among_ties_and_skips_masked() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, f32::NEG_INFINITY]), Some(1));
        assert_eq!(s.sample(&[f32::NEG_INFINITY, -5.0]), Some(1));
        assert_eq!(s.sample(&[f32::NEG_INFINITY; 3]), None);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_follows_the_distribution() {
        let logits: Vec<f32> = vec![2.0, 1.0, 0.0, -1.0];
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams { seed: Some(seed), ..params(1.0, 0, 1.0, 0.0) });
            (0..4000).map(|_| s.sample(&logits).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
        let d = draw(3);
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for (id, &l) in logits.iter().enumerate() {
            let freq = d.iter().filter(|&&x| x == id as u32).count() as f64 / d.len() as f64;
            let p = (l as f64).exp() / z;
            assert!((freq - p).abs() < 0.03, "id {id}: frequency {freq} vs probability {p}");
        }
    }

    #[test]
    fn filters_restrict_the_candidates() {
        let logits: Vec<f32> = vec![3.0, 2.9, 0.0, -2.0, 2.95];
        let seen = |p: SamplingParams| {
            let mut s = Sampler::new(p);
            let mut v: Vec<u32> = (0..2000).map(|_| s.sample(&logits).unwrap()).collect();
            v.sort();
            v.dedup();
            v
        };
        assert_eq!(seen(params(1.0, 2, 1.0, 0.0)), vec![0, 4]);
        assert_eq!(seen(params(1.0, 0, 0.5, 0.0)), vec![0, 4]);
        assert_eq!(seen(params(1.0, 0, 1.0, 0.5)), vec![0, 1, 4]);
        assert_eq!(seen(params(100.0, 0, 1.0, 0.0)), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn validation_names_the_field() {
        assert!(params(-1.0, 0, 1.0, 0.0).validate().unwrap_err().contains("temperature"));
        assert!(params(1.0, 0, 0.0, 0.0).validate().unwrap_err().contains("top_p"));
        assert!(params(1.0, 0, 1.0, 2.0).validate().unwrap_err().contains("min_p"));
    }
}
