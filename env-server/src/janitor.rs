//! The server's periodic upkeep: idle episodes truncated, finished ones moved out of memory,
//! retention passes, freed memory handed back.

use std::sync::Arc;
use std::time::Duration;

use crate::state::AppState;

/// Every 30 s, for as long as the state lives: truncates idle episodes, moves finished ones
/// out of memory; every retention interval, prunes logs and the build cache (on a blocking
/// thread, one pass at a time).
pub fn spawn_janitor(state: Arc<AppState>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(30));
        let mut last_retention = tokio::time::Instant::now();
        let mut last_in_memory = 0;
        loop {
            tick.tick().await;
            let n = state.episodes.expire_idle().await;
            if n > 0 {
                tracing::info!(expired = n, "idle episodes truncated");
            }
            let evicted = state.episodes.evict_finished();
            if evicted > 0 {
                tracing::debug!(evicted, "finished episodes left memory");
            }
            // Episodes left memory since the last tick (closed or evicted): give the pages back.
            let in_memory = state.episodes.in_memory();
            if in_memory < last_in_memory {
                release_free_memory();
            }
            last_in_memory = in_memory;
            if last_retention.elapsed() >= state.retention.interval {
                last_retention = tokio::time::Instant::now();
                let (retention, live) = (state.retention.clone(), state.episodes.live_ids());
                if let Err(e) = tokio::task::spawn_blocking(move || retention.run(&live)).await {
                    tracing::warn!(error = %e, "retention pass failed");
                }
            }
        }
    });
}

/// Hands freed heap pages back to the system, so that the server's resident memory falls
/// after many episodes end (glibc keeps them otherwise).
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}
