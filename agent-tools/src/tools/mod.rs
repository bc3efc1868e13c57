//! The tools: argument types (their JSON schemas are generated from them), parsing of a call,
//! and the per-episode [`Toolbox`] that runs calls.

mod bash;
mod edit;
mod files;
mod glob;
mod grep;
mod nearest;
mod schema;
mod todo;

use std::path::{Path, PathBuf};
use std::time::Duration;

use env_api::observation::{ObservationData, ToolData};
use env_api::ErrorChain;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::sandbox::{Jail, Sandbox};
use crate::workspace::Workspace;
// The argument types are wire types: they live in env-api, beside the rest of the API.
pub use bash::WALL_CAP_FACTOR;
pub use env_api::tools::{
    BashArgs, Edit, EditArgs, GlobArgs, GrepArgs, GrepOutputMode, MultiEditArgs, ReadArgs,
    SubmitArgs, TodoItem, TodoStatus, TodoWriteArgs, WriteArgs,
};
pub use todo::Todo;

/// Errors a tool reports. Inside an episode these become error observations, not HTTP errors.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// An argument is malformed.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A path leads outside the workspace.
    #[error("path is outside the workspace: {0}")]
    OutsideWorkspace(String),
    /// A protected file would change.
    #[error("{0} is read-only: the harness files, SKILL.md and its reference and the reference model cannot be changed; your code goes in model_new.py and kernels/ (or a file of your own)")]
    ReadOnly(String),
    /// A file could not be read or written. The I/O error is told in the message, in the
    /// words the agent reads ([`io_reason`]), so it is not also a source.
    #[error("{path}: {}", io_reason(.error))]
    Io {
        /// The path, as given or resolved.
        path: String,
        /// The underlying error.
        error: std::io::Error,
    },
    /// A MultiEdit edit could not be applied; nothing was written.
    #[error("edit {index} of {total} failed, no change written: {reason}{}", on_lines(.detail))]
    Edit {
        /// 1-based index of the failing edit.
        index: usize,
        /// Number of edits in the call.
        total: usize,
        /// Why it failed.
        reason: String,
        /// Lines that help the next attempt (the `old_string` given and where the file
        /// holds the nearest text), or empty.
        detail: String,
    },
    /// A symbolic link is in the path; the file tools never follow one.
    #[error("{0}: a symbolic link is in the way; the file tools never follow links (use Bash to work with links)")]
    Link(String),
    /// The path is a hard link to a file the agent does not own; it is not read.
    #[error("{0} is a hard link to a file the agent does not own; the file tools do not read it")]
    HardLink(String),
    /// The path names something other than a regular file (a FIFO, a device, a directory).
    #[error("{path} is {kind}, not a regular file")]
    NotRegular {
        /// The path, relative to the workspace.
        path: String,
        /// What it is.
        kind: &'static str,
    },
    /// A size cap was reached; nothing was written.
    #[error("{what} is over the limit of {limit} bytes")]
    TooLarge {
        /// What was too large.
        what: String,
        /// The cap, in bytes.
        limit: u64,
    },
    /// A file tool did not finish in time (a stuck filesystem); the server moved on.
    #[error("the file operation did not finish within {0:?}")]
    TimedOut(Duration),
    /// The tool itself failed (a bug, not the agent's doing); the server carries on.
    #[error("the tool failed: {0}")]
    Failed(String),
    /// The sandbox could not start the process.
    #[error("sandbox")]
    Sandbox(#[from] crate::sandbox::SandboxError),
}

/// An I/O error as the agent reads it: what it means here and what to do, where the
/// system's own words ("entity not found") would say neither.
fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file or directory in the workspace (paths are relative to it; Glob with pattern \"**/*\" lists its files, Write creates a file)".to_string(),
        std::io::ErrorKind::PermissionDenied => "permission denied (the file tools act as the agent and cannot open it)".to_string(),
        _ => e.to_string(),
    }
}

/// `detail` on lines of its own after the message, or nothing.
fn on_lines(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!("\n{detail}")
    }
}

impl ToolError {
    pub(crate) fn io(path: &Path, error: std::io::Error) -> Self {
        Self::Io {
            path: path.display().to_string(),
            error,
        }
    }
}

