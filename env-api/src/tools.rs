//! Argument types of the tools an agent calls (`Bash`, `Glob`, `Grep`, `Read`, `Write`,
//! `Edit`, `MultiEdit`, `TodoWrite`, `Submit`). Their JSON schemas (through schemars) are the
//! OpenAI function-tool parameters the server advertises; names and shapes follow Claude
//! Code's tools, so a model trained on those calls these unchanged.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Arguments of `Bash`.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BashArgs {
    /// The command to run with bash in the workspace.
    pub command: String,
    /// Timeout in milliseconds (default 120000, at most 600000, and never past the episode's tool time left).
    #[serde(default)]
    pub timeout: Option<u64>,
    /// A short description of what the command does, in 5-10 words.
    #[serde(default)]
    pub description: Option<String>,
}

/// Arguments of `Glob`.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GlobArgs {
    /// The glob pattern, such as `**/*.cu` or `kernels/*.cpp`.
    pub pattern: String,
    /// Directory to search in (default: the workspace root).
    #[serde(default)]
    pub path: Option<String>,
}

/// What `Grep` prints.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema, ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum GrepOutputMode {
    /// Matching lines (with context lines and line numbers as asked).
    Content,
    /// Paths of the files that match (the default).
    #[default]
    FilesWithMatches,
    /// Number of matching lines per file.
    Count,
}

/// Arguments of `Grep` (ripgrep's regular expressions and options).
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GrepArgs {
    /// The regular expression to search for (Rust regex syntax, as ripgrep's).
    pub pattern: String,
    /// File or directory to search in (default: the workspace root).
    #[serde(default)]
    pub path: Option<String>,
    /// Only search files whose name (or, when it holds a `/`, whose path below `path`) matches
    /// this glob, such as `*.cpp` or `*.{cu,cuh}`.
    #[serde(default)]
    pub glob: Option<String>,
    /// Only search files of this type: `py`, `cpp` (C and C++ sources and headers), `cuda`, `md`, `txt`, `json`, `sh`.
    #[serde(default, rename = "type")]
    pub file_type: Option<String>,
    /// Matching lines, the paths of matching files (the default) or counts per file.
    #[serde(default)]
    pub output_mode: Option<GrepOutputMode>,
    /// Case-insensitive search.
    #[serde(default, rename = "-i")]
    pub case_insensitive: Option<bool>,
    /// Show line numbers (content mode; default true).
    #[serde(default, rename = "-n")]
    pub line_numbers: Option<bool>,
    /// Lines of context after each match (content mode).
    #[serde(default, rename = "-A")]
    pub after: Option<usize>,
    /// Lines of context before each match (content mode).
    #[serde(default, rename = "-B")]
    pub before: Option<usize>,
    /// Lines of context before and after each match (content mode).
    #[serde(default, rename = "-C")]
    pub context: Option<usize>,
    /// Show only the first N lines or entries of the output.
    #[serde(default)]
    pub head_limit: Option<usize>,
    /// Let the pattern span lines (`.` matches a newline too).
    #[serde(default)]
    pub multiline: Option<bool>,
}

/// Arguments of `Edit`: one exact-string replacement in one file.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EditArgs {
    /// The file to edit (relative to the workspace root, or absolute inside it).
    pub file_path: String,
    /// The exact text to replace.
    pub old_string: String,
    /// The text to put in its place.
    pub new_string: String,
    /// Replace every occurrence.
    #[serde(default)]
    pub replace_all: bool,
}

/// One replacement inside a MultiEdit.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Edit {
    /// The exact text to replace.
    pub old_string: String,
    /// The text to put in its place.
    pub new_string: String,
    /// Replace every occurrence.
    #[serde(default)]
    pub replace_all: bool,
}

/// Arguments of `MultiEdit`.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MultiEditArgs {
    /// The file to edit (relative to the workspace root, or absolute inside it).
    pub file_path: String,
    /// The replacements, in order.
    pub edits: Vec<Edit>,
}

/// State of one todo item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TodoStatus {
    /// Not started.
    Pending,
    /// Being worked on.
    InProgress,
    /// Done.
    Completed,
}

/// A todo item as the agent sends it: the current form `{content, status, activeForm}` or
/// the older `{id, content, status, priority}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, ToSchema)]
pub struct TodoItem {
    /// What to do, in the imperative ("Profile the reference").
    pub content: String,
    /// Its state.
    pub status: TodoStatus,
    /// The same in the present continuous ("Profiling the reference").
    #[serde(
        rename = "activeForm",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub active_form: Option<String>,
    /// Identifier (older form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Priority: high, medium or low (older form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<String>,
}

/// Arguments of `TodoWrite`.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TodoWriteArgs {
    /// The whole updated todo list (it replaces the previous one).
    pub todos: Vec<TodoItem>,
}

/// Arguments of `Read`.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadArgs {
    /// The file to read.
    pub file_path: String,
    /// 1-based line to start at.
    #[serde(default)]
    pub offset: Option<usize>,
    /// Number of lines to read (default 2000).
    #[serde(default)]
    pub limit: Option<usize>,
}

/// Arguments of `Write`.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteArgs {
    /// The file to write (created with its directories if missing, replaced otherwise).
    pub file_path: String,
    /// The complete new contents.
    pub content: String,
}

/// Arguments of `Submit`: none.
#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitArgs {}
