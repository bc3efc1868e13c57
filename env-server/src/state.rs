//! What every handler shares ([`AppState`]): the episodes, the evaluator, the drain, the
//! limits, the `/v1/info` answer and the evaluations' idempotency keys; and the drain of the
//! whole server before it stops, which acts on all of them.

use std::sync::Arc;
use std::time::Duration;

use env_api::EvaluationResult;
use futures_util::future::{BoxFuture, WeakShared};

use crate::drain::{Drain, DRAIN_REASON};
use crate::episode::EpisodeManager;
use crate::error::ApiError;
use crate::evaluation::Evaluator;
use crate::http::HttpCounters;
use crate::idempotency::{BodyDigest, Keys};
use crate::info::ServerInfo;
use crate::retention::Retention;

/// Everything the handlers share.
pub struct AppState {
    /// Episodes.
    pub episodes: EpisodeManager,
    /// The evaluation queue.
    pub evaluator: Arc<Evaluator>,
    /// Admission of new work, stopped by a drain ([`crate::drain`]).
    pub drain: Arc<Drain>,
    /// Bearer token required on every call but health, if set.
    pub api_key: Option<String>,
    /// What `/v1/info` reports (its counts filled per answer).
    pub info: ServerInfo,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Time a client has to send a request's body.
    pub body_timeout: std::time::Duration,
    /// Counters of the HTTP layer (filled by [`crate::http::serve`]).
    pub http: Arc<HttpCounters>,
    /// Permits for requests being handled: a request keeps running after its client hangs
    /// up, so the connection cap alone does not bound them.
    pub in_flight: Arc<tokio::sync::Semaphore>,
    /// The number of those permits.
    pub max_in_flight: usize,
    /// What the janitor prunes, and how often.
    pub retention: Retention,
    /// Limits of the MCP front (`/mcp`).
    pub mcp: McpLimits,
    /// Evaluations' idempotency keys (`options.request_id`): what a retry with the same key
    /// joins or is answered from.
    pub evaluation_keys: std::sync::Mutex<Keys<(BodyDigest, EvaluationKey)>>,
}

/// What an evaluation's answer is: its verdict, or the error every request waiting on it gets.
pub type EvaluationAnswer = Result<EvaluationResult, ApiError>;

/// An evaluation's idempotency key: the evaluation still running (every request with the key
/// waits on it, and it is cancelled only when the last of them hangs up), or its verdict.
#[derive(Clone)]
pub enum EvaluationKey {
    /// Running; gone once no request waits on it.
    Running(WeakShared<BoxFuture<'static, EvaluationAnswer>>),
    /// Judged.
    Done(Arc<EvaluationResult>),
}

impl std::fmt::Debug for EvaluationKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Running(_) => f.write_str("Running"),
            Self::Done(r) => f.debug_tuple("Done").field(&r.reward).finish(),
        }
    }
}

/// Limits of the MCP front.
#[derive(Debug, Clone)]
pub struct McpLimits {
    /// Most MCP sessions at once (each holds at most one episode).
    pub max_sessions: usize,
    /// A session without a request for this long ends (and closes its running episode).
    pub session_idle: Duration,
}

impl AppState {
    /// Drains the server: readiness false and new work refused at once, admitted work given up to
    /// `grace`, then what is left ended with [`DRAIN_REASON`]. Returns when the server may stop
    /// serving.
    pub async fn drain_before_stop(&self, grace: Duration) {
        if !self.drain.begin() {
            return;
        }
        tracing::info!(
            running = self.drain.running(),
            evaluations = self.evaluator.in_flight(),
            open_episodes = self.episodes.open_count(),
            grace_s = grace.as_secs_f64(),
            "draining: readiness is false and new episodes, steps and evaluations are refused (503 draining); admitted work gets the grace period"
        );
        let finished = tokio::time::timeout(grace, self.drain.idle()).await.is_ok();
        if finished {
            tracing::info!("drain: every admitted request finished");
        } else {
            tracing::warn!(
                running = self.drain.running(),
                evaluations = self.evaluator.in_flight(),
                "drain: the grace period is over; evaluations still running are cancelled and answered 503 drained (their clients may retry elsewhere)"
            );
        }
        self.drain.expire();
        let ended = self.episodes.truncate_open(DRAIN_REASON).await;
        if ended.truncated + ended.busy > 0 {
            tracing::info!(
                truncated = ended.truncated,
                reason = DRAIN_REASON,
                "drain: open episodes truncated; each one's log (every answered step and the truncation) is durable on disk, and a restarted server answers its state and trajectory"
            );
        }
        if ended.busy > 0 {
            tracing::warn!(
                busy = ended.busy,
                "drain: episodes still inside a step are left as they are; their logs hold every answered step, and the next start marks them truncated (server_restart)"
            );
        }
    }
}
