//! Drives cuda-agent episodes with an OpenAI-compatible chat-completions model.
