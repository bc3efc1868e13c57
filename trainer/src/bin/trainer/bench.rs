//! `bench-model`: training and generation throughput of a model shape with random weights.

use anyhow::Result;
use burn::tensor::backend::AutodiffBackend;

use crate::cli::BenchArgs;
use crate::device::{DeviceEnv, Job};

/// The benchmark, as a [`Job`].
pub struct Bench<'a>(pub &'a BenchArgs);

impl Job for Bench<'_> {
    fn run<B: AutodiffBackend>(self, device: B::Device, env: &DeviceEnv) -> Result<()> {
        bench::<B>(self.0, device, env)
    }
}

/// Qwen2.5-0.5B's architecture (the shape the benchmark defaults to).
pub const QWEN25_05B: &str = r#"{"model_type":"qwen2","vocab_size":151936,"hidden_size":896,"intermediate_size":4864,
"num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,"max_position_embeddings":32768,
"rope_theta":1000000.0,"rms_norm_eps":1e-6,"tie_word_embeddings":true}"#;

/// `env.note` is appended to the backend's name in the report (the CUDA path names its
/// matmul choice).
fn bench<B: AutodiffBackend>(a: &BenchArgs, device: B::Device, env: &DeviceEnv) -> Result<()> {
    use burn::tensor::{Bool, ElementConversion, Int, Tensor, TensorData};
    use std::time::Instant;
    use trainer::generate::{generate, SamplingParams};
    use trainer::model::{Architecture, CausalLm, ModelConfig};
    let cfg = match &a.shape {
        Some(p) => ModelConfig::from_file(p)?,
        None => ModelConfig::from_json(QWEN25_05B)?,
    };
    let sync = |d: &B::Device| B::sync(d).map_err(|e| anyhow::anyhow!("device sync: {e:?}"));
    B::seed(&device, 0);
    let t_init = Instant::now();
    let mut lm = CausalLm::<B>::random(&cfg, &device);
    if a.lora_rank > 0 {
        lm = lm.with_adapters(&trainer::model::LoraSpec {
            rank: a.lora_rank,
            alpha: 2.0 * a.lora_rank as f64,
            dropout: 0.0,
            targets: trainer::model::LoraTarget::ALL.to_vec(),
        });
    }
    // The lowest free memory seen after a pass: the allocator keeps what a pass reserved.
    let mut min_free = (env.read_memory)().map(|m| m.free);
    let mut sample_memory = || {
        if let Some(m) = (env.read_memory)() {
            min_free = Some(min_free.map_or(m.free, |f| f.min(m.free)));
        }
    };
    let episode_len = a.prompt + a.turns * (a.new_tokens + a.observation);
    let positions = a.seq.max(a.prompt + a.new_tokens).max(episode_len) + 1;
    let arch = Architecture::<B>::new(cfg.clone(), positions, &device);
    sync(&device)?;
    // Printed apart from the passes: on a fresh GPU machine kernel compilation lands here first.
    eprintln!(
        "model initialised in {:.3} s",
        t_init.elapsed().as_secs_f64()
    );
    let tokens_of = |b: usize, t: usize| -> Vec<i32> {
        (0..b * t)
            .map(|i| ((i * 7919 + 13) % cfg.vocab_size) as i32)
            .collect()
    };
    // Training: forward (log-probabilities of every next token) and backward.
    let (b, t) = (a.train_batch, a.seq);
    let mut times = Vec::new();
    let mut first_loss = 0.0;
    let train_passes = if a.train_iters == 0 {
        0
    } else {
        a.train_iters + 1
    };
    for i in 0..train_passes {
        let tokens =
            Tensor::<B, 2, Int>::from_data(TensorData::new(tokens_of(b, t), [b, t]), &device);
        let valid =
            Tensor::<B, 2, Bool>::from_data(TensorData::new(vec![true; b * t], [b, t]), &device);
        sync(&device)?;
        let t0 = Instant::now();
        let mut loss_value = None;
        if a.checkpointing {
            let parts = trainer::model::recompute::layerwise_grads(
                &lm,
                &lm.backbone,
                tokens.clone(),
                valid,
                &arch.rope,
                |h| {
                    let loss = lm.stats_of_hidden(h, tokens, 1.0).logprobs.mean().neg();
                    loss_value = Some(loss.clone().detach());
                    loss
                },
            );
            drop(parts);
        } else {
            let stats = lm.sequence_stats(tokens, valid, &arch, 1.0);
            let loss = stats.logprobs.mean().neg();
            let grads = loss.backward();
            drop(grads);
            loss_value = Some(loss.detach());
        }
        sync(&device)?;
        if i > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
        sample_memory();
        // The same weights and tokens every pass: kernel choices that change the numbers show
        // here. Read once, outside the timed region.
        if let (0, Some(loss)) = (i, loss_value) {
            first_loss = loss.into_scalar().elem::<f64>();
        }
        eprintln!("train pass {i}: {:.3} s", t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let train = times.get(times.len() / 2).map(|&train_s| TrainRow {
        batch: b,
        seq: t,
        seconds: train_s,
        tokens_per_s: (b * t) as f64 / train_s,
        loss: first_loss,
        lora_rank: a.lora_rank,
        checkpointing: a.checkpointing,
        peak_memory_gib: env
            .memory
            .zip(min_free)
            .map(|(m, free)| (m.total - free) as f64 / (1u64 << 30) as f64),
    });
    let mut gen_rows = Vec::new();
    let inner = burn::module::AutodiffModule::valid(&lm);
    let inner_arch = Architecture::<B::InnerBackend>::new(cfg.clone(), positions, &device);
    for &gb in &a.gen_batch {
        let prompts: Vec<Vec<u32>> = (0..gb)
            .map(|r| {
                tokens_of(1, a.prompt)
                    .iter()
                    .map(|&x| ((x as usize + r) % cfg.vocab_size) as u32)
                    .collect()
            })
            .collect();
        let params = SamplingParams {
            temperature: 1.0,
            max_new_tokens: a.new_tokens,
            ..Default::default()
        };
        let mut best = f64::INFINITY;
        for rep in 0..2 {
            sync(&device)?;
            let t0 = Instant::now();
            let out = generate(&inner, &inner_arch, &prompts, &params, None, rep, &device);
            sync(&device)?;
            let dt = t0.elapsed().as_secs_f64();
            let n: usize = out.iter().map(|g| g.tokens.len()).sum();
            eprintln!("generate batch {gb} run {rep}: {n} tokens in {dt:.3} s");
            if rep > 0 || a.gen_batch.len() == 1 {
                best = best.min(dt);
            }
            if rep == 1 {
                let once = SamplingParams {
                    max_new_tokens: 1,
                    ..params.clone()
                };
                sync(&device)?;
                let t0 = Instant::now();
                generate(&inner, &inner_arch, &prompts, &once, None, rep, &device);
                sync(&device)?;
                let prefill = t0.elapsed().as_secs_f64();
                let stepped = n.saturating_sub(gb) as f64;
                eprintln!(
                    "generate batch {gb}: prefill {prefill:.3} s, decode {:.1} tokens/s",
                    stepped / (best - prefill).max(1e-9)
                );
                gen_rows.push(GenerateRow {
                    batch: gb,
                    prompt: a.prompt,
                    new_tokens: a.new_tokens,
                    seconds: best,
                    tokens_per_s: n as f64 / best,
                    prefill_seconds: prefill,
                    decode_tokens_per_s: stepped / (best - prefill).max(1e-9),
                });
            }
        }
    }
    let turns = if a.turns > 0 {
        let gb = a.gen_batch.first().copied().unwrap_or(1);
        Some(bench_turns::<B>(
            a,
            gb,
            &lm,
            &inner,
            &inner_arch,
            &arch,
            &device,
        )?)
    } else {
        None
    };
    let products = if a.products {
        bench_products::<B::InnerBackend>(&cfg, &a.gen_batch, &device)?
    } else {
        Vec::new()
    };
    #[cfg(feature = "cuda")]
    {
        let (steps, declined) = trainer::kernels::decode::counts();
        let queue_ms = trainer::kernels::decode::queue_seconds() * 1e3 / steps.max(1) as f64;
        eprintln!(
            "decode steps as one operation: {steps}, declined: {declined}; host time queueing one: {queue_ms:.3} ms"
        );
        let parts = trainer::kernels::decode::part_seconds();
        if !parts.is_empty() {
            let list: Vec<String> = parts
                .iter()
                .map(|(name, s)| format!("{name} {:.3}", s * 1e3))
                .collect();
            eprintln!(
                "decode step GPU time by part, ms a step: {}",
                list.join(", ")
            );
        }
    }
    let report = Report {
        products,
        engine: format!("burn {}{}", B::name(&device), env.note),
        params: trainer::memory::param_count(&cfg),
        train,
        generate: gen_rows,
        turns,
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// A named way to compute one product.
type Formulation<'a, B> = (
    &'static str,
    Box<dyn Fn() -> burn::tensor::Tensor<B, 2> + 'a>,
);

/// Times `[rows, k] x [k, n]` for the products of one decoding step (per layer: q/k/v,
/// output, gate/up, down; then the tied head) in four formulations, and prints a table.
fn bench_products<B: burn::tensor::backend::Backend>(
    cfg: &trainer::model::ModelConfig,
    batches: &[usize],
    device: &B::Device,
) -> Result<Vec<ProductRow>> {
    use burn::tensor::{Distribution, ElementConversion, Tensor};
    use std::time::Instant;
    let (d, hd) = (cfg.hidden_size, cfg.head_dim);
    let qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd;
    let shapes = [
        ("qkv", d, qkv),
        ("o", cfg.num_attention_heads * hd, d),
        ("gate_up", d, 2 * cfg.intermediate_size),
        ("down", cfg.intermediate_size, d),
        ("head", d, cfg.vocab_size),
    ];
    let sync = || B::sync(device).map_err(|e| anyhow::anyhow!("device sync: {e:?}"));
    let mut rows = Vec::new();
    eprintln!("| rows | product | k | n | plain us | split-k 8 us | rows as batch us | transposed us | max diff |");
    eprintln!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for &m in batches {
        for (name, k, n) in shapes {
            let x = Tensor::<B, 2>::random([m, k], Distribution::Normal(0.0, 1.0), device);
            let w = Tensor::<B, 2>::random([k, n], Distribution::Normal(0.0, 0.02), device);
            let split = 8;
            let forms: [Formulation<'_, B>; 4] = [
                ("plain", Box::new(|| x.clone().matmul(w.clone()))),
                (
                    "split-k",
                    Box::new(|| {
                        let xs = x.clone().reshape([m, split, k / split]).swap_dims(0, 1);
                        let ws = w.clone().reshape([split, k / split, n]);
                        xs.matmul(ws).sum_dim(0).reshape([m, n])
                    }),
                ),
                (
                    "rows-as-batch",
                    Box::new(|| {
                        x.clone()
                            .reshape([m, 1, k])
                            .matmul(w.clone().unsqueeze::<3>())
                            .reshape([m, n])
                    }),
                ),
                (
                    "transposed",
                    Box::new(|| {
                        w.clone()
                            .transpose()
                            .matmul(x.clone().transpose())
                            .transpose()
                    }),
                ),
            ];
            let mut times = Vec::new();
            let reference = forms[0].1();
            let mut worst = 0.0f64;
            for (form, f) in &forms {
                if *form == "split-k" && k % split != 0 {
                    times.push(f64::NAN);
                    continue;
                }
                // Warm-up compiles the kernels (and checks the formulation); then 20 back to back.
                let diff: f64 = (f() - reference.clone()).abs().max().into_scalar().elem();
                worst = worst.max(diff);
                sync()?;
                let t0 = Instant::now();
                // Results are kept until the sync so that none is skipped as unused.
                let outs: Vec<_> = (0..20).map(|_| f()).collect();
                sync()?;
                drop(outs);
                times.push(t0.elapsed().as_secs_f64() / 20.0 * 1e6);
            }
            eprintln!(
                "| {m} | {name} | {k} | {n} | {:.0} | {:.0} | {:.0} | {:.0} | {worst:.2e} |",
                times[0], times[1], times[2], times[3]
            );
            rows.push(ProductRow {
                rows: m,
                product: name,
                k,
                n,
                max_diff: worst,
                us: ProductTimes {
                    plain: times[0],
                    split_k8: times[1],
                    rows_as_batch: times[2],
                    transposed: times[3],
                },
            });
        }
    }
    Ok(rows)
}

/// What `bench-model` prints (scripts/bench_gpu_trainer.sh reads it).
#[derive(serde::Serialize)]
struct Report {
    products: Vec<ProductRow>,
    engine: String,
    params: u64,
    train: Option<TrainRow>,
    generate: Vec<GenerateRow>,
    turns: Option<TurnsRow>,
}

/// A synthetic multi-turn episode generated both ways.
#[derive(serde::Serialize)]
struct TurnsRow {
    batch: usize,
    turns: usize,
    new_tokens: usize,
    observation: usize,
    /// Every turn prefilling each whole context.
    from_scratch_s: f64,
    /// Each turn continuing from the kept caches.
    continuing_s: f64,
    /// Context tokens prefilled per turn, continuing (after the first turn: the last sampled
    /// token and the observation, per conversation).
    prefilled_per_turn: Vec<usize>,
    /// Context tokens prefilled in all, from scratch.
    prefilled_from_scratch: usize,
    /// Largest gap between a token's log-probability recorded at sampling and the one
    /// recomputed over the whole episode by the training pass (temperature 1).
    max_logprob_mismatch: f64,
}

/// Runs the `--turns` episode from scratch and continuing, and compares the log-probabilities
/// sampled with the training pass's recomputation.
#[allow(clippy::too_many_arguments)]
fn bench_turns<B: AutodiffBackend>(
    a: &BenchArgs,
    batch: usize,
    lm: &trainer::model::CausalLm<B>,
    inner: &trainer::model::CausalLm<B::InnerBackend>,
    inner_arch: &trainer::model::Architecture<B::InnerBackend>,
    arch: &trainer::model::Architecture<B>,
    device: &B::Device,
) -> Result<TurnsRow> {
    use burn::tensor::{Bool, Int, Tensor, TensorData};
    use std::time::Instant;
    use trainer::generate::{generate, generate_continuing, PrefixCache, SamplingParams};
    let vocab = inner_arch.config.vocab_size;
    let sync = |d: &B::Device| B::sync(d).map_err(|e| anyhow::anyhow!("device sync: {e:?}"));
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: a.new_tokens,
        ..Default::default()
    };
    let start: Vec<Vec<u32>> = (0..batch)
        .map(|r| {
            (0..a.prompt)
                .map(|i| ((i * 7919 + 13 + r) % vocab) as u32)
                .collect()
        })
        .collect();
    let observation = |turn: usize, r: usize| -> Vec<u32> {
        (0..a.observation)
            .map(|i| ((i * 104_729 + turn * 31 + r) % vocab) as u32)
            .collect()
    };
    // Which context positions hold sampled tokens, and what was recorded for them.
    let mut sampled: Vec<Vec<(usize, f32)>> = vec![Vec::new(); batch];
    let mut run = |continuing: bool| -> Result<(f64, Vec<usize>, Vec<Vec<u32>>)> {
        let mut contexts = start.clone();
        let mut kept: Vec<Option<PrefixCache<B::InnerBackend>>> =
            (0..batch).map(|_| None).collect();
        let mut prefilled = Vec::with_capacity(a.turns);
        sync(device)?;
        let t0 = Instant::now();
        for turn in 0..a.turns {
            let seed = turn as u64;
            let gens = if continuing {
                let out = generate_continuing(
                    inner,
                    inner_arch,
                    &contexts,
                    std::mem::take(&mut kept),
                    &params,
                    None,
                    seed,
                    device,
                );
                prefilled.push(out.prefilled_tokens);
                kept = out.caches.into_iter().map(Some).collect();
                out.generations
            } else {
                prefilled.push(contexts.iter().map(Vec::len).sum());
                generate(inner, inner_arch, &contexts, &params, None, seed, device)
            };
            for (r, g) in gens.iter().enumerate() {
                if continuing {
                    let at = contexts[r].len();
                    sampled[r].extend(g.logprobs.iter().enumerate().map(|(i, &l)| (at + i, l)));
                }
                contexts[r].extend(&g.tokens);
                contexts[r].extend(observation(turn, r));
            }
        }
        sync(device)?;
        let dt = t0.elapsed().as_secs_f64();
        eprintln!(
            "{} turns, batch {batch}, {}: {dt:.3} s, prefilled {} tokens",
            a.turns,
            if continuing {
                "continuing"
            } else {
                "from scratch"
            },
            prefilled.iter().sum::<usize>()
        );
        Ok((dt, prefilled, contexts))
    };
    let (from_scratch_s, scratch_prefill, _) = run(false)?;
    let (continuing_s, prefilled_per_turn, contexts) = run(true)?;
    // The training pass over the first conversation's whole episode.
    let ctx = &contexts[0];
    let t = ctx.len();
    let tokens = Tensor::<B, 2, Int>::from_data(
        TensorData::new(ctx.iter().map(|&x| x as i32).collect::<Vec<_>>(), [1, t]),
        device,
    );
    let valid = Tensor::<B, 2, Bool>::from_data(TensorData::new(vec![true; t], [1, t]), device);
    let recomputed: Vec<f32> = lm
        .sequence_stats(tokens, valid, arch, 1.0)
        .logprobs
        .into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| anyhow::anyhow!("log-probabilities: {e:?}"))?;
    // logprobs[j] is that of token j + 1.
    let max_logprob_mismatch = sampled[0]
        .iter()
        .filter_map(|&(pos, l)| Some((recomputed.get(pos.checked_sub(1)?)? - l).abs() as f64))
        .fold(0.0, f64::max);
    Ok(TurnsRow {
        batch,
        turns: a.turns,
        new_tokens: a.new_tokens,
        observation: a.observation,
        from_scratch_s,
        continuing_s,
        prefilled_per_turn,
        prefilled_from_scratch: scratch_prefill.iter().sum(),
        max_logprob_mismatch,
    })
}

/// The median training pass.
#[derive(serde::Serialize)]
struct TrainRow {
    batch: usize,
    seq: usize,
    seconds: f64,
    tokens_per_s: f64,
    /// The first pass's loss (the same weights and tokens every pass).
    loss: f64,
    /// Adapter rank (0: every weight trained).
    lora_rank: usize,
    /// Whether passes ran layer by layer.
    checkpointing: bool,
    /// Device memory in use after the passes (the allocator keeps what they reserved), GiB.
    peak_memory_gib: Option<f64>,
}

/// The best generation run of one batch size.
#[derive(serde::Serialize)]
struct GenerateRow {
    batch: usize,
    prompt: usize,
    new_tokens: usize,
    seconds: f64,
    tokens_per_s: f64,
    /// The prompt's prefill alone (one new token).
    prefill_seconds: f64,
    /// Tokens after the first per second of what is left once the prefill is taken out: the
    /// decode steps' rate with the prompt in the cache.
    decode_tokens_per_s: f64,
}

/// One product of a decoding step, timed four ways.
#[derive(serde::Serialize)]
struct ProductRow {
    rows: usize,
    product: &'static str,
    k: usize,
    n: usize,
    max_diff: f64,
    us: ProductTimes,
}

/// Microseconds per formulation.
#[derive(serde::Serialize)]
struct ProductTimes {
    plain: f64,
    split_k8: f64,
    rows_as_batch: f64,
    transposed: f64,
}
