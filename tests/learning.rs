//! The trainer learns, end to end: a tiny random policy, the real server over HTTP on the tiny
//! task family, the four stages through the `trainer` binary as a user runs them.
//!
//! Scripted demonstration episodes (mostly right, some wrong or wasteful) are played against
//! the server; its trajectory logs feed RFT (whose filter must drop the bad ones) and value
//! pre-training; multi-turn PPO then trains on the policy's own rollouts; the single-turn
//! warm-up runs too. The policy's mean reward is measured before and after.
//!
//! The trainer runs as an optimised binary (ML code is 40-55x slower in debug), which this test
//! does not build: `CUDA_AGENT_TRAINER_BIN` names it, as scripts/test.sh sets it after
//! `cargo build --profile learning -p trainer` (release at opt-level 1; a release build does
//! too). The server binary is the test profile's.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod server;

use std::path::{Path, PathBuf};
use std::process::Command;

use env_api::{ResetOptions, ResetRequest};
use serde_json::{json, Value};
use server::Server;

/// Tool calls per episode, for the demonstrations and the trainer alike.
const MAX_TURNS: u32 = 4;

const WORDS: [&str; 8] = [
    "red", "blue", "green", "amber", "violet", "cyan", "olive", "pearl",
];

/// The optimised trainer binary scripts/test.sh built before the tests.
fn trainer_release() -> PathBuf {
    let bin = std::env::var_os("CUDA_AGENT_TRAINER_BIN").map(PathBuf::from);
    match bin {
        Some(bin) if bin.is_file() => bin,
        _ => panic!(
            "CUDA_AGENT_TRAINER_BIN must name an optimised trainer binary (scripts/test.sh builds \
             one: cargo build --profile learning -p trainer, then target/learning/trainer); got \
             {bin:?}"
        ),
    }
}