/// A call that cannot be run at all: unknown tool or arguments of the wrong shape.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No tool of that name.
    #[error("unknown tool {name:?}; available tools: {available}")]
    UnknownTool {
        /// The name given.
        name: String,
        /// The names that exist.
        available: String,
    },
    /// The arguments do not fit the tool's schema.
    #[error("invalid arguments for {tool}: {message}")]
    BadArguments {
        /// The tool.
        tool: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// A parsed tool call.
#[derive(Debug, Clone)]
pub enum ToolCall {
    /// Run a shell command.
    Bash(BashArgs),
    /// Find files by pattern.
    Glob(GlobArgs),
    /// Search file contents.
    Grep(GrepArgs),
    /// Replace one string in one file.
    Edit(EditArgs),
    /// Apply edits to one file.
    MultiEdit(MultiEditArgs),
    /// Replace the todo list.
    TodoWrite(TodoWriteArgs),
    /// Read a file.
    Read(ReadArgs),
    /// Write a whole file.
    Write(WriteArgs),
    /// End the episode and ask for the final evaluation.
    Submit(SubmitArgs),
}

struct ToolSpec {
    name: &'static str,
    description: &'static str,
    schema: fn() -> schemars::Schema,
}

const TOOLS: &[ToolSpec] = &[
    ToolSpec {
        name: "Bash",
        description: "Run a bash command in the workspace, inside the sandbox (no network). Returns stdout and stderr separately, the exit code and whether it timed out; output is capped and the middle of long output is cut. The working directory persists between calls; background processes are killed when the command ends.",
        schema: || schemars::schema_for!(BashArgs),
    },
    ToolSpec {
        name: "Glob",
        description: "List files in the workspace matching a glob pattern (`*` stays within a directory, `**` crosses them), newest first.",
        schema: || schemars::schema_for!(GlobArgs),
    },
    ToolSpec {
        name: "MultiEdit",
        description: "Apply several exact-string replacements to one file, in order and atomically: if any old_string is missing, or appears more than once without replace_all, nothing is written. An empty old_string in the first edit creates a new file.",
        schema: || schemars::schema_for!(MultiEditArgs),
    },
    ToolSpec {
        name: "TodoWrite",
        description: "Replace the episode's todo list (each item: content, status pending|in_progress|completed, activeForm). Use it to plan and track the profile / implement / verify / tune loop.",
        schema: || schemars::schema_for!(TodoWriteArgs),
    },
    ToolSpec {
        name: "Read",
        description: "Read a text file from the workspace with line numbers (cat -n style); offset and limit select lines.",
        schema: || schemars::schema_for!(ReadArgs),
    },
    ToolSpec {
        name: "Write",
        description: "Write a whole file in the workspace, replacing it if it exists.",
        schema: || schemars::schema_for!(WriteArgs),
    },
    ToolSpec {
        name: "Edit",
        description: "Replace an exact string in one file: old_string must appear exactly once unless replace_all is set, and must differ from new_string; nothing is written otherwise. An empty old_string creates a file that does not exist yet. Read the file first so old_string matches it exactly (indentation included).",
        schema: || schemars::schema_for!(EditArgs),
    },
    ToolSpec {
        name: "Grep",
        description: "Search file contents in the workspace with a regular expression (ripgrep syntax); hidden and binary files are skipped.",
        schema: || schemars::schema_for!(GrepArgs),
    },
    ToolSpec {
        name: "Submit",
        description: "Submit model_new.py for the final evaluation and end the episode.",
        schema: || schemars::schema_for!(SubmitArgs),
    },
];

/// The names of all tools, in schema order.
pub fn tool_names() -> Vec<&'static str> {
    TOOLS.iter().map(|t| t.name).collect()
}

/// The OpenAI function-calling schemas of every tool.
pub fn tool_schemas() -> Vec<Value> {
    TOOLS
        .iter()
        .map(|t| {
            let params = serde_json::to_value((t.schema)()).unwrap_or(Value::Null);
            let mut params = schema::compact(params);
            if let Some(obj) = params.as_object_mut() {
                obj.remove("$schema");
                obj.remove("title");
                obj.entry("properties").or_insert_with(|| json!({}));
            }
            json!({
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": params}
            })
        })
        .collect()
}

