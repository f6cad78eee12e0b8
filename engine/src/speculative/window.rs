//! The draft-window controller: how many tokens the next chain drafts, and whether
//! drafting is worth it at all for this request.
//!
//! **Basic rule.** Every response starts at `N = 4`, kept within `[4, 16]`. Consecutive fully accepted chains
//! (case A) add 0, 1, 1, 2, 3, 5, then 5 each; consecutive chains with a rejected draft (case C) subtract 2, 4, 6,
//! then 6 each; a chain whose first draft is rejected resets `N` to 4. A case-B chain (the verify pass could not
//! trust a row, so the full target produced the token) leaves `N` and both streaks as they are.
//!
//! **Timing model.** Once 8 chains are in the history, the controller fits the measured costs — drafting per
//! token, the verify pass as `a + b * rows` (least squares over the chains and the plain steps, which are
//! verify passes of one row), the state save, the restore after a rejection and the MTP realignment — and the
//! per-draft acceptance `alpha` (geometric fit: accepted drafts / (accepted + rejections)). A chain of `n` drafts
//! is predicted to give `1 + alpha + ... + alpha^n` tokens in `n t_draft + a + b (n + 1) + t_save + (1 - alpha^n)
//! t_restore + t_realign` seconds. If `N - 2` or `N + 2` (within bounds) predicts more tokens per second than the
//! basic rule's `N`, the proposal moves there.
//!
//! **Collapse.** After at least 8 chains since drafting (re)started, if the last 8 chains together produced
//! fewer tokens per second than plain decoding does (its measured step time: when no plain step was measured yet,
//! the controller asks the decoder for one first), drafting turns off for the request: the next `cooldown` tokens
//! are decoded plainly (32 at first, doubled at each further collapse up to 1024, back to 32 after 64 chains
//! without a collapse). Then drafting comes back at `N = 4` with a fresh chain history (the plain-step timings,
//! refreshed by the cooldown, are kept).
//!
//! **Early collapse.** A drafter that is wrong from the start does not wait for 8 chains: when the first
//! [`EARLY_REJECTS`] chains since drafting (re)started all had their first draft rejected, drafting turns off at
//! once, with the same cooldown. Each such chain produced one token for a draft step plus a verify pass of at least
//! two rows, never less than a plain step costs, so no timing is needed to judge it. A drafter that is right most of
//! the time opens an epoch that way rarely (at a per-draft acceptance of 0.7, 2.7 % of epochs), and then loses one
//! cooldown; a drafter that is never right costs [`EARLY_REJECTS`] chains per cooldown instead of 8.

use std::collections::VecDeque;

/// Smallest draft window.
pub const MIN_WINDOW: usize = 4;
/// Largest draft window.
pub const MAX_WINDOW: usize = 16;
/// Added to `N` by the k-th consecutive fully accepted chain (then the last value).
pub const GROW: [usize; 6] = [0, 1, 1, 2, 3, 5];
/// Subtracted from `N` by the k-th consecutive chain with a rejection (then the last value).
pub const SHRINK: [usize; 3] = [2, 4, 6];
/// Chains of history before the timing model and the collapse check act.
pub const HISTORY: usize = 8;
/// Plain tokens after the first collapse before drafting is tried again.
pub const BASE_COOLDOWN: usize = 32;
/// Longest cooldown.
pub const MAX_COOLDOWN: usize = 1024;
/// Chains without a collapse after which the cooldown goes back to [`BASE_COOLDOWN`].
pub const STABLE_CHAINS: usize = 64;
/// Opening chains (from the moment drafting (re)starts) with their first draft rejected that turn drafting off
/// without waiting for [`HISTORY`] chains.
pub const EARLY_REJECTS: usize = 3;

/// How a verified chain ended: A all accepted, B handed to the full target, C a draft rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainCase {
    /// Every draft accepted; the target's bonus token starts the next chain.
    A,
    /// A row's resident experts covered less than the threshold of its router weight: the accepted prefix is
    /// kept and the full target produced that row's token.
    B,
    /// A draft was rejected (the first one when `accepted == 0`); the target's token replaced it.
    C,
}

/// Measurements of one verified chain.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChainSample {
    /// Drafts proposed.
    pub window: usize,
    /// Drafts accepted.
    pub accepted: usize,
    /// How the chain ended.
    pub case: ChainCase,
    /// Tokens the chain produced (accepted drafts + the bonus or replacement).
    pub tokens: usize,
    /// Seconds drafting.
    pub draft_s: f64,
    /// Seconds in the verify pass (save and realign excluded).
    pub verify_s: f64,
    /// Seconds saving the state before the verify pass.
    pub save_s: f64,
    /// Seconds restoring (rolling back) after it, 0 when nothing was rolled back.
    pub restore_s: f64,
    /// Seconds realigning the MTP cache.
    pub realign_s: f64,
    /// Seconds of the exact target step of case B (0 otherwise).
    pub exact_s: f64,
}

