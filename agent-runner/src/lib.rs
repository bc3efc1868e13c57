//! Drives cuda-agent episodes with any OpenAI-compatible chat-completions model (vLLM,
//! SGLang, llama.cpp's server, `trainer serve`, a hosted API).
//!
//! - [`openai`]: the chat-completions client: requests with the episode's tools, tool-call
//!   parsing, retries with backoff, token usage.
//! - [`agent`]: one episode: the multi-turn loop, malformed calls as error observations, the
//!   context kept within the model's.
//! - [`run`]: many episodes at once, resumable, written as `kernelbench` results.
//! - [`optimize`]: a user's own module made a task; the best correct `ModelNew`, verified,
//!   with a report and a chart.

pub mod agent;
pub mod openai;
pub mod optimize;
pub mod run;
