//! Many episodes at once (bounded), their records written as they finish, resumable: what
//! `agent-runner --tasks level1 --samples N` does.
//!
//! The output directory holds `episodes.jsonl` (one [`EpisodeRecord`] per finished episode:
//! end, reward, evaluation, turns, tokens), `results.jsonl` (one `kernelbench` result per
//! episode: `kernelbench report results.jsonl` prints the KernelBench table) and, unless told
//! not to, `trajectories/<episode_id>.json` (the server's log of each episode) and beside it
//! `trajectories/<episode_id>.messages.jsonl` (every message of the model's conversation as it
//! entered the context, written as the episode runs). Episodes that
//! failed for want of a model or server answer leave no line, so a rerun does them again;
//! finished (task, sample) pairs are skipped.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use env_api::{ErrorChain, TaskInfo};
use kernelbench::report::ResultRecord;

use crate::agent::{Agent, EpisodeRecord, TaskChoice};
use crate::openai::Usage;

/// Errors of a run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Reading or writing the output directory.
    #[error("{path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The task list.
    #[error("tasks: {0}")]
    Tasks(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RunError + '_ {
    move |source| RunError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One episode to run.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// The task's id (for a user's task, the id the server will give it).
    pub task_id: String,
    /// The task.
    pub task: TaskChoice,
    /// Which sample of the task (0-based).
    pub sample: u32,
}

/// The tasks a `--tasks` value names: a split (`all`, `level1`, `tiny`...) or ids separated
/// by commas.
pub fn select_tasks(listed: &[TaskInfo], spec: &str) -> Result<Vec<TaskInfo>, RunError> {
    let level = |name: &str| {
        name.strip_prefix("level")
            .and_then(|l| l.parse::<u8>().ok())
    };
    let picked: Vec<TaskInfo> = match spec {
        "all" => listed.iter().filter(|t| t.level > 0).cloned().collect(),
        "tiny" => listed
            .iter()
            .filter(|t| t.id.starts_with("tiny/"))
            .cloned()
            .collect(),
        s if level(s).is_some() => listed
            .iter()
            .filter(|t| t.level == level(s).unwrap_or(0) && !t.id.starts_with("tiny/"))
            .cloned()
            .collect(),
        s => {
            let mut out = Vec::new();
            for id in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
                let t = listed
                    .iter()
                    .find(|t| t.id == id)
                    .ok_or_else(|| RunError::Tasks(format!("the server has no task {id}")))?;
                out.push(t.clone());
            }
            out
        }
    };
    if picked.is_empty() {
        return Err(RunError::Tasks(format!("no task matches {spec:?}")));
    }
    Ok(picked)
}

/// Every (task, sample) pair, task by task.
pub fn jobs_for(tasks: &[TaskInfo], samples: u32) -> Vec<Job> {
    tasks
        .iter()
        .flat_map(|t| {
            (0..samples).map(move |sample| Job {
                task_id: t.id.clone(),
                task: TaskChoice::Id(t.id.clone()),
                sample,
            })
        })
        .collect()
}

/// The kernelbench result of an episode.
pub fn result_record(rec: &EpisodeRecord) -> ResultRecord {
    let e = rec.evaluation.as_ref();
    ResultRecord {
        task: rec.task.clone(),
        level: rec.level,
        reward: rec.reward,
        correct: e.is_some_and(|e| e.correct),
        speedup_eager: e.and_then(|e| e.speedup.eager),
        speedup_compile: e.and_then(|e| e.speedup.compile),
        reason: e
            .and_then(|e| e.reason.clone())
            .or_else(|| e.is_none().then(|| format!("no_evaluation: {}", rec.end))),
    }
}