impl ChainSample {
    /// All the seconds the chain took.
    pub fn total_s(&self) -> f64 {
        self.draft_s + self.verify_s + self.save_s + self.restore_s + self.realign_s + self.exact_s
    }
}

/// The fitted costs and acceptance behind a prediction.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingModel {
    /// Seconds per drafted token.
    pub draft_per_token: f64,
    /// Verify seconds = `verify_base + verify_per_row * rows`.
    pub verify_base: f64,
    /// See `verify_base`.
    pub verify_per_row: f64,
    /// Seconds per save.
    pub save: f64,
    /// Seconds per restore (when a chain rolls back).
    pub restore: f64,
    /// Seconds per realignment.
    pub realign: f64,
    /// Probability that a draft is accepted given the ones before it were.
    pub alpha: f64,
}

impl TimingModel {
    /// Predicted tokens per second of a chain of `n` drafts.
    pub fn rate(&self, n: usize) -> f64 {
        let a = self.alpha.clamp(0.0, 1.0);
        let tokens = 1.0 + (1..=n).map(|i| a.powi(i as i32)).sum::<f64>();
        let time = n as f64 * self.draft_per_token
            + self.verify_base
            + self.verify_per_row * (n + 1) as f64
            + self.save
            + (1.0 - a.powi(n as i32)) * self.restore
            + self.realign;
        if time > 0.0 { tokens / time } else { f64::INFINITY }
    }
}

/// What the controller did with a chain's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ControlEvent {
    /// Drafting turned off for the request (acceptance collapse).
    pub collapsed: bool,
    /// The timing model moved the proposal away from the basic rule's.
    pub timing_moved: bool,
}

/// The per-request window controller.
#[derive(Debug, Clone)]
pub struct WindowController {
    n: usize,
    accept_streak: usize,
    reject_streak: usize,
    history: VecDeque<ChainSample>,
    chains_since_on: usize,
    /// Chains since drafting (re)started, all with their first draft rejected (stops counting at the first other).
    opening_rejects: usize,
    chains_since_collapse: usize,
    /// Plain decode steps: (rows = 1, seconds), most recent last.
    plain: VecDeque<f64>,
    off_for: usize,
    cooldown: usize,
    collapses: usize,
    recoveries: usize,
    timing: bool,
    probe: bool,
}

impl Default for WindowController {
    fn default() -> Self {
        Self::new()
    }
}

impl WindowController {
    /// A controller at `N = 4`, drafting on.
    pub fn new() -> Self {
        Self {
            n: MIN_WINDOW,
            accept_streak: 0,
            reject_streak: 0,
            history: VecDeque::new(),
            chains_since_on: 0,
            opening_rejects: 0,
            chains_since_collapse: 0,
            plain: VecDeque::new(),
            off_for: 0,
            cooldown: BASE_COOLDOWN,
            collapses: 0,
            recoveries: 0,
            timing: true,
            probe: false,
        }
    }

    /// Whether the controller wants one plain step measured before it judges the chains (the collapse check
    /// needs the cost of a plain step and none was seen yet): the decoder then runs the next step plainly.
    pub fn wants_plain_probe(&self) -> bool {
        self.probe
    }

    /// A controller that follows the basic rule only (no timing model, no collapse).
    pub fn basic_only() -> Self {
        Self { timing: false, ..Self::new() }
    }

    /// The window for the next chain, or `None` while drafting is off (collapse cooldown).
    pub fn window(&self) -> Option<usize> {
        (self.off_for == 0).then_some(self.n)
    }

    /// Collapses so far.
    pub fn collapses(&self) -> usize {
        self.collapses
    }

    /// Times drafting came back after a collapse.
    pub fn recoveries(&self) -> usize {
        self.recoveries
    }