fn run_trainer(bin: &Path, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run trainer");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "trainer {args:?} failed:\n{stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Plays `n` demonstration episodes per task; returns (kept-worthy, flawed) counts.
async fn demonstrations(c: &env_client::EnvClient) -> (usize, usize) {
    let (mut good, mut flawed) = (0, 0);
    for (i, word) in WORDS.iter().enumerate() {
        for k in 0..6 {
            let task = format!("tiny/{i}_{word}");
            // The trainer's limits, so the demonstrations' prompts are the ones it will see.
            let options = Some(ResetOptions {
                max_turns: Some(MAX_TURNS),
                time_budget_s: None,
            });
            let r = c
                .reset(&ResetRequest {
                    task: Some(task),
                    options,
                    ..Default::default()
                })
                .await
                .unwrap();
            let id = r.episode_id;
            let write = |content: &str| json!({"file_path": "answer.txt", "content": content});
            match k {
                // A wrong word: reward -1.
                4 => {
                    c.step(&id, "Write", write(WORDS[(i + 1) % WORDS.len()]))
                        .await
                        .unwrap();
                    flawed += 1;
                }
                // The same call twice: reward 1 but redundant.
                5 => {
                    c.step(&id, "Write", write(word)).await.unwrap();
                    c.step(&id, "Write", write(word)).await.unwrap();
                    flawed += 1;
                }
                _ => {
                    c.step(&id, "Write", write(word)).await.unwrap();
                    good += 1;
                }
            }
            let s = c.step(&id, "Submit", json!({})).await.unwrap();
            assert!(s.done);
        }
    }
    (good, flawed)
}

/// Adapter rank for the stages after RFT from `LEARNING_LORA_RANK=N` (0, the default: every
/// weight trained throughout). Adapters need a base that has learned something: on the random
/// tiny model the frozen tied embeddings and norms cap the logits' range (the NLL stays near
/// 5 nats at any rank), so RFT trains every weight as a pretraining stand-in, and value
/// pre-training, PPO and the warm-up then train rank-N adapters (alpha 2N) on its weights,
/// as a user would on a pretrained checkpoint.
fn lora_rank() -> usize {
    std::env::var("LEARNING_LORA_RANK")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// The stages' configuration; `lora` > 0 puts rank-`lora` adapters on `model`'s weights (the
/// file's name says which).
fn config(dir: &Path, url: &str, model: &Path, seed: u64, lora: usize) -> PathBuf {
    let lora_section = match lora {
        0 => String::new(),
        r => format!("[lora]\nrank = {r}\nalpha = {}\n", 2 * r),
    };
    let text = format!(
        r#"
[model]
path = "{model}"
random_init = {random_init}

[server]
urls = ["{url}"]
timeout_s = 120
concurrency = 16

[rollout]
split = "tiny"
batch = 32
max_turns = {max_turns}
temperature = 1.0
max_turn_tokens = 40
context = 320
single_turn_context = 160
tools_in_prompt = false
system_prompt = "You are an agent in a sandboxed workspace. Act only through tool calls, one per turn."
max_observation_tokens = 48
generation_batch = 32

[optim]
actor_lr = 3e-4
critic_lr = 3e-3
schedule = "cosine"
min_lr_ratio = 0.05
grad_clip = 1.0
micro_batch = 16

[ppo]
steps = 6
minibatch = 32
epochs = 2

[rft]
lr = 1e-2
epochs = 100
minibatch = 8

[value]
epochs = 20
minibatch = 32

{lora}
[run]
out_dir = "{out}"
checkpoint_every = 50
keep_checkpoints = 2
seed = {seed}
"#,
        model = model.display(),
        max_turns = MAX_TURNS,
        out = dir.join("runs").display(),
        lora = lora_section,
        random_init = lora == 0,
    );
    let p = dir.join(format!("train-{seed}-lora{lora}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn tiny_model(dir: &Path) -> PathBuf {
    let m = dir.join("tiny-model");
    std::fs::create_dir_all(&m).unwrap();
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("../trainer/assets/tiny-tokenizer.json");
    std::fs::copy(tok, m.join("tokenizer.json")).unwrap();
    // <|im_end|> is id 2 in the tiny vocabulary.
    let cfg = json!({
        "model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": true, "eos_token_id": 2
    });
    std::fs::write(m.join("config.json"), cfg.to_string()).unwrap();
    m
}

fn reward_of(summary: &str) -> f64 {
    let v: Value = serde_json::from_str(summary).unwrap_or_else(|e| panic!("{e}: {summary}"));
    v["reward_mean"].as_f64().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn four_stages_raise_the_reward_of_a_tiny_policy() {
    let bin = trainer_release();
    let mut dir = tempfile::tempdir().unwrap();
    // LEARNING_KEEP=1 keeps the run directory for inspection.
    if std::env::var_os("LEARNING_KEEP").is_some() {
        dir.disable_cleanup(true);
        eprintln!("run directory kept: {}", dir.path().display());
    }
    // Room for fewer episodes than a PPO step opens (32), on any host: the rollout must wait
    // for room as the batch's first episodes end, not drop the rest.
    let server = Server::start(
        &dir.path().join("data"),
        &["--skip-compile", "--max-episodes", "12"],
    );
    let (good, flawed) = demonstrations(&server.client()).await;
    let model = tiny_model(dir.path());
    let seed = std::env::var("LEARNING_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0u64);
    let cfg_path = config(dir.path(), &server.url, &model, seed, 0);
    let cfg = cfg_path.to_str().unwrap();
    let runs = dir.path().join("runs");
    let traj = server.data_dir.join("trajectories");
    let traj = traj.to_str().unwrap();
    let bin2 = bin.clone();
    let run = move |args: Vec<String>| {
        let bin = bin2.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                run_trainer(&bin, &args.iter().map(String::as_str).collect::<Vec<_>>())
            })
            .await
            .unwrap()
        }
    };
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();

    let before = reward_of(&run(s(&["evaluate", "--config", cfg, "--episodes", "32"])).await);

    run(s(&["rft", "--config", cfg, "--trajectories", traj])).await;
    let filter: Value =
        serde_json::from_str(&std::fs::read_to_string(runs.join("rft/filter.json")).unwrap())
            .unwrap();
    assert_eq!(filter["kept"].as_u64().unwrap() as usize, good, "{filter}");
    assert_eq!(
        filter["rejected"]["low_reward"].as_u64().unwrap()
            + filter["rejected"]["repeated_call"].as_u64().unwrap(),
        flawed as u64,
        "{filter}"
    );
    let rft_final = runs.join("rft/final");
    let after_rft = reward_of(
        &run(s(&[
            "evaluate",
            "--config",
            cfg,
            "--episodes",
            "32",
            "--init",
            rft_final.to_str().unwrap(),
        ]))
        .await,
    );

    // With adapters, the later stages sit on RFT's exported weights (its `final/hf`).
    let rank = lora_rank();
    let later_path = match rank {
        0 => cfg_path.clone(),
        r => config(dir.path(), &server.url, &rft_final.join("hf"), seed, r),
    };
    let cfg = later_path.to_str().unwrap();
    let mut value_args = s(&["value-pretrain", "--config", cfg, "--trajectories", traj]);
    if rank == 0 {
        value_args.extend(s(&["--init", rft_final.to_str().unwrap()]));
    }
    run(value_args).await;
    let value_final = runs.join("value/final");
    run(s(&[
        "ppo",
        "--config",
        cfg,
        "--init",
        value_final.to_str().unwrap(),
    ]))
    .await;
    let ppo_final = runs.join("ppo/final");
    let after = reward_of(
        &run(s(&[
            "evaluate",
            "--config",
            cfg,
            "--episodes",
            "32",
            "--init",
            ppo_final.to_str().unwrap(),
        ]))
        .await,
    );

    // The warm-up stage runs on the same family (single-turn answers, /v1/evaluate rewards).
    run(s(&[
        "warmup",
        "--config",
        cfg,
        "--steps",
        "1",
        "--init",
        ppo_final.to_str().unwrap(),
    ]))
    .await;

    // The warm-up's 32 resets, too, each closed as soon as it opened, all found room.
    let warmup: Vec<Value> = std::fs::read_to_string(runs.join("warmup/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(warmup.iter().all(|l| l["failed"] == 0), "{warmup:?}");

    let ppo_metrics = runs.join("ppo/metrics.jsonl");
    let lines: Vec<Value> = std::fs::read_to_string(&ppo_metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    // Every episode of every step ran: those the server had no room for at first waited for
    // it (before, 17 of each step's 32 resets failed with host_busy and were left out).
    for l in &lines {
        assert_eq!(l["failed"], 0, "episodes failed: {l}");
        assert_eq!(l["trained_episodes"], 32, "{l}");
    }
    for key in [
        "reward_mean",
        "entropy",
        "approx_kl",
        "clip_fraction",
        "value_loss",
        "turns_per_episode",
        "valid_call_share",
        "episodes_per_min",
        "prefilled_tokens",
        "reused_tokens",
    ] {
        assert!(
            lines.iter().all(|l| l[key].is_number()),
            "{key} missing in {}",
            lines[0]
        );
    }
    // Episodes of more than one turn went on from their kept caches instead of prefilling
    // their whole history every turn.
    for l in lines
        .iter()
        .filter(|l| l["turns_per_episode"].as_f64().unwrap_or(0.0) > 1.0)
    {
        assert!(l["reused_tokens"].as_u64().unwrap_or(0) > 0, "{l}");
    }
    assert!(
        runs.join("ppo/step-000006/actor_optim.mpk").exists()
            && runs.join("ppo/step-000006/state.json").exists()
    );
    let rft_steps = std::fs::read_dir(runs.join("rft"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("step-")
        })
        .count();
    assert_eq!(
        rft_steps, 2,
        "keep_checkpoints bounds what a stage leaves on disk"
    );
    let png = runs.join("ppo/metrics.png");
    run(s(&[
        "plot",
        ppo_metrics.to_str().unwrap(),
        "--out",
        png.to_str().unwrap(),
    ]))
    .await;
    assert!(std::fs::metadata(&png).unwrap().len() > 1000);

    eprintln!("seed {seed}: mean reward random {before:.3}, after RFT {after_rft:.3}, after PPO {after:.3}");
    // Sampled at temperature 1. A random policy never writes the word (-1 everywhere). RFT
    // on 32 demonstrations fits them (the NLL falls tenfold) and the policy then writes the
    // right word in some episodes; how many depends on when the tiny model learns to copy the
    // word out of its prompt (measured: mean reward -0.81 to 1.0 over data orders and seeds),
    // so the bar is a few solved episodes, not a rate. PPO must keep them.
    let nll: Vec<f64> = std::fs::read_to_string(runs.join("rft/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["nll"]
                .as_f64()
                .unwrap()
        })
        .collect();
    let (first, last) = (nll[0], nll[nll.len() - 1]);
    assert!(
        last < first / 10.0,
        "RFT fits its demonstrations: NLL {first} -> {last}"
    );
    assert!(
        before < -0.5,
        "a random policy does not solve the tiny tasks (got {before})"
    );
    assert!(
        after_rft > before + 0.1,
        "mean reward after RFT is {after_rft} (random {before})"
    );
    assert!(
        after > before + 0.1,
        "mean reward after the four stages is {after} (random {before}, after RFT {after_rft})"
    );
}

/// The training-dynamics benchmark (not a CI test: `cargo test -p e2e-tests --test learning
/// -- --ignored training_dynamics`, or scripts/bench_dynamics.sh). Long PPO runs of the
/// recipe and of its two ablations on the tiny split, per seed:
///
/// - `recipe`: RFT, value pre-training on RFT's policy, then PPO;
/// - `no_rft`: value pre-training and PPO from the random policy;
/// - `no_value`: RFT, then PPO with a critic that starts as a copy of the policy, untrained.
///
/// `DYNAMICS_OUT` (required) receives each run's `ppo/metrics.jsonl` as
/// `<variant>-seed<k>.jsonl` and a `summary.jsonl` line per run (mean reward before and after
/// PPO); `DYNAMICS_STEPS` (150), `DYNAMICS_SEEDS` ("0 1 2") and `DYNAMICS_VARIANTS` choose the
/// runs, `DYNAMICS_FAMILY` the task family: `tiny` (the default; RFT alone solves it) or
/// `clue` (the word is in the workspace's clue.txt, and the demonstrations cover half the
/// tasks: see [`clue_demonstrations`]). The recipe's claims are read off the curves, so
/// nothing here asserts them.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a benchmark of many minutes: scripts/bench_dynamics.sh"]
async fn training_dynamics() {
    let out = PathBuf::from(std::env::var("DYNAMICS_OUT").expect("DYNAMICS_OUT: where to write"));
    std::fs::create_dir_all(&out).unwrap();
    let var = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let steps = var("DYNAMICS_STEPS", "150");
    let seeds = var("DYNAMICS_SEEDS", "0 1 2");
    let variants = var("DYNAMICS_VARIANTS", "recipe no_rft no_value");
    let family = var("DYNAMICS_FAMILY", "tiny");
    let bin = trainer_release();
    let dir = tempfile::tempdir().unwrap();
    // Room for a whole batch of episodes at once: each reserves its 1 GiB volume quota in the
    // admission budget (tmpfs holds only what is written, a few bytes here), and with the
    // default budget of a small host half the batch's resets were refused (host_busy) and
    // PPO trained on the other half.
    let server = Server::start(
        &dir.path().join("data"),
        &[
            "--skip-compile",
            "--volume-memory-bytes",
            &(40u64 << 30).to_string(),
        ],
    );
    match family.as_str() {
        "tiny" => drop(demonstrations(&server.client()).await),
        "clue" => clue_demonstrations(&server.client()).await,
        other => panic!("DYNAMICS_FAMILY is tiny or clue, not {other}"),
    }
    let model = tiny_model(dir.path());
    // The demonstrations alone: every later run's episodes are logged beside them, and RFT
    // and value pre-training must see the same data in every run.
    let demos = dir.path().join("demonstrations");
    copy_dir(&server.data_dir.join("trajectories"), &demos);
    let traj = demos.to_str().unwrap().to_string();
    let mut summary = String::new();
    for seed in seeds.split_whitespace() {
        for variant in variants.split_whitespace() {
            let name = format!("{variant}-seed{seed}");
            let run_dir = dir.path().join(&name);
            std::fs::create_dir_all(&run_dir).unwrap();
            let cfg = config(&run_dir, &server.url, &model, seed.parse().unwrap(), 0);
            let text = std::fs::read_to_string(&cfg).unwrap();
            let text = text.replace("split = \"tiny\"", &format!("split = \"{family}\""));
            std::fs::write(&cfg, text).unwrap();
            let cfg = cfg.to_str().unwrap().to_string();
            let runs = run_dir.join("runs");
            let final_of = |stage: &str| runs.join(stage).join("final").display().to_string();
            let bin = bin.clone();
            let go = move |args: Vec<String>| {
                let bin = bin.clone();
                tokio::task::spawn_blocking(move || {
                    run_trainer(&bin, &args.iter().map(String::as_str).collect::<Vec<_>>())
                })
            };
            let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
            let c = cfg.as_str();
            let before = reward_of(
                &go(s(&["evaluate", "--config", c, "--episodes", "32"]))
                    .await
                    .unwrap(),
            );
            if variant != "no_rft" {
                go(s(&["rft", "--config", c, "--trajectories", &traj]))
                    .await
                    .unwrap();
            }
            let mut ppo_args = s(&["ppo", "--config", c, "--steps", &steps]);
            if variant != "no_value" {
                let mut value = s(&["value-pretrain", "--config", c, "--trajectories", &traj]);
                if variant != "no_rft" {
                    value.extend(s(&["--init", &final_of("rft")]));
                }
                go(value).await.unwrap();
                ppo_args.extend(s(&["--init", &final_of("value")]));
            } else {
                ppo_args.extend(s(&["--init", &final_of("rft")]));
            }
            go(ppo_args).await.unwrap();
            let after = reward_of(
                &go(s(&[
                    "evaluate",
                    "--config",
                    c,
                    "--episodes",
                    "32",
                    "--init",
                    &final_of("ppo"),
                ]))
                .await
                .unwrap(),
            );
            std::fs::copy(
                runs.join("ppo/metrics.jsonl"),
                out.join(format!("{name}.jsonl")),
            )
            .unwrap();
            let line = json!({"run": name, "variant": variant, "seed": seed, "before": before, "after_ppo": after});
            eprintln!("{line}");
            summary.push_str(&format!("{line}\n"));
            std::fs::write(out.join("summary.jsonl"), &summary).unwrap();
        }
    }
}

/// Demonstrations of the `clue` family, on its first half only (tasks `clue/0` to `clue/7`,
/// six episodes each as in [`demonstrations`]: Read clue.txt, Write the word, Submit; one with
/// a wrong word, one reading twice). Each prompt is the same but for the id, so a policy that
/// memorises id -> word solves the demonstrated half alone; the other half needs the word
/// copied from the Read output, which is what PPO has to make reliable.
async fn clue_demonstrations(c: &env_client::EnvClient) {
    // The clue family's first eight words are these (kernelbench::CLUE_WORDS).
    for (i, word) in WORDS.iter().enumerate() {
        for k in 0..6 {
            let options = Some(ResetOptions {
                max_turns: Some(MAX_TURNS),
                time_budget_s: None,
            });
            let r = c
                .reset(&ResetRequest {
                    task: Some(format!("clue/{i}")),
                    options,
                    ..Default::default()
                })
                .await
                .unwrap();
            let id = r.episode_id;
            let read = json!({"file_path": "clue.txt"});
            c.step(&id, "Read", read.clone()).await.unwrap();
            if k == 5 {
                c.step(&id, "Read", read).await.unwrap();
            }
            let answer = match k {
                4 => WORDS[(i + 1) % WORDS.len()],
                _ => word,
            };
            c.step(
                &id,
                "Write",
                json!({"file_path": "answer.txt", "content": answer}),
            )
            .await
            .unwrap();
            let s = c.step(&id, "Submit", json!({})).await.unwrap();
            assert!(s.done);
        }
    }
}

/// Copies the files of `from` (and its subdirectories) into `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}
