//! `agent-runner`: episodes driven by an OpenAI-compatible model.

fn main() {}
