//! Acceptance rules of a draft against the target's logits for one row, by verification level.
//!
//! Greedy requests (temperature 0) follow the request's accuracy level:
//! - level 3, strict: a draft is accepted only when it is the target's greedy token (argmax, lowest id on ties),
//!   so the output equals plain greedy decoding token for token;
//! - level 2: additionally at most one non-greedy draft per chain, if it is within the target's top 3 and
//!   `p(draft) / p(top1) >= 0.80`;
//! - level 1: additionally up to four non-greedy drafts per chain, within the top 10, ratio `>= 0.20`.
//!
//! `p` is the softmax of the row's logits (after the request's penalties and constraint), so the ratio is
//! `exp(l_draft - l_top1)`; the rank counts tokens with a higher logit, or an equal logit and a lower id. A rejected
//! draft is replaced by the target's greedy token.
//!
//! Requests that sample (temperature > 0) use the standard speculative-sampling rule whatever their level: the
//! MTP draft is greedy, i.e. its distribution `q` is one-hot, so a draft `d` is accepted with probability
//! `min(1, p(d) / q(d)) = p(d)` and on rejection the token is drawn from `max(p - q, 0)` renormalised, which is
//! `p` without `d` (Leviathan et al. 2023, Algorithm 1; vLLM's rejection sampler with `NO_DRAFT_PROBS`). The
//! output is then distributed exactly as sampling from `p`, where `p` is the request's sampling distribution
//! (temperature, top-k, top-p, min-p: [`Sampler::distribution`]).

use crate::sampling::{Sampler, argmax};

/// Accuracy level of a request (`accuracy_level` in the API).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AccuracyLevel {
    /// Level 1: up to four non-greedy drafts per chain, each within the top 10 with ratio `>= 0.20`.
    Relaxed,
    /// Level 2: at most one non-greedy draft per chain, within the top 3 with ratio `>= 0.80`.
    Balanced,
    /// Level 3 (default): only the target's greedy token; output equals plain greedy decoding.
    #[default]
    Strict,
}

/// The relaxed acceptance of levels 2 and 1 for greedy requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RelaxedRule {
    /// Non-greedy drafts that may be accepted in one chain.
    pub max_per_chain: usize,
    /// A non-greedy draft must rank among the target's `top_k` tokens.
    pub top_k: usize,
    /// ... and have `p(draft) / p(top1)` at least this.
    pub min_ratio: f32,
}

impl AccuracyLevel {
    /// The level for the API's number (1, 2 or 3); `None` for anything else.
    pub fn from_number(n: i64) -> Option<Self> {
        match n {
            1 => Some(Self::Relaxed),
            2 => Some(Self::Balanced),
            3 => Some(Self::Strict),
            _ => None,
        }
    }

    /// The API's number of this level.
    pub fn number(self) -> u8 {
        match self {
            Self::Relaxed => 1,
            Self::Balanced => 2,
            Self::Strict => 3,
        }
    }

    /// The relaxed rule of this level (`None` at level 3).
    pub fn relaxed_rule(self) -> Option<RelaxedRule> {
        match self {
            Self::Strict => None,
            Self::Balanced => Some(RelaxedRule { max_per_chain: 1, top_k: 3, min_ratio: 0.80 }),
            Self::Relaxed => Some(RelaxedRule { max_per_chain: 4, top_k: 10, min_ratio: 0.20 }),
        }
    }
}

/// What verification decided for one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowVerdict {
    /// The draft is kept; `greedy` says whether it was the target's greedy token.
    Accept {
        /// The draft equals the target's argmax.
        greedy: bool,
    },
    /// The draft is refused; the row's token is `replacement` (the target's own).
    Reject {
        /// The target's token for this row.
        replacement: u32,
    },
}

/// Rank of `token` in `logits`: tokens with a higher logit, or an equal one and a lower id.
fn rank_of(logits: &[f32], token: u32) -> usize {
    let l = logits[token as usize];
    logits.iter().enumerate().filter(|&(j, &v)| v > l || (v == l && (j as u32) < token)).count()
}

