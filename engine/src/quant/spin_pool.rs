//! A pool of compute threads that keep spinning for a bounded time after each job, for the hybrid path's CPU
//! MoE kernel ([`super::moe`]).
//!
//! Why not rayon there: hybrid decode calls the kernel once per layer with ~0.2 ms of GPU work in between, long
//! enough for rayon's idle workers to fall asleep, and waking 14 sleeping threads one by one took 130 us on the
//! H200 machine's 16-core host (NEBULA_CPU_MOE_TRACE: the first thread started 24 us after the call, the last
//! 152 us; 12 layers, so ~1.5 ms of a 10.8 ms token). Here a job is published by bumping a generation counter
//! that the idle workers watch, so they start within a cache-line transfer; a worker only parks (and then needs
//! a wake-up) after `spin` without work. The calling thread is participant 0, so a pool of `n` participants has
//! `n - 1` threads of its own.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The job of one [`SpinPool::run`]: a borrowed closure, valid while that call has not returned.
type JobRef = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped (SeqCst) once per job, after `job` is written.
    generation: AtomicU64,
    /// The current job; written only by the caller of `run` while every worker is idle.
    job: UnsafeCell<Option<JobRef>>,
    /// Workers that have not yet finished the current job.
    remaining: AtomicUsize,
    /// Workers parked on `wake` (or about to be).
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
    /// A worker's job panicked (re-raised by `run`).
    panicked: AtomicBool,
    spin: Duration,
}

// SAFETY: `job` is written only while no worker reads it (between jobs: `remaining` is 0) and read only after the
// generation bump that publishes it; the closure it points to is `Sync`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

/// `n` participants: the caller of [`SpinPool::run`] and `n - 1` threads.
pub(crate) struct SpinPool {
    shared: Arc<Shared>,
    participants: usize,
    /// Serialises `run` calls (the pool holds one job at a time).
    running: Mutex<()>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl SpinPool {
    /// Starts `participants - 1` threads that spin for `spin` after each job before parking.
    ///
    /// Errors: the OS refused a thread.
    pub(crate) fn new(participants: usize, spin: Duration) -> std::io::Result<Self> {
        let participants = participants.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            remaining: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            spin,
        });
        let mut handles = Vec::with_capacity(participants - 1);
        for index in 1..participants {
            let s = shared.clone();
            handles.push(
                std::thread::Builder::new().name(format!("nebula-moe-{index}")).spawn(move || worker(&s, index))?,
            );
        }
        Ok(Self { shared, participants, running: Mutex::new(()), handles })
    }

    /// Runs `f(i)` once for every participant `i` in `0..participants` (the caller runs `f(0)`), returning when
    /// all have finished. Panics (after every participant finished) if any call of `f` panicked.
    pub(crate) fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let _one_at_a_time = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let s = &*self.shared;
        // SAFETY: every worker finished the previous job (`remaining` reached 0 before the last `run` returned)
        // and none reads `job` before the generation bump below. The pointer's lifetime is erased; it is used
        // only until this call returns (we wait for `remaining` to reach 0).
        unsafe { *s.job.get() = Some(std::mem::transmute::<&(dyn Fn(usize) + Sync), JobRef>(f)) };
        s.remaining.store(self.participants - 1, Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(0)));
        while s.remaining.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        // SAFETY: no worker reads `job` any more (all finished).
        unsafe { *s.job.get() = None };
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a CPU MoE worker thread panicked");
        }
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

fn worker(s: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        // Wait for the next generation: spin, then park.
        let since = Instant::now();
        let mut spins = 0u32;
        loop {
            let g = s.generation.load(Ordering::SeqCst);
            if g != seen {
                seen = g;
                break;
            }
            if s.stop.load(Ordering::Relaxed) {
                return;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) && since.elapsed() >= s.spin {
                let mut guard = s.lock.lock().unwrap_or_else(|p| p.into_inner());
                s.sleepers.fetch_add(1, Ordering::SeqCst);
                while s.generation.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                    guard = s.wake.wait(guard).unwrap_or_else(|p| p.into_inner());
                }
                s.sleepers.fetch_sub(1, Ordering::SeqCst);
                drop(guard);
                continue;
            }
            std::hint::spin_loop();
        }
        if s.stop.load(Ordering::Relaxed) {
            return;
        }
        // SAFETY: the generation bump published `job` (SeqCst load above), and `run` keeps the closure alive
        // until `remaining` reaches 0, which happens only after this call.
        let job = unsafe { (*s.job.get()).expect("a published job") };
        let f = unsafe { &*job };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(index))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.remaining.fetch_sub(1, Ordering::Release);
    }
}

thread_local! {
    /// This thread's choice (see [`set_spin`]).
    static SPIN_US: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Makes the MoE kernel calls of the calling thread run on a spinning pool whose idle workers spin `us`
/// microseconds after each job before parking (0: rayon, the default). The hybrid backend's CPU thread opts in;
/// [`crate::tuning::CpuTuning::spin_us`] (`NEBULA_CPU_SPIN_US`) overrides the value of every thread that opted
/// in (0 turns the pool off there).
pub fn set_spin(us: u64) {
    SPIN_US.with(|c| c.set(us));
}

/// The spin time in effect on this thread (see [`set_spin`]).
pub fn spin_us() -> u64 {
    let mine = SPIN_US.with(|c| c.get());
    if mine == 0 {
        return 0;
    }
    crate::tuning::cpu().spin_us.unwrap_or(mine)
}

/// The process's pool of `participants` (created on first use with this thread's spin time, kept for the life
/// of the process), or `None` when spinning is off on this thread or the threads could not be started (the
/// caller then uses rayon).
pub(crate) fn pool(participants: usize) -> Option<&'static SpinPool> {
    let us = spin_us();
    if us == 0 || participants < 2 {
        return None;
    }
    static POOLS: OnceLock<Mutex<HashMap<usize, &'static SpinPool>>> = OnceLock::new();
    let mut pools = POOLS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = pools.get(&participants) {
        return Some(p);
    }
    let p: &'static SpinPool = Box::leak(Box::new(SpinPool::new(participants, Duration::from_micros(us)).ok()?));
    pools.insert(participants, p);
    Some(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_participant_runs_once_per_job_and_results_are_visible() {
        let pool = SpinPool::new(4, Duration::from_micros(200)).unwrap();
        for round in 0..200usize {
            let hits: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|i| {
                hits[i].fetch_add(round + 1, Ordering::Relaxed);
            });
            for (i, h) in hits.iter().enumerate() {
                assert_eq!(h.load(Ordering::Relaxed), round + 1, "participant {i} in round {round}");
            }
            if round % 50 == 0 {
                // Long enough for the workers to park: the next job must wake them.
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    #[test]
    fn a_panicking_worker_is_reported_to_the_caller() {
        let pool = SpinPool::new(3, Duration::from_micros(50)).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|i| {
                if i == 2 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        // The pool still works afterwards.
        let count = AtomicUsize::new(0);
        pool.run(&|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 3);
    }
}
