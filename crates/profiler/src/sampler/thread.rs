//! What the sampler keeps per thread of the process between its visits.

use super::engine::Armed;
use crate::labels::Ctx;

pub(super) struct ThreadInfo {
    pub(super) tid: i32,
    /// A thread of ferroprof: never sampled.
    pub(super) own: bool,
    pub(super) name: String,
    /// A new thread names itself shortly after it starts (Rust does it in the new thread):
    /// its name is re-read on its first visits until it changes.
    pub(super) name_checks_left: u8,
    /// Its CPU engine's arming, while armed.
    pub(super) timer: Option<Armed>,
    /// The thread's CPU clock at its last visit, and the wall time accounted up to.
    pub(super) last_cpu: u64,
    pub(super) last_wall: u64,
    /// CPU time used (by the clock) but not given to a capture yet; a capture takes its
    /// periods from it (saturating: the clock lags a capture by less than a period).
    pub(super) cpu_carry: u64,
    /// Wall time the captures took ahead of the visits (on-CPU time the visits had booked
    /// off CPU already): paid back from the next off-CPU time, so totals stay exact.
    pub(super) wall_debt: u64,
    /// Where the thread waits: its stack when last seen off CPU.
    pub(super) stack: Vec<u64>,
    /// Where the stack pointer stood in each frame of `stack`, when it was read from the
    /// thread's memory (else empty): what [`RemoteUnwinder::recent_calls`] starts from.
    pub(super) stack_sps: Vec<u64>,
    /// Where its timer last caught it running, and its labels then.
    pub(super) ran: Vec<u64>,
    pub(super) ran_ctx: Ctx,
    /// The labels `idle_wall` is booked under: those seen together with `stack` (read from the
    /// thread's slot at the visit that read the stack, or `ran_ctx` when the stack is `ran`),
    /// so a wall sample never pairs a stack with labels the thread did not have there.
    pub(super) wall_ctx: Ctx,
    /// The thread's labels as read at its last visit (a change is a move).
    pub(super) seen_ctx: Ctx,
    /// Off-CPU wall time on `stack` not recorded yet.
    pub(super) idle_wall: u64,
    /// Wall time recorded but not yet counted as a whole tick in `cpu-samples`.
    pub(super) tick_rest: u64,
    /// Visited at every tick until then (it ran recently).
    pub(super) hot_until: u64,
    /// Listed in `Sampler::hot`.
    pub(super) in_hot: bool,
    /// Not known yet not to be one of ferroprof's threads (see PROBATION_CPU_NS): its time
    /// is accumulated, not recorded. Since when it was first seen.
    pub(super) probation: bool,
    pub(super) born: u64,
    /// The listing it was last seen in, and the tick it was last visited.
    pub(super) listed: u64,
    pub(super) visited: u64,
}

impl ThreadInfo {
    /// Whole ticks in `wall` ns plus what earlier records left over.
    pub(super) fn ticks_of(&mut self, wall: u64, period: u64) -> i64 {
        let total = self.tick_rest + wall;
        self.tick_rest = total % period;
        (total / period) as i64
    }
}