/// Greedy verification of `draft` against one row of prepared `logits`. `rule` is the level's relaxed rule
/// (`None` at level 3) and `budget` the non-greedy acceptances left in this chain (decremented on use).
/// `None` only when no token is possible (every logit `-inf`).
pub fn verify_greedy(logits: &[f32], draft: u32, rule: Option<&RelaxedRule>, budget: &mut usize) -> Option<RowVerdict> {
    let top = argmax(logits)? as u32;
    if draft == top {
        return Some(RowVerdict::Accept { greedy: true });
    }
    if let Some(r) = rule
        && *budget > 0
        && let Some(&l) = logits.get(draft as usize)
        && l.is_finite()
    {
        let ratio = (l - logits[top as usize]).exp();
        if ratio >= r.min_ratio && rank_of(logits, draft) < r.top_k {
            *budget -= 1;
            return Some(RowVerdict::Accept { greedy: false });
        }
    }
    Some(RowVerdict::Reject { replacement: top })
}

/// Speculative-sampling verification of a greedy (one-hot) `draft` against one row of prepared `logits`, drawing
/// from the request's random stream: accepted with probability `p(draft)`, else the row's token is drawn from
/// `p` without the draft. `None` only when no token is possible.
pub fn verify_sampled(sampler: &mut Sampler, logits: &[f32], draft: u32) -> Option<RowVerdict> {
    let dist = sampler.distribution(logits);
    if dist.is_empty() {
        return None;
    }
    let p_draft = dist.iter().find(|c| c.0 == draft).map_or(0.0, |c| c.1);
    if sampler.uniform() < p_draft {
        return Some(RowVerdict::Accept { greedy: dist[0].0 == draft });
    }
    // The residual: the distribution without the draft (p(draft) = 1 leaves it empty; the draw above then always
    // accepted).
    let replacement = sampler.draw_excluding(&dist, Some(draft)).unwrap_or(dist[0].0);
    Some(RowVerdict::Reject { replacement })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    /// Deterministic pseudo-random numbers in [0, 1).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    #[test]
    fn strict_accepts_exactly_the_argmax() {
        let logits = [0.5f32, 2.0, 2.0, -1.0, f32::NEG_INFINITY];
        let mut budget = 0;
        assert_eq!(verify_greedy(&logits, 1, None, &mut budget), Some(RowVerdict::Accept { greedy: true }));
        assert_eq!(verify_greedy(&logits, 2, None, &mut budget), Some(RowVerdict::Reject { replacement: 1 }));
        assert_eq!(verify_greedy(&logits, 4, None, &mut budget), Some(RowVerdict::Reject { replacement: 1 }));
        assert_eq!(verify_greedy(&[f32::NEG_INFINITY; 3], 0, None, &mut budget), None);
    }

    /// Property test: for random logits and chains of random drafts, levels 2 and 1 accept a draft exactly when
    /// it is the argmax, or when it ranks within the level's top k with a ratio at the floor and the chain still
    /// has budget; the budget is never exceeded; a rejection always gives the argmax.
    #[test]
    fn relaxed_levels_obey_their_rules_on_random_logits() {
        let mut rng = Lcg(11);
        for level in [AccuracyLevel::Balanced, AccuracyLevel::Relaxed] {
            let rule = level.relaxed_rule().unwrap();
            let (mut relaxed_accepts, mut relaxed_rejects) = (0, 0);
            for _chain in 0..400 {
                let mut budget = rule.max_per_chain;
                let mut non_greedy = 0;
                for _row in 0..8 {
                    let v = 4 + (rng.next() * 40.0) as usize;
                    // Peaked or flat rows, some ties, some masked entries.
                    let spread = 0.2 + rng.next() * 4.0;
                    let mut logits: Vec<f32> = (0..v).map(|_| (rng.next() * spread * 4.0).round() / 4.0).collect();
                    if rng.next() < 0.3 {
                        logits[(rng.next() * v as f32) as usize] = f32::NEG_INFINITY;
                    }
                    let top = argmax(&logits).unwrap() as u32;
                    // Drafts near the top more often than not.
                    let draft = if rng.next() < 0.5 {
                        let mut order: Vec<u32> = (0..v as u32).collect();
                        order.sort_by_key(|&t| rank_of(&logits, t));
                        order[((rng.next() * 12.0) as usize).min(v - 1)]
                    } else {
                        (rng.next() * v as f32) as u32
                    };
                    let before = budget;
                    let verdict = verify_greedy(&logits, draft, Some(&rule), &mut budget).unwrap();
                    let l = logits[draft as usize];
                    let ratio = (l - logits[top as usize]).exp();
                    let qualifies = l.is_finite() && rank_of(&logits, draft) < rule.top_k && ratio >= rule.min_ratio;
                    match verdict {
                        RowVerdict::Accept { greedy: true } => {
                            assert_eq!(draft, top);
                            assert_eq!(budget, before);
                        }
                        RowVerdict::Accept { greedy: false } => {
                            assert_ne!(draft, top);
                            assert!(qualifies, "{level:?}: accepted rank {} ratio {ratio}", rank_of(&logits, draft));
                            assert_eq!(budget + 1, before);
                            non_greedy += 1;
                            relaxed_accepts += 1;
                        }
                        RowVerdict::Reject { replacement } => {
                            assert_eq!(replacement, top);
                            assert_ne!(draft, top);
                            assert!(!qualifies || before == 0, "{level:?}: refused a qualifying draft with budget");
                            relaxed_rejects += 1;
                        }
                    }
                    assert!(non_greedy <= rule.max_per_chain);
                }
            }
            assert!(relaxed_accepts > 50 && relaxed_rejects > 50, "{level:?}: both outcomes exercised");
        }
        assert_eq!(AccuracyLevel::Strict.relaxed_rule(), None);
        assert_eq!(AccuracyLevel::from_number(2), Some(AccuracyLevel::Balanced));
        assert_eq!(AccuracyLevel::from_number(0), None);
    }

    /// Speculative sampling reproduces the target distribution whatever the draft: frequencies of the output
    /// token over many trials match `p` (with top-k and temperature applied).
    #[test]
    fn speculative_sampling_preserves_the_distribution() {
        let logits = [1.0f32, 0.2, 2.0, -0.5, 1.5, f32::NEG_INFINITY];
        let params = SamplingParams { temperature: 0.8, top_k: 4, seed: Some(5), ..SamplingParams::GREEDY };
        let mut sampler = Sampler::new(params);
        let p = sampler.distribution(&logits);
        assert_eq!(p.len(), 4);
        assert!((p.iter().map(|c| c.1).sum::<f64>() - 1.0).abs() < 1e-9);
        for draft in [2u32, 0, 3, 5] {
            let trials = 40_000;
            let mut counts = [0usize; 6];
            let mut accepted = 0;
            for _ in 0..trials {
                let t = match verify_sampled(&mut sampler, &logits, draft).unwrap() {
                    RowVerdict::Accept { .. } => {
                        accepted += 1;
                        draft
                    }
                    RowVerdict::Reject { replacement } => {
                        assert_ne!(replacement, draft);
                        replacement
                    }
                };
                counts[t as usize] += 1;
            }
            for &(t, q) in &p {
                let f = counts[t as usize] as f64 / trials as f64;
                assert!((f - q).abs() < 0.012, "draft {draft}: token {t} frequency {f:.4} vs p {q:.4}");
            }
            let pd = p.iter().find(|c| c.0 == draft).map_or(0.0, |c| c.1);
            let rate = accepted as f64 / trials as f64;
            assert!((rate - pd).abs() < 0.012, "draft {draft}: acceptance {rate:.4} vs p(draft) {pd:.4}");
        }
    }
}
