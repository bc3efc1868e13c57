//! Near-duplicate detection between tasks: what a task computes, reduced to the sequence of
//! operators its `Model` applies, compared by the Jaccard index of shingle sets.
//!
//! The sequence is read from `Model`'s methods other than `__init__`, in source order: every
//! call (its last name: `F.gelu`, `torch.nn.functional.gelu`, `x.gelu()` and `nn.GELU()` all
//! read `gelu`), with `self.layer(...)` replaced by the calls that built `self.layer` in
//! `__init__` (so `self.fc(x)` reads `linear`), and the arithmetic operators (`+`, `*`, `@`...).
//! Names are lowercased with underscores removed, a few aliases are merged (`mm`, `bmm`, `@`
//! are `matmul`; `torch.add` is `+`), and calls that only move or reshape data (`view`,
//! `reshape`, `size`...) are dropped. Variable names, sizes, constants, comments and
//! docstrings do not count, so a task renamed or resized reads the same. Arguments do not
//! count either: a grouped and a plain convolution both read `conv2d`.
//!
//! The shingles of a sequence are its operators (unigrams) and its operator pairs with
//! start and end markers (bigrams), so both what is fused and in which order count. Two tasks
//! are near-duplicates when the Jaccard index of their shingle sets reaches the threshold,
//! [`DEFAULT_THRESHOLD`] = 0.6 unless told otherwise. With it:
//!
//! - the same operators in the same order (renamed, resized): 1.0, a duplicate;
//! - a chain of three with one operator added (`a b c` against `a b c d`): 0.6, a duplicate;
//! - a chain of three with one operator replaced (`a b c` against `a x c`): 0.4, distinct;
//! - two operators added to a chain of three: 0.5, distinct (a new fusion);
//! - the same two operators in the other order: 0.25, distinct.

use std::collections::{BTreeMap, BTreeSet};

use crate::TaskSet;

/// The similarity at or above which two tasks are near-duplicates.
pub const DEFAULT_THRESHOLD: f64 = 0.6;

/// Python keywords that a parenthesis may follow (`return (a + b)`): no calls.
const KEYWORDS: &[&str] = &[
    "return", "if", "elif", "while", "for", "in", "not", "and", "or", "is", "lambda", "yield",
    "assert", "del", "with", "else", "await", "print",
];

/// Calls that only reshape, move, convert or build data: not what a task computes.
const NOISE: &[&str] = &[
    "super",
    "init",
    "size",
    "dim",
    "numel",
    "view",
    "viewas",
    "reshape",
    "reshapeas",
    "contiguous",
    "flatten",
    "unflatten",
    "unsqueeze",
    "squeeze",
    "expand",
    "expandas",
    "float",
    "half",
    "double",
    "to",
    "type",
    "typeas",
    "parameter",
    "tensor",
    "randn",
    "rand",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "len",
    "int",
    "range",
    "isinstance",
    "sequential",
    "modulelist",
    "identity",
];

/// Names of the same operation merged into one.
fn alias(name: &str) -> &str {
    match name {
        "mm" | "bmm" | "matmul" => "matmul",
        "add" => "+",
        "sub" | "subtract" => "-",
        "mul" | "multiply" => "*",
        "div" | "divide" | "truediv" => "/",
        "pow" => "**",
        "clip" | "clamp" | "hardtanh" => "clamp",
        "absolute" => "abs",
        "batchnorm1d" | "batchnorm2d" | "batchnorm3d" => "batchnorm",
        "instancenorm1d" | "instancenorm2d" | "instancenorm3d" => "instancenorm",
        other => other,
    }
}

/// One lexical token of Python source.
#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Name(String),
    Number,
    Str,
    Op(String),
    /// The end of a logical line (outside brackets).
    Newline,
}