    /// Records a plain (non-speculative) decode step of `seconds`; counts down a collapse cooldown. Returns true
    /// when this step ended the cooldown (drafting is back).
    pub fn on_plain_step(&mut self, seconds: f64) -> bool {
        self.probe = false;
        if seconds.is_finite() && seconds > 0.0 {
            self.plain.push_back(seconds);
            if self.plain.len() > 16 {
                self.plain.pop_front();
            }
        }
        if self.off_for > 0 {
            self.off_for -= 1;
            if self.off_for == 0 {
                self.recoveries += 1;
                self.n = MIN_WINDOW;
                self.accept_streak = 0;
                self.reject_streak = 0;
                self.chains_since_on = 0;
                self.opening_rejects = 0;
                // Acceptance is what collapsed: forget it, keep the cost measurements' scale via new chains.
                self.history.clear();
                return true;
            }
        }
        false
    }

    /// Updates the window with a verified chain's result (basic rule, then the timing model, then the collapse
    /// check).
    pub fn on_chain(&mut self, s: ChainSample) -> ControlEvent {
        let mut ev = ControlEvent::default();
        self.history.push_back(s);
        if self.history.len() > 32 {
            self.history.pop_front();
        }
        self.chains_since_on += 1;
        if self.opening_rejects + 1 == self.chains_since_on && s.case == ChainCase::C && s.accepted == 0 {
            self.opening_rejects += 1;
        }
        self.chains_since_collapse += 1;
        if self.chains_since_collapse >= STABLE_CHAINS {
            self.cooldown = BASE_COOLDOWN;
        }
        let mut n = self.n as isize;
        match s.case {
            ChainCase::A => {
                self.accept_streak += 1;
                self.reject_streak = 0;
                n += GROW[(self.accept_streak - 1).min(GROW.len() - 1)] as isize;
            }
            ChainCase::C => {
                self.reject_streak += 1;
                self.accept_streak = 0;
                if s.accepted == 0 {
                    n = MIN_WINDOW as isize;
                } else {
                    n -= SHRINK[(self.reject_streak - 1).min(SHRINK.len() - 1)] as isize;
                }
            }
            ChainCase::B => {}
        }
        let basic = n.clamp(MIN_WINDOW as isize, MAX_WINDOW as isize) as usize;
        self.n = basic;
        if self.timing && self.chains_since_on == EARLY_REJECTS && self.opening_rejects == EARLY_REJECTS {
            self.collapse();
            ev.collapsed = true;
            return ev;
        }
        if self.timing
            && self.chains_since_on >= HISTORY
            && let Some(model) = self.timing_model()
        {
            let base_rate = model.rate(basic);
            let mut best = (basic, base_rate);
            for cand in [basic.saturating_sub(2).max(MIN_WINDOW), (basic + 2).min(MAX_WINDOW)] {
                let r = model.rate(cand);
                if cand != basic && r > best.1 * 1.000_001 {
                    best = (cand, r);
                }
            }
            if best.0 != basic {
                self.n = best.0;
                ev.timing_moved = true;
            }
            if self.plain.is_empty() {
                // Judge against a measured plain step, not an extrapolation of the verify cost.
                self.probe = true;
            } else if self.collapsed(&model) {
                ev.collapsed = true;
                self.collapse();
            }
        }
        ev
    }

    /// Turns drafting off for the current cooldown and doubles the next one (up to [`MAX_COOLDOWN`]).
    fn collapse(&mut self) {
        self.collapses += 1;
        self.chains_since_collapse = 0;
        self.off_for = self.cooldown;
        self.cooldown = (self.cooldown * 2).min(MAX_COOLDOWN);
    }

    /// Whether the last [`HISTORY`] chains produced fewer tokens per second than plain decoding (the mean of the
    /// measured plain steps; `model`'s one-row verify cost if there were none).
    fn collapsed(&self, model: &TimingModel) -> bool {
        let recent: Vec<&ChainSample> = self.history.iter().rev().take(HISTORY).collect();
        let tokens: usize = recent.iter().map(|s| s.tokens).sum();
        let time: f64 = recent.iter().map(|s| s.total_s()).sum();
        let plain_s = if self.plain.is_empty() {
            model.verify_base + model.verify_per_row
        } else {
            self.plain.iter().sum::<f64>() / self.plain.len() as f64
        };
        if !(time > 0.0 && plain_s > 0.0) {
            return false;
        }
        (tokens as f64 / time) < 1.0 / plain_s
    }

