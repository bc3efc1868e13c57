//! `Observation.data`: what a tool reports besides its text, one type per tool.
//!
//! The objects carry no tag of their own (the observation's `tool` names the tool), so
//! [`ToolData`] is untagged and told apart by its fields; no two shapes share their required
//! fields. The fields of each struct are in alphabetical order: the server used to build these
//! objects as JSON maps, which serialise sorted, and the same order keeps its answers the same
//! byte for byte.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::tools::TodoItem;

/// `Observation.data`: the tool's own details plus, after any call, the protected files it
/// changed (restored before the answer).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ObservationData {
    /// The tool's details (their fields sit at the top level of `data`).
    #[serde(flatten)]
    pub details: ToolData,
    /// Read-only files the call changed and the server put back (absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restored_read_only: Vec<String>,
}

impl From<ToolData> for ObservationData {
    fn from(details: ToolData) -> Self {
        Self {
            details,
            restored_read_only: Vec::new(),
        }
    }
}

/// A tool's structured result, by tool.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
#[serde(untagged)]
pub enum ToolData {
    /// `Bash`.
    Bash(BashData),
    /// `Edit` and `MultiEdit` (an Edit is a MultiEdit of one edit).
    Edit(EditData),
    /// `Write`.
    Write(WriteData),
    /// `Read`.
    Read(ReadData),
    /// `Grep`.
    Grep(GrepData),
    /// `Glob`.
    Glob(GlobData),
    /// `TodoWrite`.
    TodoWrite(TodoWriteData),
    /// A reset: the workspace's files.
    Reset(ResetData),
    /// `Submit`, and every call that failed (the text says why): `{}`.
    Empty(NoData),
    /// An object of a shape this version does not produce (a newer server's, or an older
    /// one's in a trajectory log), kept as it came so that reading and re-sending it loses
    /// nothing.
    #[schema(value_type = Object)]
    Other(BTreeMap<String, Value>),
}

impl Default for ToolData {
    fn default() -> Self {
        Self::Empty(NoData {})
    }
}

/// How Bash reports its two streams.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum StreamLayout {
    /// stdout first, then stderr after a `[stderr]` line (each capped on its own).
    #[default]
    Separate,
}

/// Details of a `Bash` call.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct BashData {
    /// The sandbox limit the command broke (`disk_quota`, `inode_quota`, `memory_limit`,
    /// `process_limit`), which stopped it; null when none.
    pub breach: Option<String>,
    /// It was cut because the episode's tool time ran out (not its own timeout).
    pub budget_cut: bool,
    /// The working directory after the command, relative to the workspace (`.` at its root).
    pub cwd: String,
    /// Wall-clock milliseconds the command ran.
    pub duration_ms: u64,
    /// The exit code (128 + the signal for a killed process); null when it could not be
    /// collected.
    pub exit_code: Option<i32>,
    /// Processes killed after the command ended or was stopped (left in the background).
    pub processes_killed: usize,
    /// Bytes the command wrote to stderr, before any cut.
    pub stderr_bytes: u64,
    /// How the text lays out the two streams.
    pub stdout: StreamLayout,
    /// Bytes the command wrote to stdout, before any cut.
    pub stdout_bytes: u64,
    /// It ran past its timeout and was killed.
    pub timed_out: bool,
    /// The middle of a stream was cut from the text.
    pub truncated: bool,
}

/// Details of an `Edit` or `MultiEdit` call.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct EditData {
    /// The file did not exist and was created.
    pub created: bool,
    /// Edits applied.
    pub edits: usize,
    /// The file, relative to the workspace.
    pub path: String,
    /// Occurrences replaced, over all edits.
    pub replacements: usize,
}

/// Details of a `Write` call.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct WriteData {
    /// Bytes written.
    pub bytes: u64,
    /// The file did not exist and was created.
    pub created: bool,
    /// The file, relative to the workspace.
    pub path: String,
}

/// Details of a `Read` call.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ReadData {
    /// Bytes of the file looked at (whole lines only when the file was cut).
    pub bytes_read: u64,
    /// Lines in what was looked at (not only those shown).
    pub lines: usize,
    /// The file's size in bytes.
    pub size: u64,
    /// The file is larger than Read looks at; the rest was not read.
    pub truncated: bool,
}

/// Details of a `Grep` call.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct GrepData {
    /// Nothing was left out: no cap, limit or skipped file cut the search or its output.
    pub complete: bool,
    /// Files searched.
    pub files_searched: usize,
    /// Files with at least one match.
    pub matching_files: usize,
    /// Matching lines, over all files.
    pub matching_lines: u64,
}

/// Details of a `Glob` call.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct GlobData {
    /// The walk saw every directory (none too deep, no entry cap reached).
    pub complete: bool,
    /// The paths listed, newest first, relative to the workspace.
    pub paths: Vec<String>,
    /// Matches found, listed or not.
    pub total: usize,
}

/// Details of a `TodoWrite` call.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct TodoWriteData {
    /// The list as it now stands.
    pub todos: Vec<TodoItem>,
}

/// Details of a reset.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct ResetData {
    /// The workspace's files, sorted.
    pub files: Vec<String>,
}

/// No details: `{}`. Unknown fields are refused so that other objects are not taken for it.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NoData {}