impl ToolCall {
    /// Parses a call from a tool name and its arguments (an object, or a JSON string holding
    /// one, as in OpenAI's `tool_calls`).
    pub fn parse(name: &str, arguments: &Value) -> Result<Self, CallError> {
        let spec = TOOLS
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| CallError::UnknownTool {
                name: name.to_string(),
                available: tool_names().join(", "),
            })?;
        let tool = spec.name;
        let args = match arguments {
            Value::String(s) if s.trim().is_empty() => json!({}),
            Value::String(s) => serde_json::from_str(s).map_err(|e| CallError::BadArguments {
                tool,
                message: format!("arguments string is not JSON: {e}"),
            })?,
            Value::Null => json!({}),
            other => other.clone(),
        };
        fn de<T: serde::de::DeserializeOwned>(
            tool: &'static str,
            v: Value,
        ) -> Result<T, CallError> {
            serde_json::from_value(v).map_err(|e| CallError::BadArguments {
                tool,
                message: e.to_string(),
            })
        }
        Ok(match tool {
            "Bash" => ToolCall::Bash(de(tool, args)?),
            "Glob" => ToolCall::Glob(de(tool, args)?),
            "Grep" => ToolCall::Grep(de(tool, args)?),
            "Edit" => ToolCall::Edit(de(tool, args)?),
            "MultiEdit" => ToolCall::MultiEdit(de(tool, args)?),
            "TodoWrite" => ToolCall::TodoWrite(de(tool, args)?),
            "Read" => ToolCall::Read(de(tool, args)?),
            "Write" => ToolCall::Write(de(tool, args)?),
            _ => ToolCall::Submit(de(tool, args)?),
        })
    }

    /// The tool's name.
    pub fn name(&self) -> &'static str {
        match self {
            ToolCall::Bash(_) => "Bash",
            ToolCall::Glob(_) => "Glob",
            ToolCall::Grep(_) => "Grep",
            ToolCall::Edit(_) => "Edit",
            ToolCall::MultiEdit(_) => "MultiEdit",
            ToolCall::TodoWrite(_) => "TodoWrite",
            ToolCall::Read(_) => "Read",
            ToolCall::Write(_) => "Write",
            ToolCall::Submit(_) => "Submit",
        }
    }
}

/// What a tool call produced: text for the agent plus structured details.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ToolOutput {
    /// The text the agent sees.
    pub text: String,
    /// The call failed (the text says why).
    pub is_error: bool,
    /// Structured details (exit code, matched paths, ...).
    pub data: ObservationData,
    /// Wall-clock time the call spent waiting for a CPU while none of its processes ran (a
    /// Bash command on a busy host; zero otherwise): the host's doing, not charged as tool
    /// time.
    #[serde(skip)]
    pub cpu_wait: Duration,
}

impl ToolOutput {
    fn ok(text: impl Into<String>, data: ToolData) -> Self {
        Self {
            text: text.into(),
            is_error: false,
            data: data.into(),
            cpu_wait: Duration::ZERO,
        }
    }

    fn error(err: &ToolError) -> Self {
        Self {
            text: format!("Error: {}", ErrorChain(err)),
            is_error: true,
            data: ObservationData::default(),
            cpu_wait: Duration::ZERO,
        }
    }
}

/// Limits on what tools return, how much they read and write, and how long they run.
#[derive(Debug, Clone, Serialize)]
pub struct ToolLimits {
    /// Characters of output kept per stream (the middle of longer output is cut).
    pub max_output_chars: usize,
    /// Bash timeout when the call names none.
    pub default_bash_timeout: Duration,
    /// Largest Bash timeout a call may ask for.
    pub max_bash_timeout: Duration,
    /// Most paths Glob lists.
    pub max_glob_results: usize,
    /// Lines Read returns when the call names no limit.
    pub default_read_lines: usize,
    /// Bytes of a file Read looks at (the rest is cut, and the cut said); also the largest
    /// file MultiEdit edits.
    pub max_read_bytes: u64,
    /// Largest file Write or MultiEdit writes.
    pub max_write_bytes: u64,
    /// Most edits in one MultiEdit call.
    pub max_edits: usize,
    /// Longest Glob pattern, in bytes.
    pub max_glob_pattern_len: usize,
    /// Most wildcards (`*`, `?`, `[`, `{`) in a Glob pattern.
    pub max_glob_wildcards: usize,
    /// Deepest directory level Glob descends to.
    pub max_glob_depth: usize,
    /// Most directory entries one Glob looks at.
    pub max_glob_entries: usize,
    /// How long a file tool (and the check of protected files after every call) may take
    /// before the server stops waiting for it.
    pub file_tool_timeout: Duration,
}

impl Default for ToolLimits {
    fn default() -> Self {
        Self {
            max_output_chars: 30_000,
            default_bash_timeout: Duration::from_millis(120_000),
            max_bash_timeout: Duration::from_millis(600_000),
            max_glob_results: 1_000,
            default_read_lines: 2_000,
            max_read_bytes: 8 << 20,
            max_write_bytes: 8 << 20,
            max_edits: 256,
            max_glob_pattern_len: 1_000,
            max_glob_wildcards: 64,
            max_glob_depth: 32,
            max_glob_entries: 100_000,
            file_tool_timeout: Duration::from_secs(30),
        }
    }
}

/// One episode's tools: its workspace, jail, Bash working directory and todo list.
#[derive(Debug)]
pub struct Toolbox {
    sandbox: Sandbox,
    workspace: Workspace,
    jail: Jail,
    state_dir: PathBuf,
    cwd: PathBuf,
    todos: Vec<Todo>,
    limits: ToolLimits,
}