/// Python tokens, without comments; strings (docstrings included) become [`Tok::Str`].
fn lex(src: &str) -> Vec<Tok> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let (mut i, mut depth) = (0usize, 0i32);
    while i < b.len() {
        let c = b[i];
        match c {
            b'#' => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'\n' => {
                if depth == 0 && out.last().is_some_and(|t| *t != Tok::Newline) {
                    out.push(Tok::Newline);
                }
                i += 1;
            }
            b'\\' if b.get(i + 1) == Some(&b'\n') => i += 2,
            b'\'' | b'"' => i = skip_string(b, i, &mut out),
            c if c.is_ascii_digit()
                || (c == b'.' && b.get(i + 1).is_some_and(u8::is_ascii_digit)) =>
            {
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.' || b[i] == b'_')
                {
                    // An exponent's sign belongs to the number.
                    if (b[i] == b'e' || b[i] == b'E') && matches!(b.get(i + 1), Some(b'+' | b'-')) {
                        i += 1;
                    }
                    i += 1;
                }
                out.push(Tok::Number);
            }
            c if c.is_ascii_alphabetic() || c == b'_' || c >= 0x80 => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] >= 0x80)
                {
                    i += 1;
                }
                let word = &src[start..i];
                // String prefixes: r"...", f'...', b"..." and their combinations.
                if word.len() <= 2
                    && word.chars().all(|ch| "rRbBfFuU".contains(ch))
                    && matches!(b.get(i), Some(b'\'' | b'"'))
                {
                    i = skip_string(b, i, &mut out);
                } else {
                    out.push(Tok::Name(word.to_string()));
                }
            }
            c if c.is_ascii_whitespace() => i += 1,
            _ => {
                let three = src.get(i..i + 3).unwrap_or("");
                let two = src.get(i..i + 2).unwrap_or("");
                let op = if ["**=", "//=", ">>=", "<<="].contains(&three) {
                    three
                } else if [
                    "**", "//", "->", "==", "!=", "<=", ">=", "+=", "-=", "*=", "/=", "@=", "%=",
                    "<<", ">>", ":=", "&=", "|=", "^=",
                ]
                .contains(&two)
                {
                    two
                } else {
                    src.get(i..i + 1).unwrap_or("?")
                };
                match op {
                    "(" | "[" | "{" => depth += 1,
                    ")" | "]" | "}" => depth = (depth - 1).max(0),
                    _ => {}
                }
                out.push(Tok::Op(op.to_string()));
                i += op.len().max(1);
            }
        }
    }
    out
}

/// Skips a string literal starting at `i` (a quote), pushing [`Tok::Str`]; returns the index
/// after it.
fn skip_string(b: &[u8], mut i: usize, out: &mut Vec<Tok>) -> usize {
    let q = b[i];
    let triple = b.get(i + 1) == Some(&q) && b.get(i + 2) == Some(&q);
    i += if triple { 3 } else { 1 };
    while i < b.len() {
        if b[i] == b'\\' {
            i += 2;
            continue;
        }
        if b[i] == q && (!triple || (b.get(i + 1) == Some(&q) && b.get(i + 2) == Some(&q))) {
            i += if triple { 3 } else { 1 };
            break;
        }
        if b[i] == b'\n' && !triple {
            break;
        }
        i += 1;
    }
    out.push(Tok::Str);
    i
}

/// The text of `class Model`: from its line to the next line that starts at column 0.
fn model_class(src: &str) -> Option<String> {
    let mut lines = src.lines().skip_while(|l| !l.starts_with("class Model"));
    let first = lines.next()?;
    let mut text = String::from(first);
    text.push('\n');
    for l in lines {
        let top = l.starts_with(|c: char| !c.is_whitespace() && c != '#' && c != ')');
        if top {
            break;
        }
        text.push_str(l);
        text.push('\n');
    }
    Some(text)
}

/// The normalised name of a called name.
fn normalise(name: &str) -> Option<String> {
    let n: String = name
        .chars()
        .filter(|&c| c != '_')
        .flat_map(char::to_lowercase)
        .collect();
    if n.is_empty() || NOISE.contains(&n.as_str()) || KEYWORDS.contains(&name) {
        return None;
    }
    Some(alias(&n).to_string())
}

const ARITHMETIC: &[&str] = &[
    "+", "-", "*", "/", "//", "@", "**", "%", "+=", "-=", "*=", "/=", "//=", "@=", "**=",
];

/// The operators of a token run: calls and arithmetic, `self.x(...)` expanded via `modules`.
/// A call counts where its parentheses close, so nested calls read in the order they run
/// (`F.gelu(self.fc(x))` is `linear gelu`); an arithmetic operator counts where it stands.
fn ops_of(toks: &[Tok], modules: &BTreeMap<String, Vec<String>>) -> Vec<String> {
    let mut out = Vec::new();
    // Per open parenthesis: the operators its call adds when it closes (none for grouping).
    let mut open: Vec<Vec<String>> = Vec::new();
    let mut pending: Option<Vec<String>> = None;
    for (k, t) in toks.iter().enumerate() {
        match t {
            Tok::Name(name) if matches!(toks.get(k + 1), Some(Tok::Op(p)) if p == "(") => {
                let is_self_attr = k >= 2
                    && toks[k - 1] == Tok::Op(".".into())
                    && toks[k - 2] == Tok::Name("self".into())
                    && (k < 3 || toks[k - 3] != Tok::Op(".".into()));
                pending = Some(match modules.get(name).filter(|_| is_self_attr) {
                    Some(seq) => seq.clone(),
                    None => normalise(name).into_iter().collect(),
                });
            }
            Tok::Op(p) if p == "(" => open.push(pending.take().unwrap_or_default()),
            Tok::Op(p) if p == ")" => out.extend(open.pop().unwrap_or_default()),
            Tok::Op(op) if ARITHMETIC.contains(&op.as_str()) => {
                let prev = k.checked_sub(1).and_then(|p| toks.get(p));
                let next = toks.get(k + 1);
                // A signed constant (`dim=-1`) or arithmetic on constants only (`1.0 / 3`):
                // no operation on the data.
                let after_value = match prev {
                    Some(Tok::Name(_) | Tok::Number) => true,
                    Some(Tok::Op(p)) => p == ")" || p == "]",
                    _ => false,
                };
                let constant_only =
                    matches!(prev, Some(Tok::Number)) && matches!(next, Some(Tok::Number));
                let signed_constant = !after_value && matches!(next, Some(Tok::Number));
                // `*args` and the like: no operand follows.
                let dangling = !matches!(next, Some(Tok::Name(_) | Tok::Number | Tok::Op(_)));
                if constant_only || signed_constant || dangling {
                    continue;
                }
                let base = op.trim_end_matches('=');
                out.push(alias(if base == "@" { "matmul" } else { base }).to_string());
            }
            _ => {}
        }
    }
    // Parentheses left open (a cut-off source): their calls still count.
    out.extend(open.into_iter().rev().flatten());
    out
}

