//! Metrics records are written and read back as types; the lines keep the flat JSON shape
//! that scripts and the plots read; a resume drops the lines of steps after the checkpoint.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use serde_json::Value;
use trainer::metrics::{
    read_metrics, BatchSummary, MetricsLog, MetricsRecord, PpoRecord, PpoUpdate, RftRecord,
    Throughput, TimeSplit,
};
use trainer::plot::{plot_metrics, plot_runs};

fn ppo_record(step: usize, entropy: f64) -> MetricsRecord {
    MetricsRecord::Ppo(PpoRecord {
        step,
        batch: BatchSummary {
            episodes: 8,
            failed: 1,
            reward_mean: 0.25 * step as f64,
            reward_std: 0.5,
            reward_hist: BTreeMap::from([("-1".into(), 3), ("1".into(), 4)]),
            outcomes: BTreeMap::from([("Submitted".into(), 7), ("Failed".into(), 1)]),
            turns_per_episode: 2.5,
            tokens_per_episode: 120.0,
            policy_tokens_per_episode: 40.0,
            valid_call_share: 0.75,
        },
        update: PpoUpdate {
            trained_episodes: 7,
            policy_loss: Some(-0.01),
            value_loss: Some(0.3),
            entropy: Some(entropy),
            approx_kl: Some(0.002),
            ref_kl: None,
            clip_fraction: Some(0.1),
            explained_variance: None,
            grad_norm_actor: Some(1.5),
            grad_norm_critic: Some(2.0),
            lr_actor: Some(3e-6),
            lr_critic: Some(6e-6),
            sampling_logprob_mismatch: Some(1e-4),
        },
        rates: Throughput {
            episodes_per_min: 12.0,
            tokens_per_min: 1440.0,
            policy_tokens_per_min: 480.0,
            prefilled_tokens: 300,
            reused_tokens: 900,
            lost_episodes: 1,
            time_s: TimeSplit {
                generate: 20.0,
                env: 10.0,
                env_requests: 25.0,
                rollout: 31.0,
                update: 9.0,
                total: 40.0,
            },
        },
        warnings: vec![],
    })
}

#[test]
fn records_round_trip_as_types_in_the_flat_shape() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ppo/metrics.jsonl");
    let mut log = MetricsLog::open(&path, None).unwrap();
    let written = vec![
        ppo_record(1, 1.2),
        ppo_record(2, f64::NAN),
        MetricsRecord::Rft(RftRecord {
            step: 3,
            nll: Some(2.5),
            tokens: 300,
            episodes: 4,
            lr: 1e-5,
            grad_norm: Some(0.5),
        }),
    ];
    for r in &written {
        log.write(r).unwrap();
    }
    let read = read_metrics(&path).unwrap();
    assert_eq!(read[0], written[0]);
    assert_eq!(read[2], written[2]);
    // A value that is not a number is written as null and comes back as absent.
    let entropy = |r: &MetricsRecord| r.ppo().unwrap().update.entropy;
    assert_eq!(entropy(&read[1]), None);

    let text = std::fs::read_to_string(&path).unwrap();
    let first: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(first["stage"], "ppo");
    assert_eq!(first["step"], 1);
    assert_eq!(first["reward_mean"], 0.25);
    assert_eq!(first["entropy"], 1.2);
    assert_eq!(first["time_s"]["generate"], 20.0);
    assert_eq!(first["reward_hist"]["1"], 4);
    assert!(first.get("ref_kl").is_none(), "absent, not null: {first}");

    let png = dir.path().join("m.png");
    plot_metrics(&path, &png).unwrap();
    assert!(std::fs::metadata(&png).unwrap().len() > 1000);

    // Resuming from step 1 drops what steps 2 and 3 wrote.
    let log = MetricsLog::open(&path, Some(1)).unwrap();
    assert_eq!(read_metrics(log.path()).unwrap(), written[..1]);
}

/// Several runs on one figure: each panel holds a curve per run that has the metric, so the
/// figure of two runs is not the figure of one; a set of runs with no known metric is an
/// error naming the files.
#[test]
fn runs_are_drawn_together_one_curve_per_run() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, records: &[MetricsRecord]| {
        let path = dir.path().join(name).join("metrics.jsonl");
        let mut log = MetricsLog::open(&path, None).unwrap();
        for r in records {
            log.write(r).unwrap();
        }
        path
    };
    let full = write("full", &[ppo_record(1, 1.2), ppo_record(2, 1.1)]);
    let lora = write("lora", &[ppo_record(1, 0.9), ppo_record(2, 0.7)]);
    let one = dir.path().join("one.png");
    let both = dir.path().join("both.png");
    plot_runs(&[("full".into(), full.as_path())], &one).unwrap();
    plot_runs(
        &[
            ("full".into(), full.as_path()),
            ("lora".into(), lora.as_path()),
        ],
        &both,
    )
    .unwrap();
    let (a, b) = (std::fs::read(&one).unwrap(), std::fs::read(&both).unwrap());
    assert!(a.len() > 1000 && b.len() > 1000);
    assert_ne!(a, b, "the second run's curves are drawn");

    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let err = plot_runs(
        &[("none".into(), empty.as_path())],
        &dir.path().join("x.png"),
    )
    .unwrap_err();
    let err = env_api::error_chain(&err);
    assert!(err.contains("empty.jsonl"), "{err}");
}
