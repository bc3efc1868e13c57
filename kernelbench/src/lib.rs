//! Tasks in KernelBench format: one Python file per task defining `Model(nn.Module)`,
//! `get_inputs()` and `get_init_inputs()`. A solution defines `ModelNew` with the same
//! constructor.
//!
//! Task ids are stable across runs: `L{level}/{file stem}` (such as `L1/19_ReLU`), and every
//! task carries the SHA-256 of its source.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use sha2::{Digest, Sha256};

mod bundled {
    include!(concat!(env!("OUT_DIR"), "/bundled.rs"));
}

/// Errors from reading tasks.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// A file could not be read.
    #[error("{path}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A task file lacks one of the pieces a task must define.
    #[error("{path}: not a task file: {reason}")]
    Invalid {
        /// The file.
        path: String,
        /// What is missing.
        reason: String,
    },
    /// No task has that id.
    #[error("unknown task {0:?}")]
    Unknown(String),
    /// No task is in that split.
    #[error("split {0:?} has no tasks")]
    EmptySplit(String),
}

/// One task.
#[derive(Debug, Clone, Serialize)]
pub struct Task {
    /// Stable id, `L1/19_ReLU` style (or `custom/<hash prefix>` for inline sources).
    pub id: String,
    /// Difficulty level (1 single operators, 2 sequences, 3 model blocks; 0 for inline tasks).
    pub level: u8,
    /// The name part of the id.
    pub name: String,
    /// The Python source.
    #[serde(skip)]
    pub source: String,
    /// SHA-256 of the source, hex.
    pub hash: String,
    /// What the agent must produce and how it is checked.
    #[serde(skip)]
    pub kind: TaskKind,
}

/// How a task is judged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum TaskKind {
    /// A KernelBench task: `ModelNew` in `model_new.py`, judged by the PyTorch harness.
    #[default]
    Kernel,
    /// A task of the tiny family: write `value` into `file`, then Submit. The same tools,
    /// episode flow and reward shape as a kernel task, small enough for a tiny policy to learn
    /// on a CPU; it proves the training loop, not kernel skill.
    Recall {
        /// The file to write, relative to the workspace.
        file: String,
        /// The exact text expected in it (surrounding whitespace ignored).
        value: String,
        /// Files placed in the workspace before the first turn (name, text): the `clue`
        /// family's `clue.txt`, which holds the word the prompt does not name.
        given: Vec<(String, String)>,
    },
}

/// Words of the tiny family; task `tiny/{i}_{word}` asks for word `i`.
pub const TINY_WORDS: [&str; 8] = [
    "red", "blue", "green", "amber", "violet", "cyan", "olive", "pearl",
];

/// Words of the `clue` family: task `clue/{i}` hides word `i` in `clue.txt`.
pub const CLUE_WORDS: [&str; 16] = [
    "red", "blue", "green", "amber", "violet", "cyan", "olive", "pearl", "coral", "ivory", "lilac",
    "mauve", "ochre", "sepia", "teal", "umber",
];

/// Checks that a source defines the three pieces of a task. This is a textual check (the
/// harness imports the file for real); it catches files that are not tasks at all.
pub fn validate_source(path: &str, source: &str) -> Result<(), TaskError> {
    let has_def = |name: &str| {
        source
            .lines()
            .any(|l| l.starts_with(&format!("def {name}(")))
    };
    let has_model = source
        .lines()
        .any(|l| l.starts_with("class Model(") || l.starts_with("class Model:"));
    let missing: Vec<&str> = [
        ("class Model", has_model),
        ("get_inputs()", has_def("get_inputs")),
        ("get_init_inputs()", has_def("get_init_inputs")),
    ]
    .into_iter()
    .filter(|(_, ok)| !ok)
    .map(|(n, _)| n)
    .collect();
    if !missing.is_empty() {
        return Err(TaskError::Invalid {
            path: path.into(),
            reason: format!("does not define {}", missing.join(", ")),
        });
    }
    if source.contains('\0') {
        return Err(TaskError::Invalid {
            path: path.into(),
            reason: "holds a NUL byte".into(),
        });
    }
    Ok(())
}