/// The operator sequence of a task's `Model` (empty when the source defines none).
pub fn op_sequence(source: &str) -> Vec<String> {
    let Some(class) = model_class(source) else {
        return Vec::new();
    };
    let toks = lex(&class);
    // Methods: (name, token range of the body).
    let defs: Vec<usize> = toks
        .iter()
        .enumerate()
        .filter(|(_, t)| **t == Tok::Name("def".into()))
        .map(|(k, _)| k)
        .collect();
    let mut methods = Vec::new();
    for (n, &start) in defs.iter().enumerate() {
        let end = defs.get(n + 1).copied().unwrap_or(toks.len());
        let name = match toks.get(start + 1) {
            Some(Tok::Name(s)) => s.clone(),
            _ => continue,
        };
        methods.push((name, &toks[start..end]));
    }
    // `self.name = <expression>` in __init__: the operators that build `name`.
    let mut modules = BTreeMap::new();
    for (_, body) in methods.iter().filter(|(n, _)| n == "__init__") {
        let statements = body.split(|t| *t == Tok::Newline);
        for st in statements {
            if let [Tok::Name(s), Tok::Op(dot), Tok::Name(attr), Tok::Op(eq), rhs @ ..] = st {
                if s == "self" && dot == "." && eq == "=" {
                    modules.insert(attr.clone(), ops_of(rhs, &BTreeMap::new()));
                }
            }
        }
    }
    methods
        .iter()
        .filter(|(n, _)| n != "__init__")
        // Skip the signature: the body starts after the `:` that ends the `def` line.
        .flat_map(|(_, body)| {
            let from = body
                .iter()
                .position(|t| *t == Tok::Newline)
                .unwrap_or(body.len());
            ops_of(&body[from..], &modules)
        })
        .collect()
}

/// The shingles of an operator sequence: its operators and its adjacent pairs, with start
/// (`^`) and end (`$`) markers.
pub fn shingles(ops: &[String]) -> BTreeSet<String> {
    let mut set: BTreeSet<String> = ops.iter().cloned().collect();
    let padded: Vec<&str> = std::iter::once("^")
        .chain(ops.iter().map(String::as_str))
        .chain(std::iter::once("$"))
        .collect();
    if !ops.is_empty() {
        for w in padded.windows(2) {
            set.insert(format!("{} {}", w[0], w[1]));
        }
    }
    set
}

/// The Jaccard index of two sets: 0 when both are empty (no evidence of sameness).
pub fn jaccard(a: &BTreeSet<String>, b: &BTreeSet<String>) -> f64 {
    let union = a.union(b).count();
    if union == 0 {
        return 0.0;
    }
    a.intersection(b).count() as f64 / union as f64
}

/// The similarity of two task sources, in [0, 1].
pub fn similarity(a: &str, b: &str) -> f64 {
    jaccard(&shingles(&op_sequence(a)), &shingles(&op_sequence(b)))
}

/// The task most like a candidate.
#[derive(Debug, Clone, PartialEq)]
pub struct Nearest {
    /// The indexed task's name (a task id, or a file name).
    pub name: String,
    /// Its similarity to the candidate.
    pub similarity: f64,
}

/// Tasks to compare candidates with, by their shingle sets.
#[derive(Debug, Clone, Default)]
pub struct SimilarityIndex {
    entries: Vec<(String, BTreeSet<String>)>,
}

impl SimilarityIndex {
    /// An index of every kernel task of a set, named by id.
    pub fn of_tasks(tasks: &TaskSet) -> Self {
        let mut index = Self::default();
        for t in tasks.split("all") {
            index.insert(&t.id, &t.source);
        }
        index
    }

