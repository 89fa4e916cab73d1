//! Not API: what the preload library, the CLI, the benches and the tests reach inside ferroprof
//! (hidden from the docs, free to change between any two versions).

pub use crate::alloc::{
    __disable_arena, __heap_peak_estimate_bytes, __raw_allocated, __raw_freeing,
};
pub use crate::fork::{__hold_lock, __walk_loader, __LOCKS};
pub use crate::forkgate::__restart_pending;
pub use crate::threads::{__late_own_thread, __spawn_own_thread};
pub use crate::tls::__unsampled;
pub use crate::unwind::__in_signal_handler;
