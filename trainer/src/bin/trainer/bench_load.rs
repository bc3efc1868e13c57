//! `bench-load`: peak host memory of loading a checkpoint, the safetensors memory-mapped and
//! converted one tensor at a time against every file read whole and widened at once. Each
//! way runs in a fresh child process so that its peak resident set is its own.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::backend::NdArray;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

use trainer::model::weights::{LoadMode, WeightMap};
use trainer::model::{CausalLm, ModelConfig};

use crate::bench::QWEN25_05B;
use crate::cli::{BenchLoadArgs, LoadWay, WeightDtype};

/// What a child reports.
#[derive(serde::Serialize, serde::Deserialize)]
struct Measured {
    seconds: f64,
    peak_rss_bytes: u64,
    rss_after_bytes: u64,
}

/// Runs the benchmark, or one measurement when `--child` is set.
pub fn run(a: &BenchLoadArgs) -> Result<()> {
    if let Some(way) = a.child {
        let dir = a.dir.as_deref().context("--child needs --dir")?;
        return child(dir, way);
    }
    let cfg_text = match &a.shape {
        Some(p) => std::fs::read_to_string(p).with_context(|| p.display().to_string())?,
        None => QWEN25_05B.to_string(),
    };
    let cfg = ModelConfig::from_json(&cfg_text)?;
    let tmp;
    let dir = match &a.dir {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile_dir()?;
            tmp.clone()
        }
    };
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("config.json"), &cfg_text)?;
    let file = dir.join("model.safetensors");
    write_checkpoint(&cfg, a.dtype, &file)?;
    let file_bytes = std::fs::metadata(&file)?.len();
    let params = param_count(&cfg);
    let exe = std::env::current_exe()?;
    let mut rows = Vec::new();
    for way in [LoadWay::ReadWhole, LoadWay::Mapped] {
        let out = Command::new(&exe)
            .args(["bench-load", "--dir"])
            .arg(&dir)
            .args(["--child", way.name()])
            .output()
            .context("running the measurement")?;
        if !out.status.success() {
            bail!(
                "{} failed: {}",
                way.name(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let m: Measured = serde_json::from_slice(&out.stdout)?;
        rows.push((way, m));
    }
    if a.dir.is_none() {
        std::fs::remove_dir_all(&dir)?;
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let model = params as u64 * 4;
    println!(
        "checkpoint: {} parameters, {} file of {:.2} GiB; the model in f32 holds {:.2} GiB",
        params,
        a.dtype.name(),
        gib(file_bytes),
        gib(model)
    );
    println!();
    println!("| loading | seconds | peak RSS GiB | peak over the model GiB | RSS after GiB |");
    println!("|---|---:|---:|---:|---:|");
    for (way, m) in rows {
        println!(
            "| {} | {:.1} | {:.2} | {:.2} | {:.2} |",
            way.name(),
            m.seconds,
            gib(m.peak_rss_bytes),
            gib(m.peak_rss_bytes.saturating_sub(model)),
            gib(m.rss_after_bytes)
        );
    }
    Ok(())
}

fn tempfile_dir() -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("trainer-bench-load-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// Loads the checkpoint in `dir` on the CPU backend one way and prints what it measured.
fn child(dir: &Path, way: LoadWay) -> Result<()> {
    type B = NdArray<f32>;
    let cfg = ModelConfig::from_file(dir)?;
    let device = Default::default();
    let mode = match way {
        LoadWay::Mapped => LoadMode::Mapped,
        LoadWay::ReadWhole => LoadMode::ReadWhole,
    };
    let t0 = Instant::now();
    let mut w = WeightMap::open(dir, mode)?;
    let backbone = w.backbone::<B>(&cfg, &device)?;
    let lm_head = w.lm_head::<B>(&cfg, &device)?;
    drop(w);
    let lm = CausalLm { backbone, lm_head };
    let seconds = t0.elapsed().as_secs_f64();
    let (peak, now) = rss()?;
    drop(lm);
    let m = Measured {
        seconds,
        peak_rss_bytes: peak,
        rss_after_bytes: now,
    };
    println!("{}", serde_json::to_string(&m)?);
    Ok(())
}

/// This process's peak and current resident set (`VmHWM`, `VmRSS`), in bytes.
fn rss() -> Result<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let field = |name: &str| -> Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("/proc/self/status has no {name}"))?;
        let kb: u64 = line
            .split_whitespace()
            .nth(1)
            .context("malformed status line")?
            .parse()?;
        Ok(kb * 1024)
    };
    Ok((field("VmHWM:")?, field("VmRSS:")?))
}

/// Hugging Face names and shapes of every tensor of `cfg`'s model.
fn tensors_of(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (d, hd, h, kv, i) = (
        cfg.hidden_size,
        cfg.head_dim,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
    );
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, d],
    )];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.push((format!("{p}.input_layernorm.weight"), vec![d]));
        for (name, rows) in [("q_proj", h * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)] {
            out.push((format!("{p}.self_attn.{name}.weight"), vec![rows, d]));
            if cfg.qkv_bias {
                out.push((format!("{p}.self_attn.{name}.bias"), vec![rows]));
            }
        }
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![d, h * hd]));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![d]));
        out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, d]));
        out.push((format!("{p}.mlp.up_proj.weight"), vec![i, d]));
        out.push((format!("{p}.mlp.down_proj.weight"), vec![d, i]));
    }
    out.push(("model.norm.weight".to_string(), vec![d]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, d]));
    }
    out
}

fn param_count(cfg: &ModelConfig) -> usize {
    tensors_of(cfg)
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum()
}

/// A checkpoint of `cfg`'s shape with small deterministic values (their values do not
/// matter to the measurement, only their number and type).
fn write_checkpoint(cfg: &ModelConfig, dtype: WeightDtype, file: &Path) -> Result<()> {
    let tensors = tensors_of(cfg);
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, shape)| {
            let n: usize = shape.iter().product();
            let value = |k: usize| ((k * 7919 % 2003) as f32 - 1001.0) * 1e-5;
            match dtype {
                WeightDtype::Bf16 => (0..n)
                    .flat_map(|k| half::bf16::from_f32(value(k)).to_le_bytes())
                    .collect(),
                WeightDtype::F32 => (0..n).flat_map(|k| value(k).to_le_bytes()).collect(),
            }
        })
        .collect();
    let st_dtype = match dtype {
        WeightDtype::Bf16 => Dtype::BF16,
        WeightDtype::F32 => Dtype::F32,
    };
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape), b)| Ok((name.clone(), TensorView::new(st_dtype, shape.clone(), b)?)))
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, file)?;
    Ok(())
}