fn sha256_hex(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

impl Task {
    /// A task from an inline source (a user's own module), id'd by its hash.
    pub fn inline(source: &str) -> Result<Self, TaskError> {
        validate_source("inline task", source)?;
        let hash = sha256_hex(source);
        Ok(Self {
            id: format!("custom/{}", &hash[..12]),
            level: 0,
            name: "custom".into(),
            source: source.into(),
            hash,
            kind: TaskKind::Kernel,
        })
    }

    fn from_file(level: u8, stem: &str, source: String, path: &str) -> Result<Self, TaskError> {
        validate_source(path, &source)?;
        Ok(Self {
            id: format!("L{level}/{stem}"),
            level,
            name: stem.into(),
            hash: sha256_hex(&source),
            source,
            kind: TaskKind::Kernel,
        })
    }

    /// Task `i` of the tiny family (see [`TaskKind::Recall`]): its id is `tiny/{i}_{word}`.
    pub fn tiny(i: usize) -> Self {
        let word = TINY_WORDS[i % TINY_WORDS.len()];
        let name = format!("{i}_{word}");
        let source = format!("Write the word {word} into answer.txt, then call Submit.");
        Self {
            id: format!("tiny/{name}"),
            level: 0,
            name,
            hash: sha256_hex(&source),
            source,
            kind: TaskKind::Recall {
                file: "answer.txt".into(),
                value: word.into(),
                given: Vec::new(),
            },
        }
    }

    /// Task `i` of the `clue` family: a two-step recall. The word is not in the prompt (which
    /// is the same for every task but the id) but in the workspace's `clue.txt`, so a policy
    /// must read it with a tool and copy it from the tool's output into `answer.txt`. Unlike
    /// the `tiny` family, demonstrations of some tasks do not solve the others by rote: RFT
    /// teaches the call sequence, and what PPO adds is measurable (docs/BENCHMARKS.md).
    pub fn clue(i: usize) -> Self {
        let word = CLUE_WORDS[i % CLUE_WORDS.len()];
        let name = i.to_string();
        let source =
            "Read clue.txt, write the word it holds into answer.txt, then call Submit.".to_string();
        Self {
            id: format!("clue/{name}"),
            level: 0,
            name,
            hash: sha256_hex(&format!("{source}\n{word}")),
            source,
            kind: TaskKind::Recall {
                file: "answer.txt".into(),
                value: word.into(),
                given: vec![("clue.txt".into(), format!("{word}\n"))],
            },
        }
    }

    /// Whether this is a kernel task (judged by the PyTorch harness).
    pub fn is_kernel(&self) -> bool {
        self.kind == TaskKind::Kernel
    }
}

/// A set of tasks by id.
#[derive(Debug, Clone, Default)]
pub struct TaskSet {
    tasks: BTreeMap<String, Task>,
}

fn level_of(dir_name: &str) -> Option<u8> {
    dir_name.strip_prefix("level").and_then(|n| n.parse().ok())
}

impl TaskSet {
    /// The suite bundled with this crate.
    pub fn bundled() -> Self {
        let mut set = Self::default();
        for (rel, source) in bundled::BUNDLED {
            let (dir, file) = rel.split_once('/').unwrap_or(("level1", rel));
            let stem = file.trim_end_matches(".py");
            let level = level_of(dir).unwrap_or(1);
            if let Ok(task) = Task::from_file(level, stem, source.to_string(), rel) {
                set.tasks.insert(task.id.clone(), task);
            }
        }
        set
    }

    /// Loads a KernelBench checkout (`level1/ level2/ level3/` of `N_Name.py` files) or any
    /// directory of task files (taken as level 1). A broken file is an error naming it.
    pub fn load_dir(dir: &Path) -> Result<Self, TaskError> {
        let io = |path: &Path, source| TaskError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut set = Self::default();
        let mut dirs: Vec<(u8, PathBuf)> = Vec::new();
        for e in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
            let e = e.map_err(|e| io(dir, e))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if e.path().is_dir() {
                if let Some(level) = level_of(&name) {
                    dirs.push((level, e.path()));
                }
            }
        }
        if dirs.is_empty() {
            dirs.push((1, dir.to_path_buf()));
        }
        for (level, d) in dirs {
            let mut files: Vec<PathBuf> = std::fs::read_dir(&d)
                .map_err(|e| io(&d, e))?
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.extension().is_some_and(|x| x == "py")
                        && p.file_name().is_none_or(|n| n != "__init__.py")
                })
                .collect();
            files.sort();
            for f in files {
                let source = std::fs::read_to_string(&f).map_err(|e| io(&f, e))?;
                let stem = f
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let task = Task::from_file(level, &stem, source, &f.display().to_string())?;
                set.tasks.insert(task.id.clone(), task);
            }
        }
        Ok(set)
    }

    /// All tasks, by id.
    pub fn iter(&self) -> impl Iterator<Item = &Task> {
        self.tasks.values()
    }

    /// Number of tasks.
    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// The task with this id.
    pub fn get(&self, id: &str) -> Result<&Task, TaskError> {
        self.tasks
            .get(id)
            .ok_or_else(|| TaskError::Unknown(id.into()))
    }

    /// Adds the tiny families' tasks (splits `tiny` and `clue`, never part of `all`).
    pub fn with_tiny_family(mut self) -> Self {
        let tasks = (0..TINY_WORDS.len())
            .map(Task::tiny)
            .chain((0..CLUE_WORDS.len()).map(Task::clue));
        for t in tasks {
            self.tasks.insert(t.id.clone(), t);
        }
        self
    }

    /// Tasks of a split: `all` (every kernel task), `level1`, `level2`, `level3`, `tiny` or
    /// `clue` (the two recall families, told apart by their ids' prefixes).
    pub fn split(&self, name: &str) -> Vec<&Task> {
        self.tasks
            .values()
            .filter(|t| match name {
                "tiny" | "clue" => !t.is_kernel() && t.id.starts_with(&format!("{name}/")),
                "all" => t.is_kernel(),
                _ => t.is_kernel() && level_of(name) == Some(t.level),
            })
            .collect()
    }

    /// The split names that have tasks.
    pub fn splits(&self) -> Vec<String> {
        let mut levels: Vec<u8> = self
            .tasks
            .values()
            .filter(|t| t.is_kernel())
            .map(|t| t.level)
            .collect();
        levels.sort_unstable();
        levels.dedup();
        let mut out: Vec<String> = std::iter::once("all".to_string())
            .chain(levels.into_iter().map(|l| format!("level{l}")))
            .collect();
        for family in ["tiny", "clue"] {
            let prefix = format!("{family}/");
            if self
                .tasks
                .values()
                .any(|t| !t.is_kernel() && t.id.starts_with(&prefix))
            {
                out.push(family.into());
            }
        }
        out
    }

    /// Picks a task from a split, deterministically for a seed.
    pub fn sample(&self, split: &str, seed: u64) -> Result<&Task, TaskError> {
        let tasks = self.split(split);
        if tasks.is_empty() {
            return Err(TaskError::EmptySplit(split.into()));
        }
        // SplitMix64: a good spread for consecutive seeds.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Ok(tasks[(z % tasks.len() as u64) as usize])
    }
}

pub mod report;
pub mod similarity;
#[cfg(feature = "cli")]
pub mod synth;