impl Toolbox {
    /// A toolbox over `workspace`; `state_dir` is a writable scratch directory of the jail
    /// (its temp dir) where the tools keep per-call state.
    pub fn new(
        sandbox: Sandbox,
        workspace: Workspace,
        jail: Jail,
        state_dir: PathBuf,
        limits: ToolLimits,
    ) -> Self {
        let cwd = workspace.root().to_path_buf();
        Self {
            sandbox,
            workspace,
            jail,
            state_dir,
            cwd,
            todos: Vec::new(),
            limits,
        }
    }

    /// The workspace.
    pub fn workspace(&self) -> &Workspace {
        &self.workspace
    }

    /// The current todo list.
    pub fn todos(&self) -> &[Todo] {
        &self.todos
    }

    /// Restores a todo list (when an episode is reloaded).
    pub fn set_todos(&mut self, todos: Vec<Todo>) {
        self.todos = todos;
    }

    /// The sandbox its commands run in.
    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
    }

    /// The Bash working directory.
    pub fn cwd(&self) -> &Path {
        &self.cwd
    }

    /// Runs one call. `budget` bounds how long it may take (the episode's remaining tool time).
    /// Errors come back as error outputs; this never fails. File I/O runs on tokio's blocking
    /// pool under [`ToolLimits::file_tool_timeout`], so a stuck filesystem cannot stall the
    /// server's workers.
    pub async fn run(&mut self, call: &ToolCall, budget: Duration) -> ToolOutput {
        let timeout = self.limits.file_tool_timeout;
        let result = match call {
            ToolCall::Bash(a) => {
                let asked = a
                    .timeout
                    .map(Duration::from_millis)
                    .unwrap_or(self.limits.default_bash_timeout)
                    .min(self.limits.max_bash_timeout);
                // A command cut by the episode's budget says so (not just "timed out").
                let by_budget = budget < asked;
                // One cut by its own timeout says how far the timeout may go, where it may.
                let may_raise_to =
                    (asked < self.limits.max_bash_timeout).then_some(self.limits.max_bash_timeout);
                bash::run(self, &a.command, asked.min(budget), by_budget, may_raise_to).await
            }
            ToolCall::TodoWrite(a) => todo::write(&mut self.todos, a),
            ToolCall::Submit(_) => Ok(ToolOutput::ok(
                "Submitted model_new.py for evaluation.",
                ToolData::default(),
            )),
            ToolCall::Glob(_)
            | ToolCall::Grep(_)
            | ToolCall::Edit(_)
            | ToolCall::MultiEdit(_)
            | ToolCall::Read(_)
            | ToolCall::Write(_) => {
                let (ws, limits, call) =
                    (self.workspace.clone(), self.limits.clone(), call.clone());
                off_runtime(timeout, move || run_file_tool(&ws, &limits, &call)).await
            }
        };
        let mut out = result.unwrap_or_else(|e| ToolOutput::error(&e));
        let ws = self.workspace.clone();
        match off_runtime(timeout, move || ws.restore_protected()).await {
            Ok(restored) if !restored.is_empty() => {
                out.text.push_str(&format!(
                    "\n[read-only files were changed and have been restored: {}]",
                    restored.join(", ")
                ));
                out.data.restored_read_only = restored;
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %ErrorChain(&e), "restoring protected files failed"),
        }
        out
    }
}

/// The in-process file tools; the others are not run here.
fn run_file_tool(
    ws: &Workspace,
    limits: &ToolLimits,
    call: &ToolCall,
) -> Result<ToolOutput, ToolError> {
    match call {
        ToolCall::Glob(a) => glob::run(ws, a, limits),
        ToolCall::Grep(a) => grep::run(ws, a, limits),
        ToolCall::Edit(a) => edit::run(ws, a, limits),
        ToolCall::MultiEdit(a) => files::multi_edit(ws, a, limits),
        ToolCall::Read(a) => files::read(ws, a, limits),
        ToolCall::Write(a) => files::write(ws, a, limits),
        other => Err(ToolError::Failed(format!(
            "{} is not a file tool",
            other.name()
        ))),
    }
}

/// Runs blocking file work on tokio's blocking pool and waits at most `timeout` for it. A
/// panic in it becomes an error; work still stuck after the timeout is left to finish on its
/// own thread.
async fn off_runtime<T: Send + 'static>(
    timeout: Duration,
    work: impl FnOnce() -> Result<T, ToolError> + Send + 'static,
) -> Result<T, ToolError> {
    match tokio::time::timeout(timeout, tokio::task::spawn_blocking(work)).await {
        Ok(Ok(result)) => result,
        Ok(Err(join)) => {
            tracing::error!(error = %join, "a file tool panicked");
            Err(ToolError::Failed("internal error".into()))
        }
        Err(_) => {
            tracing::warn!(?timeout, "a file tool is stuck; no longer waiting for it");
            Err(ToolError::TimedOut(timeout))
        }
    }
}
