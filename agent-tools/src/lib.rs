//! The tools an agent calls inside its episode's workspace, and the sandbox every process
//! they start runs in. No HTTP here: the server (`env-server`) drives a [`Toolbox`] per episode.
//!
//! - [`workspace`]: the directory an episode owns, its protected files, path resolution.
//! - [`tools`]: the tool argument types, their OpenAI schemas, parsing and running calls.
//! - [`sandbox`]: landlock, seccomp, rlimits, uid, session and environment for each process.

pub mod sandbox;
pub mod tools;
pub mod workspace;

pub use sandbox::{
    create_private_dir, Jail, ResourceLimits, Sandbox, SandboxConfig, SandboxError, SandboxStatus,
};
pub use tools::{
    tool_names, tool_schemas, CallError, ToolCall, ToolError, ToolLimits, ToolOutput, Toolbox,
};
pub use workspace::Workspace;
