//! `TodoWrite`: the episode's todo list, replaced whole on every call.

use env_api::observation::{TodoWriteData, ToolData};

use super::{TodoItem, TodoStatus, TodoWriteArgs, ToolError, ToolOutput};

/// A stored todo item.
pub type Todo = TodoItem;

/// Most items a list may hold: the list is kept per episode and rendered on every call.
const MAX_TODOS: usize = 100;
/// Longest text of one item, in characters.
const MAX_TODO_CHARS: usize = 1_000;

pub(super) fn write(todos: &mut Vec<Todo>, args: &TodoWriteArgs) -> Result<ToolOutput, ToolError> {
    if args.todos.len() > MAX_TODOS {
        return Err(ToolError::InvalidArgument(format!(
            "{} todos, over the limit of {MAX_TODOS}",
            args.todos.len()
        )));
    }
    for (i, t) in args.todos.iter().enumerate() {
        let long = [Some(&t.content), t.active_form.as_ref(), t.id.as_ref()]
            .into_iter()
            .flatten()
            .any(|s| s.chars().count() > MAX_TODO_CHARS);
        if long {
            return Err(ToolError::InvalidArgument(format!(
                "todo {} is longer than {MAX_TODO_CHARS} characters",
                i + 1
            )));
        }
        if t.content.trim().is_empty() {
            return Err(ToolError::InvalidArgument(format!(
                "todo {} has empty content",
                i + 1
            )));
        }
        if let Some(p) = &t.priority {
            if !matches!(p.as_str(), "high" | "medium" | "low") {
                return Err(ToolError::InvalidArgument(format!(
                    "todo {} has priority {p:?}; use high, medium or low",
                    i + 1
                )));
            }
        }
    }
    *todos = args.todos.clone();
    let count = |s: TodoStatus| todos.iter().filter(|t| t.status == s).count();
    let (p, ip, c) = (
        count(TodoStatus::Pending),
        count(TodoStatus::InProgress),
        count(TodoStatus::Completed),
    );
    let mut text = format!("Todo list updated: {p} pending, {ip} in progress, {c} completed.");
    for t in todos.iter() {
        let mark = match t.status {
            TodoStatus::Pending => "[ ]",
            TodoStatus::InProgress => "[~]",
            TodoStatus::Completed => "[x]",
        };
        text.push_str(&format!("\n{mark} {}", t.content));
    }
    Ok(ToolOutput::ok(
        text,
        ToolData::TodoWrite(TodoWriteData {
            todos: todos.clone(),
        }),
    ))
}