    /// Adds a task.
    pub fn insert(&mut self, name: &str, source: &str) {
        self.entries
            .push((name.to_string(), shingles(&op_sequence(source))));
    }

    /// Number of tasks indexed.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The most similar task (the first of equals), if any is indexed.
    pub fn nearest(&self, source: &str) -> Option<Nearest> {
        let s = shingles(&op_sequence(source));
        let mut best: Option<Nearest> = None;
        for (name, other) in &self.entries {
            let similarity = jaccard(&s, other);
            if best.as_ref().is_none_or(|b| similarity > b.similarity) {
                best = Some(Nearest {
                    name: name.clone(),
                    similarity,
                });
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(ops: &[&str]) -> Vec<String> {
        ops.iter().map(|s| s.to_string()).collect()
    }

    fn sim(a: &[&str], b: &[&str]) -> f64 {
        jaccard(&shingles(&seq(a)), &shingles(&seq(b)))
    }

    #[test]
    fn the_documented_similarities_hold() {
        assert_eq!(sim(&["a", "b", "c"], &["a", "b", "c"]), 1.0);
        assert_eq!(sim(&["a", "b", "c"], &["a", "b", "c", "d"]), 0.6);
        assert_eq!(sim(&["a", "b", "c"], &["a", "x", "c"]), 0.4);
        assert_eq!(sim(&["a", "b", "c"], &["a", "b", "c", "d", "e"]), 0.5);
        assert_eq!(sim(&["a", "b"], &["b", "a"]), 0.25);
        assert_eq!(sim(&[], &[]), 0.0);
    }

    #[test]
    fn calls_modules_and_operators_read_as_one_sequence() {
        let src = r#"
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """Docstring with F.relu(x) in it: not code."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)  # a comment: torch.sigmoid(x)
        self.net = nn.Sequential(nn.Conv2d(d, d, 3), nn.BatchNorm2d(d))
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x).view(x.size(0), -1)
        x = torch.nn.functional.gelu(x) * self.scale
        y = self.net(x.unsqueeze(-1))
        return torch.softmax(x @ y.mT, dim=-1) + x.relu_()


def get_inputs():
    return [torch.randn(8, 8)]
"#;
        assert_eq!(
            op_sequence(src),
            seq(&[
                "linear",
                "gelu",
                "*",
                "conv2d",
                "batchnorm",
                "matmul",
                "softmax",
                "+",
                "relu"
            ])
        );
    }

    #[test]
    fn renamed_and_resized_tasks_read_the_same() {
        let a = "class Model(nn.Module):\n    def __init__(self, i, o):\n        super().__init__()\n        self.linear = nn.Linear(i, o)\n\n    def forward(self, x):\n        return F.gelu(self.linear(x))\n";
        let b = "class Model(nn.Module):\n    \"\"\"Renamed.\"\"\"\n\n    def __init__(self):\n        super().__init__()\n        self.proj = nn.Linear(128, 256, bias=True)\n\n    def forward(self, inp):\n        h = self.proj(inp)\n        return torch.nn.GELU()(h)\n";
        assert_eq!(similarity(a, b), 1.0);
        assert_eq!(op_sequence(a), seq(&["linear", "gelu"]));
    }

    #[test]
    fn the_bundled_tasks_read_as_operators_and_each_is_nearest_to_itself() {
        let tasks = TaskSet::bundled();
        let index = SimilarityIndex::of_tasks(&tasks);
        assert_eq!(index.len(), tasks.split("all").len());
        let mut pairs = Vec::new();
        for t in tasks.split("all") {
            assert!(!op_sequence(&t.source).is_empty(), "{}", t.id);
            let nearest = index.nearest(&t.source).unwrap();
            assert_eq!(nearest.similarity, 1.0, "{}", t.id);
            for u in tasks.split("all") {
                if t.id < u.id {
                    pairs.push((similarity(&t.source, &u.source), t.id.clone(), u.id.clone()));
                }
            }
        }
        // The operator sequence does not see arguments: tasks of one operator that differ only
        // in its configuration (batched or not, grouped or not) read the same.
        let same: Vec<(&str, &str)> = pairs
            .iter()
            .filter(|p| p.0 == 1.0)
            .map(|p| (p.1.as_str(), p.2.as_str()))
            .collect();
        assert_eq!(
            same,
            [
                ("L1/10_BatchMatmul", "L1/3_Matmul"),
                ("L1/11_Conv2d", "L1/28_DepthwiseConv2d")
            ]
        );
        let linear_gelu = tasks.get("L2/11_Linear_GELU").unwrap();
        assert_eq!(
            index.nearest(&linear_gelu.source).unwrap().name,
            "L2/11_Linear_GELU"
        );
    }
}
