//! Checkpoints survive interruptions: a save that fails midway leaves the previous checkpoint
//! as `latest` and loadable, and a damaged `latest` pointer is an error, never a fresh start.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use burn::backend::{Autodiff, NdArray};
use serde_json::json;
use trainer::checkpoint::{latest, resolve, save, CheckpointFiles, StageState};
use trainer::config::TrainConfig;
use trainer::model::{CausalLm, ModelConfig};
use trainer::stage::{Learner, StageOptions};
use trainer::TrainError;

type B = NdArray<f32>;

fn tiny_model(dir: &Path) -> (ModelConfig, std::path::PathBuf) {
    let m = dir.join("model");
    std::fs::create_dir_all(&m).unwrap();
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-tokenizer.json"),
        m.join("tokenizer.json"),
    )
    .unwrap();
    let cfg = json!({"model_type": "qwen2", "vocab_size": 512, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 64, "tie_word_embeddings": true,
        "eos_token_id": 2});
    std::fs::write(m.join("config.json"), cfg.to_string()).unwrap();
    (ModelConfig::from_json(&cfg.to_string()).unwrap(), m)
}

fn state(step: usize) -> StageState {
    StageState {
        stage: "ppo".into(),
        step,
        total_steps: 10,
        seed: 0,
    }
}

#[test]
fn an_interrupted_save_leaves_the_previous_checkpoint_loadable() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, _) = tiny_model(dir.path());
    let device = Default::default();
    let lm = CausalLm::<B>::random(&cfg, &device);
    let stage = dir.path().join("ppo");
    std::fs::create_dir_all(&stage).unwrap();
    let first = save(&stage, &state(1), |f| Ok(lm.save_record(&f.policy())?)).unwrap();

    // The next save dies after writing part of its files.
    let failed = save(&stage, &state(2), |f| {
        std::fs::write(f.policy(), b"half a record").unwrap();
        Err(TrainError::Data("killed mid-write".into()))
    });
    assert!(failed.is_err());
    let files = latest(&stage).unwrap().expect("a checkpoint");
    assert_eq!(files.dir, first);
    assert_eq!(files.read_state().unwrap().step, 1);
    let restored = CausalLm::<B>::random(&cfg, &device)
        .load_record(&files.policy(), &device)
        .unwrap();
    let weights = |m: &CausalLm<B>| m.backbone.embed_tokens.val().into_data();
    assert_eq!(weights(&restored), weights(&lm));
    assert!(!stage.join("step-000002").exists());

    // A complete step directory that `latest` never came to name (a crash between the
    // rename and the pointer's update) is not taken either.
    save(&stage, &state(3), |f| Ok(lm.save_record(&f.policy())?)).unwrap();
    std::fs::write(stage.join("latest"), "step-000001").unwrap();
    assert_eq!(latest(&stage).unwrap().unwrap().dir, first);

    // The leftovers of the failed save do not stand in the way of the next one.
    let second = save(&stage, &state(2), |f| Ok(lm.save_record(&f.policy())?)).unwrap();
    assert_eq!(latest(&stage).unwrap().unwrap().dir, second);
    assert!(!stage.join(".tmp-step-000002").exists());
}

#[test]
fn a_damaged_latest_pointer_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let stage = dir.path();
    assert!(
        latest(stage).unwrap().is_none(),
        "no pointer: a fresh stage"
    );
    save(stage, &state(4), |f| {
        std::fs::write(f.policy(), b"weights").map_err(|e| TrainError::Io(f.policy(), e))
    })
    .unwrap();
    let pointer = stage.join("latest");
    for (text, says) in [
        ("", "empty"),
        ("  \n", "empty"),
        ("step-0000", "holds no state.json"),
        ("../elsewhere", "not a step-N directory name"),
        ("step-000009", "holds no state.json"),
    ] {
        std::fs::write(&pointer, text).unwrap();
        let err = latest(stage).unwrap_err();
        assert!(
            matches!(&err, TrainError::Checkpoint { path, reason } if path == &pointer && reason.contains(says)),
            "{text:?}: {err}"
        );
        assert!(resolve(&pointer).is_err());
    }
    // A step directory without its state.json is not a checkpoint.
    std::fs::write(&pointer, "step-000004").unwrap();
    std::fs::remove_file(CheckpointFiles::new(stage.join("step-000004")).state()).unwrap();
    assert!(latest(stage).is_err());
}

#[test]
fn resuming_from_a_truncated_pointer_fails_instead_of_starting_over() {
    let dir = tempfile::tempdir().unwrap();
    let (_, model) = tiny_model(dir.path());
    let mut cfg = TrainConfig::default();
    cfg.model.path = Some(model);
    cfg.run.out_dir = dir.path().join("runs");
    let stage = cfg.run.out_dir.join("ppo");
    std::fs::create_dir_all(&stage).unwrap();
    std::fs::write(stage.join("latest"), "").unwrap();
    let opts = StageOptions {
        resume: true,
        ..Default::default()
    };
    let err = Learner::<Autodiff<B>>::new(cfg, "ppo", &opts, 32, Default::default())
        .err()
        .expect("an error");
    assert!(env_api::error_chain(&err).contains("empty"), "{err}");
}
