//! `trainer plot`: a stage's metrics.jsonl drawn as a grid of curves (reward, losses,
//! entropy, KL, clip fraction, explained variance, episode lengths, throughput), whichever
//! the file holds; given several runs, each panel draws one curve per run, so that runs
//! (seeds, ablations, adapters against full training) compare on one figure.

use std::path::Path;

use charts::{grid, LineChart, Series};

use crate::error::TrainError;
use crate::metrics::{read_metrics, MetricsRecord};

/// A metric of a record, when the record has it.
type Pick = fn(&MetricsRecord) -> Option<f64>;

/// Metrics drawn, in panel order: (title, series name, the metric).
const PANELS: [(&str, &str, Pick); 14] = [
    ("reward mean", "reward_mean", |r| {
        r.ppo().map(|p| p.batch.reward_mean)
    }),
    ("nll", "nll", |r| match r {
        MetricsRecord::Rft(r) => r.nll,
        _ => None,
    }),
    ("policy loss", "policy_loss", |r| {
        r.ppo().and_then(|p| p.update.policy_loss)
    }),
    ("value loss", "value_loss", |r| match r {
        MetricsRecord::Value(v) => v.value_loss,
        _ => r.ppo().and_then(|p| p.update.value_loss),
    }),
    ("entropy", "entropy", |r| {
        r.ppo().and_then(|p| p.update.entropy)
    }),
    ("kl to rollout", "approx_kl", |r| {
        r.ppo().and_then(|p| p.update.approx_kl)
    }),
    ("kl to reference", "ref_kl", |r| {
        r.ppo().and_then(|p| p.update.ref_kl)
    }),
    ("clip fraction", "clip_fraction", |r| {
        r.ppo().and_then(|p| p.update.clip_fraction)
    }),
    ("explained variance", "explained_variance", |r| match r {
        MetricsRecord::Value(v) => v.explained_variance,
        _ => r.ppo().and_then(|p| p.update.explained_variance),
    }),
    ("turns per episode", "turns_per_episode", |r| {
        r.ppo().map(|p| p.batch.turns_per_episode)
    }),
    ("tokens per episode", "tokens_per_episode", |r| {
        r.ppo().map(|p| p.batch.tokens_per_episode)
    }),
    ("valid call share", "valid_call_share", |r| {
        r.ppo().map(|p| p.batch.valid_call_share)
    }),
    ("episodes per min", "episodes_per_min", |r| {
        r.ppo().map(|p| p.rates.episodes_per_min)
    }),
    ("grad norm", "grad_norm", |r| match r {
        MetricsRecord::Rft(r) => r.grad_norm.map(f64::from),
        MetricsRecord::Value(v) => v.grad_norm.map(f64::from),
        _ => r.ppo().and_then(|p| p.update.grad_norm_actor),
    }),
];

/// Draws `metrics` (JSON Lines) to `out` (PNG); fails when no known metric is present.
pub fn plot_metrics(metrics: &Path, out: &Path) -> Result<(), TrainError> {
    plot_runs(&[(String::new(), metrics)], out)
}

/// Draws several runs' metrics to `out` (PNG), one curve per run in each panel, named by its
/// label (a lone unlabelled run's curves are named by their metric). Fails when no run holds
/// a known metric.
pub fn plot_runs(runs: &[(String, &Path)], out: &Path) -> Result<(), TrainError> {
    let records = runs
        .iter()
        .map(|(label, path)| Ok((label.as_str(), read_metrics(path)?)))
        .collect::<Result<Vec<_>, TrainError>>()?;
    let panels: Vec<_> = PANELS
        .iter()
        .filter_map(|(title, name, pick)| {
            let series: Vec<Series> = records
                .iter()
                .filter_map(|(label, recs)| {
                    let points: Vec<(f64, f64)> = recs
                        .iter()
                        .filter_map(|r| Some((r.step() as f64, pick(r).filter(|v| v.is_finite())?)))
                        .collect();
                    (!points.is_empty()).then(|| Series {
                        name: match label.is_empty() {
                            true => (*name).into(),
                            false => (*label).into(),
                        },
                        points,
                    })
                })
                .collect();
            (!series.is_empty()).then(|| {
                LineChart {
                    title: (*title).into(),
                    x_label: "step".into(),
                    series,
                }
                .render(360, 220)
            })
        })
        .collect();
    if panels.is_empty() {
        let names: Vec<String> = runs.iter().map(|(_, p)| p.display().to_string()).collect();
        return Err(TrainError::Data(format!(
            "{} holds no metric to plot",
            names.join(", ")
        )));
    }
    Ok(grid(&panels, 3).save_png(out)?)
}
