//! `agent-runner optimize my_module.py`: a user's own PyTorch module made a task, N agent
//! episodes on it, and the best correct `ModelNew` written out with its speedups over eager
//! and torch.compile measured again by the server's judge, a Markdown report and a chart.

use std::path::{Component, Path, PathBuf};

use env_api::{EvaluateRequest, EvaluationResult, SolutionRef, TaskRef, TrajectoryRecord};

use crate::agent::{Agent, EpisodeRecord, TaskChoice};
use crate::run::{run_jobs, Job, RunError, RunSummary};

/// Errors of `optimize`.
#[derive(Debug, thiserror::Error)]
pub enum OptimizeError {
    /// The module file cannot be made a task.
    #[error("{0}")]
    Module(String),
    /// The module (or the task made of it) is not a valid task.
    #[error(transparent)]
    Task(#[from] kernelbench::TaskError),
    /// Running the episodes.
    #[error(transparent)]
    Run(#[from] RunError),
    /// Reading or writing files.
    #[error("{path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The server (fetching the solution, evaluating it again).
    #[error("environment")]
    Env(#[from] env_client::ClientError),
    /// A chart.
    #[error("chart")]
    Chart(#[from] charts::ChartError),
    /// No episode wrote a correct `ModelNew`; the report says what each did.
    #[error("no correct ModelNew in {episodes} episodes; see {report}")]
    NoCorrect {
        /// Episodes run.
        episodes: usize,
        /// The report.
        report: PathBuf,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> OptimizeError + '_ {
    move |source| OptimizeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Makes a task source of a user's module. A file that defines `Model`, `get_inputs` and
/// `get_init_inputs` is one already. Otherwise, as `optimizer.optimize(model, input_shape)`
/// does, `input_shapes` give `get_inputs` (random float32 tensors of those shapes),
/// `get_init_inputs` defaults to no arguments, and a module class of another name (`class`,
/// or the only `nn.Module` subclass in the file) becomes `Model` by subclassing.
pub fn task_source(
    source: &str,
    input_shapes: &[Vec<usize>],
    class: Option<&str>,
) -> Result<String, OptimizeError> {
    let defines = |name: &str| {
        source
            .lines()
            .any(|l| l.starts_with(&format!("def {name}(")))
    };
    let has_class = |name: &str| {
        source.lines().any(|l| {
            l.starts_with(&format!("class {name}(")) || l.starts_with(&format!("class {name}:"))
        })
    };
    let mut extra = String::new();
    match class {
        Some(c) if c != "Model" => {
            if !has_class(c) {
                return Err(OptimizeError::Module(format!(
                    "the module defines no class {c}"
                )));
            }
            extra.push_str(&model_alias(c));
        }
        Some(_) => {}
        None if has_class("Model") => {}
        None => {
            let modules: Vec<&str> = source
                .lines()
                .filter_map(|l| l.strip_prefix("class "))
                .filter(|l| l.contains("Module)"))
                .filter_map(|l| l.split(['(', ':']).next())
                .map(str::trim)
                .collect();
            match modules.as_slice() {
                [one] => extra.push_str(&model_alias(one)),
                [] => {
                    return Err(OptimizeError::Module(
                        "the module defines no nn.Module subclass".into(),
                    ))
                }
                many => {
                    return Err(OptimizeError::Module(format!(
                    "the module defines several nn.Module subclasses ({}); name one with --class",
                    many.join(", ")
                )))
                }
            }
        }
    }
    if !defines("get_inputs") {
        if input_shapes.is_empty() {
            return Err(OptimizeError::Module(
                "the module defines no get_inputs(); give --input-shape (such as 16,1024)".into(),
            ));
        }
        let tensors: Vec<String> = input_shapes
            .iter()
            .map(|s| {
                let dims: Vec<String> = s.iter().map(usize::to_string).collect();
                format!("torch.randn({})", dims.join(", "))
            })
            .collect();
        extra.push_str(&format!(
            "\n\ndef get_inputs():\n    return [{}]\n",
            tensors.join(", ")
        ));
    } else if !input_shapes.is_empty() {
        return Err(OptimizeError::Module(
            "the module defines get_inputs(); --input-shape would replace it: give one or the other".into(),
        ));
    }
    if !defines("get_init_inputs") {
        extra.push_str("\n\ndef get_init_inputs():\n    return []\n");
    }
    let mut out = source.to_string();
    if !extra.is_empty() {
        if !source.lines().any(|l| l.trim() == "import torch") {
            out = format!("import torch\n{out}");
        }
        out.push_str("\n\n# Added by agent-runner optimize.");
        out.push_str(&extra);
    }
    kernelbench::validate_source("module", &out)?;
    Ok(out)
}

/// `source` with the aten operators `ops` (such as `mm`, `addmm`) allowed to `ModelNew`: an
/// `ALLOW_OPS` tuple the judge reads from the task, so that part of the module (an
/// `nn.Linear`) may stay PyTorch's while the rest becomes kernels. The agent sees it in
/// model.py. No operators: `source` as it is.
pub fn with_allowed_ops(source: String, ops: &[String]) -> Result<String, OptimizeError> {
    if ops.is_empty() {
        return Ok(source);
    }
    if source.lines().any(|l| l.starts_with("ALLOW_OPS")) {
        return Err(OptimizeError::Module(
            "the module sets ALLOW_OPS itself; --allow-ops would replace it: give one or the other"
                .into(),
        ));
    }
    let mut names = Vec::new();
    for op in ops.iter().map(|o| o.trim()).filter(|o| !o.is_empty()) {
        let name = op.strip_prefix("aten::").unwrap_or(op);
        let ok = name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            && name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if !ok {
            return Err(OptimizeError::Module(format!(
                "--allow-ops: {op:?} is not an aten operator name (such as mm, addmm, convolution)"
            )));
        }
        if !names.contains(&name) {
            names.push(name);
        }
    }
    let quoted: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
    Ok(format!(
        "{source}\n\n# Added by agent-runner optimize: PyTorch operators ModelNew may still call.\nALLOW_OPS = ({},)\n",
        quoted.join(", ")
    ))
}

/// `Model` as a subclass of the user's class: the same constructor and forward, under the
/// name tasks use.
fn model_alias(class: &str) -> String {
    format!("\n\nclass Model({class}):\n    pass\n")
}

/// What `optimize` produced.
#[derive(Debug, Clone)]
pub struct Optimized {
    /// The best episode.
    pub best: EpisodeRecord,
    /// Its solution evaluated again.
    pub verified: EvaluationResult,
    /// The report.
    pub report: PathBuf,
}

/// Runs `episodes` episodes on `source` and writes the best correct solution, the report and
/// the chart into `out`.
pub async fn optimize(
    agent: Agent,
    source: &str,
    module_name: &str,
    episodes: u32,
    concurrency: usize,
    out: &Path,
) -> Result<Optimized, OptimizeError> {
    let task = kernelbench::Task::inline(source)?;
    std::fs::create_dir_all(out).map_err(io(out))?;
    std::fs::write(out.join("task.py"), source).map_err(io(out))?;
    let jobs: Vec<Job> = (0..episodes)
        .map(|sample| Job {
            task_id: task.id.clone(),
            task: TaskChoice::Source(source.to_string()),
            sample,
        })
        .collect();
    let env = agent.env.clone();
    let summary = run_jobs(agent, jobs, &out.join("episodes"), concurrency, true).await?;
    write_outcome(&env, source, module_name, &summary, out).await
}

/// Picks the best correct episode of `summary` on `source` (fastest over eager), fetches its
/// files from its trajectory log, has the server evaluate them again, and writes
/// `model_new.py` (with its kernels), `report.md` and `speedup.png` into `out`. Without a
/// correct episode, writes the report and the chart and says so.
pub async fn write_outcome(
    env: &env_client::EnvClient,
    source: &str,
    module_name: &str,
    summary: &RunSummary,
    out: &Path,
) -> Result<Optimized, OptimizeError> {
    let task = kernelbench::Task::inline(source)?;
    std::fs::create_dir_all(out).map_err(io(out))?;
    let records: Vec<&EpisodeRecord> = summary
        .records
        .iter()
        .filter(|r| r.task == task.id)
        .collect();
    let best = records
        .iter()
        .filter(|r| r.evaluation.as_ref().is_some_and(|e| e.correct))
        .max_by(|a, b| speed(a).total_cmp(&speed(b)))
        .copied()
        .cloned();
    let report = out.join("report.md");
    let chart = out.join("speedup.png");
    let Some(best) = best else {
        let md = report_markdown(module_name, &task.id, &records, None, summary);
        std::fs::write(&report, md).map_err(io(&report))?;
        episodes_chart(&records).render(720, 360).save_png(&chart)?;
        return Err(OptimizeError::NoCorrect {
            episodes: records.len(),
            report,
        });
    };
    let files = final_files(env, &best.episode_id).await?;
    write_solution(out, &files)?;
    let verified = env
        .evaluate(&EvaluateRequest {
            task: TaskRef::Source {
                source: source.to_string(),
            },
            solution: SolutionRef::Files { files },
            options: None,
        })
        .await?;
    let md = report_markdown(
        module_name,
        &task.id,
        &records,
        Some((&best, &verified)),
        summary,
    );
    std::fs::write(&report, md).map_err(io(&report))?;
    let panels = [
        times_chart(&verified).render(480, 320),
        episodes_chart(&records).render(480, 320),
    ];
    charts::grid(&panels, 2).save_png(&chart)?;
    Ok(Optimized {
        best,
        verified,
        report,
    })
}

fn correct_speed(r: &EpisodeRecord) -> f64 {
    if r.evaluation.as_ref().is_some_and(|e| e.correct) {
        speed(r)
    } else {
        0.0
    }
}

fn speed(r: &EpisodeRecord) -> f64 {
    r.evaluation
        .as_ref()
        .and_then(|e| e.speedup.eager)
        .unwrap_or(0.0)
}

/// The files judged at the end of an episode, from its trajectory log's `final` record.
async fn final_files(
    env: &env_client::EnvClient,
    episode: &str,
) -> Result<std::collections::BTreeMap<String, String>, OptimizeError> {
    let t = env.trajectory(episode).await?;
    let files = t
        .records
        .into_iter()
        .rev()
        .find_map(|r| match r {
            TrajectoryRecord::Final { body, .. } => Some(body.files),
            _ => None,
        })
        .unwrap_or_default();
    Ok(files)
}

/// Writes the solution's files under `out`, refusing any path that would leave it.
fn write_solution(
    out: &Path,
    files: &std::collections::BTreeMap<String, String>,
) -> Result<(), OptimizeError> {
    for (rel, text) in files {
        let p = Path::new(rel);
        if p.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(OptimizeError::Module(format!(
                "the solution names a path outside its directory: {rel}"
            )));
        }
        let dest = out.join(p);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        std::fs::write(&dest, text).map_err(io(&dest))?;
    }
    Ok(())
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.3}"))
}

fn x(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.2}x"))
}

/// The Markdown report: the verified result of the best solution, then every episode.
pub fn report_markdown(
    module: &str,
    task_id: &str,
    records: &[&EpisodeRecord],
    best: Option<(&EpisodeRecord, &EvaluationResult)>,
    summary: &RunSummary,
) -> String {
    let mut md = format!(
        "# optimize: {module}\n\nTask `{task_id}`, {} episodes.\n\n",
        records.len()
    );
    match best {
        Some((rec, v)) => {
            md.push_str(&format!(
                "## Best: episode `{}` (sample {})\n\n`model_new.py` beside this report. Evaluated again by the server's judge:\n\n\
                 | | median time, ms | speedup of ModelNew |\n| --- | --- | --- |\n\
                 | eager | {} | {} |\n| torch.compile | {} | {} |\n| ModelNew | {} | |\n\n\
                 Correct: {}; reward {}{}.\n\n",
                rec.episode_id,
                rec.sample,
                ms(v.times_ms.eager),
                x(v.speedup.eager),
                ms(v.times_ms.compile),
                x(v.speedup.compile),
                ms(v.times_ms.candidate),
                v.correct,
                v.reward,
                v.reason
                    .as_ref()
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default()
            ));
        }
        None => md.push_str("## No correct ModelNew\n\nNo episode ended with a correct solution; the episodes below say how each ended.\n\n"),
    }
    md.push_str("## Episodes\n\n| sample | end | reward | correct | speedup over eager | over compile | turns | tokens (prompt/completion) | why not |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    let mut sorted: Vec<&&EpisodeRecord> = records.iter().collect();
    sorted.sort_by_key(|r| r.sample);
    for r in sorted {
        let e = r.evaluation.as_ref();
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {}/{} | {} |\n",
            r.sample,
            r.end,
            r.reward,
            e.is_some_and(|e| e.correct),
            x(e.and_then(|e| e.speedup.eager)),
            x(e.and_then(|e| e.speedup.compile)),
            r.turns,
            r.usage.prompt_tokens,
            r.usage.completion_tokens,
            e.and_then(|e| e.reason.as_deref())
                .map(|s| s.chars().take(80).collect::<String>().replace('|', "/"))
                .unwrap_or_default()
        ));
    }
    md.push_str(&format!(
        "\n{}\nEach episode's full log: `episodes/trajectories/<episode>.json`.\n",
        crate::run::totals(summary).replace('\n', "  \n")
    ));
    md
}

fn times_chart(v: &EvaluationResult) -> charts::BarChart {
    let mut categories = Vec::new();
    let mut values = Vec::new();
    for (name, t) in [
        ("eager", v.times_ms.eager),
        ("compile", v.times_ms.compile),
        ("ModelNew", v.times_ms.candidate),
    ] {
        if let Some(t) = t {
            categories.push(name.to_string());
            values.push(t);
        }
    }
    charts::BarChart {
        title: "median time of one call".into(),
        y_label: "ms".into(),
        categories,
        series: vec![("time".into(), values)],
    }
}

fn episodes_chart(records: &[&EpisodeRecord]) -> charts::BarChart {
    let mut sorted: Vec<&&EpisodeRecord> = records.iter().collect();
    sorted.sort_by_key(|r| r.sample);
    charts::BarChart {
        title: "speedup over eager per episode".into(),
        y_label: "x eager (0: not correct)".into(),
        categories: sorted.iter().map(|r| format!("#{}", r.sample)).collect(),
        series: vec![
            ("eager".into(), vec![1.0; sorted.len()]),
            (
                "ModelNew".into(),
                sorted.iter().map(|r| correct_speed(r)).collect(),
            ),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PLAIN: &str = "import torch\nimport torch.nn as nn\n\nclass Gelu(nn.Module):\n    def forward(self, x):\n        return torch.nn.functional.gelu(x)\n";

    #[test]
    fn a_module_and_an_input_shape_become_a_task() {
        let s = task_source(PLAIN, &[vec![16, 1024]], None).unwrap();
        assert!(s.contains("class Model(Gelu):"), "{s}");
        assert!(s.contains("return [torch.randn(16, 1024)]"), "{s}");
        assert!(s.contains("def get_init_inputs():"), "{s}");
        kernelbench::Task::inline(&s).unwrap();
        // A KernelBench-style file is taken as it is.
        let kb = s.clone();
        assert_eq!(task_source(&kb, &[], None).unwrap(), kb);
    }

    #[test]
    fn what_cannot_be_a_task_is_said() {
        assert!(task_source(PLAIN, &[], None)
            .unwrap_err()
            .to_string()
            .contains("--input-shape"));
        let two = format!("{PLAIN}\nclass Other(nn.Module):\n    pass\n");
        assert!(task_source(&two, &[vec![4]], None)
            .unwrap_err()
            .to_string()
            .contains("--class"));
        assert!(task_source(&two, &[vec![4]], Some("Other"))
            .unwrap()
            .contains("class Model(Other):"));
        assert!(task_source(PLAIN, &[vec![4]], Some("Nope")).is_err());
    }

    #[test]
    fn solution_paths_stay_inside() {
        let dir = std::env::temp_dir().join(format!("optimize-test-{}", std::process::id()));
        let ok: std::collections::BTreeMap<String, String> = [
            ("model_new.py".to_string(), "x".to_string()),
            ("kernels/a.cpp".to_string(), "y".to_string()),
        ]
        .into();
        write_solution(&dir, &ok).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("kernels/a.cpp")).unwrap(),
            "y"
        );
        let bad: std::collections::BTreeMap<String, String> =
            [("../evil.py".to_string(), "x".to_string())].into();
        assert!(write_solution(&dir, &bad).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