    /// The timing model fitted to the history (`None` without history).
    pub fn timing_model(&self) -> Option<TimingModel> {
        if self.history.is_empty() {
            return None;
        }
        let h = &self.history;
        let drafted: usize = h.iter().map(|s| s.window).sum();
        let draft_per_token = if drafted > 0 { h.iter().map(|s| s.draft_s).sum::<f64>() / drafted as f64 } else { 0.0 };
        // Verify cost against rows: chains (window + 1 rows) and plain steps (1 row).
        let mut pts: Vec<(f64, f64)> = h.iter().map(|s| ((s.window + 1) as f64, s.verify_s)).collect();
        pts.extend(self.plain.iter().map(|&t| (1.0, t)));
        let m = pts.len() as f64;
        let (sx, sy) = pts.iter().fold((0.0, 0.0), |a, p| (a.0 + p.0, a.1 + p.1));
        let (mx, my) = (sx / m, sy / m);
        let sxx: f64 = pts.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
        let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let (base, per_row) = if sxx > 1e-9 {
            let b = (sxy / sxx).max(0.0);
            ((my - b * mx).max(0.0), b)
        } else {
            // One row count only: charge it all per row (a pessimistic guess for longer chains).
            (0.0, my / mx.max(1.0))
        };
        let mean = |f: &dyn Fn(&ChainSample) -> f64| h.iter().map(f).sum::<f64>() / h.len() as f64;
        let rolled: Vec<f64> = h.iter().filter(|s| s.accepted < s.window).map(|s| s.restore_s).collect();
        let restore = if rolled.is_empty() { 0.0 } else { rolled.iter().sum::<f64>() / rolled.len() as f64 };
        let accepted: usize = h.iter().map(|s| s.accepted).sum();
        let rejections = h.iter().filter(|s| s.case == ChainCase::C).count();
        let alpha = if accepted + rejections > 0 { accepted as f64 / (accepted + rejections) as f64 } else { 0.0 };
        Some(TimingModel {
            draft_per_token,
            verify_base: base,
            verify_per_row: per_row,
            save: mean(&|s| s.save_s),
            restore,
            realign: mean(&|s| s.realign_s),
            alpha,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(window: usize, accepted: usize, case: ChainCase) -> ChainSample {
        ChainSample {
            window,
            accepted,
            case,
            tokens: accepted + 1,
            draft_s: 0.0002 * window as f64,
            verify_s: 0.010 + 0.002 * (window + 1) as f64,
            save_s: 0.0005,
            restore_s: if accepted < window { 0.0005 } else { 0.0 },
            realign_s: 0.0002,
            exact_s: 0.0,
        }
    }

    #[test]
    fn basic_rule_grows_shrinks_and_resets() {
        let mut c = WindowController::basic_only();
        assert_eq!(c.window(), Some(4));
        let mut seen = Vec::new();
        for _ in 0..7 {
            let n = c.window().unwrap();
            c.on_chain(chain(n, n, ChainCase::A));
            seen.push(c.window().unwrap());
        }
        // +0, +1, +1, +2, +3, +5 (capped at 16), +5.
        assert_eq!(&seen[..6], &[4, 5, 6, 8, 11, 16]);
        let mut c = WindowController::basic_only();
        for _ in 0..6 {
            let n = c.window().unwrap();
            c.on_chain(chain(n, n, ChainCase::A));
        }
        assert_eq!(c.window(), Some(16));
        c.on_chain(chain(16, 5, ChainCase::C));
        assert_eq!(c.window(), Some(14), "first rejection: -2");
        c.on_chain(chain(14, 3, ChainCase::C));
        assert_eq!(c.window(), Some(10), "second: -4");
        c.on_chain(chain(10, 9, ChainCase::B));
        assert_eq!(c.window(), Some(10), "case B changes nothing");
        c.on_chain(chain(10, 2, ChainCase::C));
        assert_eq!(c.window(), Some(4), "third: -6");
        let mut c = WindowController::basic_only();
        for _ in 0..4 {
            let n = c.window().unwrap();
            c.on_chain(chain(n, n, ChainCase::A));
        }
        assert_eq!(c.window(), Some(8));
        c.on_chain(chain(8, 0, ChainCase::C));
        assert_eq!(c.window(), Some(4), "a rejected first draft resets to 4");
    }

    #[test]
    fn timing_model_fits_the_costs_and_moves_the_window() {
        let mut c = WindowController::new();
        c.on_plain_step(0.012);
        // Acceptance 0.9 and cheap drafts: longer windows pay; alternating A/C keeps the basic rule near 4..6.
        let mut moved = false;
        for i in 0..12 {
            let n = c.window().unwrap();
            let (acc, case) = if i % 2 == 0 { (n, ChainCase::A) } else { (n - 1, ChainCase::C) };
            moved |= c.on_chain(chain(n, acc, case)).timing_moved;
        }
        let m = c.timing_model().unwrap();
        assert!((m.draft_per_token - 0.0002).abs() < 1e-9, "{m:?}");
        assert!((m.verify_per_row - 0.002).abs() < 1e-6 && (m.verify_base - 0.010).abs() < 1e-6, "{m:?}");
        assert!(m.alpha > 0.8, "{m:?}");
        assert!(moved, "with alpha {:.2} a longer window predicts more tokens/s", m.alpha);
        assert!(m.rate(8) > m.rate(4));
    }

    #[test]
    fn collapse_turns_drafting_off_and_it_comes_back() {
        let mut c = WindowController::new();
        // Without a plain step measured, the eighth chain asks for one instead of judging.
        for _ in 0..HISTORY {
            let n = c.window().unwrap();
            assert!(!c.on_chain(chain(n, 1, ChainCase::C)).collapsed);
        }
        assert!(c.wants_plain_probe());
        c.on_plain_step(0.010);
        assert!(!c.wants_plain_probe());
        let mut c = WindowController::new();
        c.on_plain_step(0.010);
        let mut collapsed_at = None;
        for i in 0..20 {
            let n = c.window().expect("on until the collapse");
            // One draft accepted a chain: two tokens per chain at more than two plain steps' cost (and not the
            // opening-rejects rule: the first drafts are right).
            if c.on_chain(chain(n, 1, ChainCase::C)).collapsed {
                collapsed_at = Some(i);
                break;
            }
        }
        assert_eq!(collapsed_at, Some(HISTORY - 1), "collapse once 8 chains are in");
        assert_eq!(c.window(), None);
        assert_eq!(c.collapses(), 1);
        for k in 0..BASE_COOLDOWN {
            let back = c.on_plain_step(0.010);
            assert_eq!(back, k == BASE_COOLDOWN - 1);
        }
        assert_eq!(c.window(), Some(4));
        assert_eq!(c.recoveries(), 1);
        // Good chains now: no second collapse.
        for _ in 0..20 {
            let n = c.window().unwrap();
            assert!(!c.on_chain(chain(n, n, ChainCase::A)).collapsed);
        }
        // A second collapse doubles the cooldown.
        let mut c2 = c.clone();
        let mut off = false;
        for _ in 0..16 {
            let n = c2.window().unwrap();
            if c2.on_chain(chain(n, 1, ChainCase::C)).collapsed {
                off = true;
                break;
            }
        }
        assert!(off);
        let steps = (0..10 * BASE_COOLDOWN).take_while(|_| !c2.on_plain_step(0.010)).count() + 1;
        assert_eq!(steps, 2 * BASE_COOLDOWN);
    }

    #[test]
    fn a_drafter_wrong_from_the_start_is_turned_off_after_three_chains() {
        let mut c = WindowController::new();
        for i in 0..EARLY_REJECTS {
            let n = c.window().expect("on until the third chain");
            let ev = c.on_chain(chain(n, 0, ChainCase::C));
            assert_eq!(ev.collapsed, i == EARLY_REJECTS - 1, "chain {i}");
        }
        assert_eq!(c.window(), None, "off without a plain step measured or 8 chains of history");
        assert_eq!(c.collapses(), 1);
        // After the cooldown the next epoch is judged the same way, with the doubled cooldown.
        assert_eq!((0..BASE_COOLDOWN).filter(|_| c.on_plain_step(0.010)).count(), 1);
        for _ in 0..EARLY_REJECTS {
            let n = c.window().unwrap();
            c.on_chain(chain(n, 0, ChainCase::C));
        }
        assert_eq!(c.window(), None);
        let steps = (0..10 * BASE_COOLDOWN).take_while(|_| !c.on_plain_step(0.010)).count() + 1;
        assert_eq!(steps, 2 * BASE_COOLDOWN);
        // One right first draft among the opening chains, or a case-B chain, leaves the judgement to the timing
        // check.
        for opening in [[0, 1, 0], [1, 0, 0], [0, 0, 2]] {
            let mut c = WindowController::new();
            for acc in opening {
                let n = c.window().unwrap();
                assert!(!c.on_chain(chain(n, acc, ChainCase::C)).collapsed, "{opening:?}");
            }
            assert!(c.window().is_some());
        }
        let mut c = WindowController::new();
        for case in [ChainCase::C, ChainCase::B, ChainCase::C] {
            let n = c.window().unwrap();
            assert!(!c.on_chain(chain(n, 0, case)).collapsed);
        }
        // The basic rule alone never collapses.
        let mut c = WindowController::basic_only();
        for _ in 0..20 {
            let n = c.window().unwrap();
            assert!(!c.on_chain(chain(n, 0, ChainCase::C)).collapsed);
        }
    }
}
