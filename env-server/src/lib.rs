//! The cuda-agent environment server: gym-style episodes over HTTP, each a sandboxed
//! workspace in which an agent calls tools until it submits, then a final evaluation and a
//! milestone reward.
//!
//! - [`config`]: what the server is started with ([`ServerConfig`]).
//! - [`start`]: starting it ([`build_state`]): the machine probed, the sandbox, recovery.
//! - [`admission`]: what the host offers and the bounds derived from it.
//! - [`api`]: routes, auth, metrics, OpenAPI ([`api::router`] builds the app).
//! - [`state`]: what the handlers share ([`AppState`]), and the drain of the whole server.
//! - [`error`]: the API's error answer and how each module's errors map to it.
//! - [`info`]: what `/v1/info` answers.
//! - [`http`]: serving the app over TCP with connection, header, idle and write limits.
//! - [`mcp`]: the MCP front (`/mcp`): one MCP session per episode, the same tools and log.
//! - [`drain`]: draining before a stop (readiness false, new work refused, a grace period).
//! - [`janitor`]: the periodic upkeep (idle episodes, finished ones, retention).
//! - [`episode`]: the episode manager (workspaces, limits, idle expiry, recovery).
//! - [`retention`]: what stays on disk (trajectory logs, the build cache, crash leftovers).
//! - [`evaluation`]: the evaluation queue, device leases, the harness runs.
//! - [`build`]: the fair build queue, the build toolchain (CUDA architectures, precompiled
//!   torch headers).
//! - [`trajectory`]: the durable JSON Lines log.
//! - [`reward`]: the milestone reward.
//! - [`runtime`]: Python/torch/device discovery and the pristine harness.

pub mod admission;
pub mod api;
pub mod build;
pub mod config;
pub mod drain;
pub mod episode;
pub mod error;
pub mod evaluation;
pub mod http;
pub mod idempotency;
pub mod info;
pub mod janitor;
pub mod mcp;
pub mod observe;
pub mod retention;
pub mod reward;
pub mod runtime;
pub mod start;
pub mod state;
pub mod trajectory;

pub use api::router;
pub use config::{default_time_budget, ServerConfig, TaskSize, DEFAULT_TIMING_BUDGET};
pub use evaluation::DEFAULT_PRESTART_DEPTH;
pub use janitor::{release_free_memory, spawn_janitor};
pub use retention::Retention;
pub use runtime::DeviceChoice;
pub use start::{build_state, prepare_pch, StartError};
pub use state::AppState;