/// Records already in `dir/episodes.jsonl`.
pub fn read_records(dir: &Path) -> Result<Vec<EpisodeRecord>, RunError> {
    let path = dir.join("episodes.jsonl");
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct RunSummary {
    /// Records of this run and of earlier runs into the same directory.
    pub records: Vec<EpisodeRecord>,
    /// Episodes that ended in an error (not recorded; a rerun does them again).
    pub failed: usize,
    /// Tokens and calls of this run.
    pub usage: Usage,
}

struct Sinks {
    episodes: std::fs::File,
    results: std::fs::File,
}

/// Runs `jobs` with at most `concurrency` episodes at once, writing into `out`.
pub async fn run_jobs(
    mut agent: Agent,
    jobs: Vec<Job>,
    out: &Path,
    concurrency: usize,
    save_trajectories: bool,
) -> Result<RunSummary, RunError> {
    std::fs::create_dir_all(out).map_err(io(out))?;
    let earlier = read_records(out)?;
    let done: BTreeSet<(String, u32)> =
        earlier.iter().map(|r| (r.task.clone(), r.sample)).collect();
    let todo: Vec<Job> = jobs
        .into_iter()
        .filter(|j| !done.contains(&(j.task_id.clone(), j.sample)))
        .collect();
    if save_trajectories {
        let d = out.join("trajectories");
        std::fs::create_dir_all(&d).map_err(io(&d))?;
        agent.limits.transcripts = Some(d);
    }
    let open = |name: &str| {
        let p = out.join(name);
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p)
            .map_err(io(&p))
    };
    let sinks = Arc::new(Mutex::new(Sinks {
        episodes: open("episodes.jsonl")?,
        results: open("results.jsonl")?,
    }));
    let bar = indicatif::ProgressBar::new(todo.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} episodes {msg} [{elapsed}<{eta}]",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
    let agent = Arc::new(agent);
    let mut handles = Vec::new();
    for job in todo {
        let (agent, sem, sinks, bar, out) = (
            agent.clone(),
            sem.clone(),
            sinks.clone(),
            bar.clone(),
            out.to_path_buf(),
        );
        handles.push(tokio::spawn(async move {
            let _permit = sem.acquire_owned().await;
            let r = agent.run(&job.task, job.sample).await;
            bar.inc(1);
            match r {
                Ok(mut rec) => {
                    // A user's task: the id is the server's (the same hash as predicted).
                    rec.sample = job.sample;
                    bar.set_message(format!("{} reward {}", rec.task, rec.reward));
                    if save_trajectories {
                        match agent.env.trajectory(&rec.episode_id).await {
                            Ok(t) => {
                                let p = out
                                    .join("trajectories")
                                    .join(format!("{}.json", rec.episode_id));
                                if let Err(e) = std::fs::write(
                                    &p,
                                    serde_json::to_vec(&t).unwrap_or_default(),
                                ) {
                                    tracing::warn!(path = %p.display(), error = %e, "saving a trajectory");
                                }
                            }
                            Err(e) => {
                                tracing::warn!(episode = %rec.episode_id, error = %ErrorChain(&e), "fetching a trajectory")
                            }
                        }
                    }
                    let mut s = sinks.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = writeln!(
                        s.episodes,
                        "{}",
                        serde_json::to_string(&rec).unwrap_or_default()
                    );
                    let _ = writeln!(
                        s.results,
                        "{}",
                        serde_json::to_string(&result_record(&rec)).unwrap_or_default()
                    );
                    Some(rec)
                }
                Err(e) => {
                    tracing::warn!(task = %job.task_id, sample = job.sample, error = %ErrorChain(&e), "episode failed");
                    None
                }
            }
        }));
    }
    let mut summary = RunSummary {
        records: earlier,
        ..Default::default()
    };
    for h in handles {
        match h.await {
            Ok(Some(rec)) => {
                summary.usage.add(&rec.usage);
                summary.records.push(rec);
            }
            Ok(None) => summary.failed += 1,
            Err(e) => {
                tracing::error!(error = %e, "an episode's task failed");
                summary.failed += 1;
            }
        }
    }
    bar.finish_and_clear();
    Ok(summary)
}

/// The run's totals in a few lines: episodes by how they ended, tokens.
pub fn totals(summary: &RunSummary) -> String {
    let mut ends: std::collections::BTreeMap<String, usize> = Default::default();
    for r in &summary.records {
        *ends.entry(r.end.clone()).or_default() += 1;
    }
    let ends: Vec<String> = ends.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let u = &summary.usage;
    format!(
        "episodes: {} recorded ({}), {} failed (rerun to retry them)\ntokens this run: {} prompt, {} completion, {} model calls, {} retries\n",
        summary.records.len(),
        ends.join(", "),
        summary.failed,
        u.prompt_tokens,
        u.completion_tokens,
        u.calls,
        u.retries
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: &str, level: u8) -> TaskInfo {
        TaskInfo {
            id: id.into(),
            level,
            hash: String::new(),
        }
    }

    #[test]
    fn tasks_are_picked_by_split_or_by_id() {
        let listed = [
            info("L1/1_ReLU", 1),
            info("L1/2_Add", 1),
            info("L2/1_Fused", 2),
            info("tiny/0_apple", 0),
        ];
        let ids = |v: Vec<TaskInfo>| v.into_iter().map(|t| t.id).collect::<Vec<_>>();
        assert_eq!(
            ids(select_tasks(&listed, "level1").unwrap()),
            ["L1/1_ReLU", "L1/2_Add"]
        );
        assert_eq!(select_tasks(&listed, "all").unwrap().len(), 3);
        assert_eq!(
            ids(select_tasks(&listed, "tiny").unwrap()),
            ["tiny/0_apple"]
        );
        assert_eq!(
            ids(select_tasks(&listed, "L2/1_Fused, L1/2_Add").unwrap()),
            ["L2/1_Fused", "L1/2_Add"]
        );
        assert!(select_tasks(&listed, "L9/none").is_err());
        assert!(select_tasks(&listed, "level7").is_err());
        let jobs = jobs_for(&select_tasks(&listed, "level1").unwrap(), 2);
        assert_eq!(jobs.len(), 4);
        assert_eq!((jobs[1].task_id.as_str(), jobs[1].sample), ("L1/1_ReLU", 1));
    }
}
