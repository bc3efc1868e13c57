//! Task synthesis by a model (`kernelbench synth --llm-url`): a chat-completions endpoint
//! proposes fused tasks from samples of the seed operators, and every proposal goes through
//! the filters of random synthesis (`synth/synth.py`: a trusted worker that never runs proposed
//! code, and one sandboxed run per proposal) and a near-duplicate check
//! ([`crate::similarity`]).
//!
//! [`chat`] is the endpoint's client, [`propose`] the prompt and the reading of answers,
//! [`worker`] the filters' worker and the sandbox proposals run in, [`llm`] the run: requests, verdicts, log, manifest
//! and cost report.

pub mod chat;
pub mod llm;
pub mod propose;
pub mod worker;

/// The synthesis worker (random composition, and the filters for `--judge`), compiled in so
/// the command works from any directory.
pub const SYNTH_PY: &str = include_str!("../../synth/synth.py");
