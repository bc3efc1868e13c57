//! Logit and greedy-generation parity with Hugging Face `transformers` on tiny random
//! Qwen2- and Llama-shaped checkpoints, built by the test itself on CPU.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::backend::NdArray;
use burn::tensor::{Bool, Int, Tensor, TensorData};
use trainer::generate::{generate, SamplingParams};
use trainer::model::{Architecture, CausalLm, KvCache};

type B = NdArray<f32>;

fn python() -> PathBuf {
    std::env::var_os("CUDA_AGENT_PYTHON")
        .map(Into::into)
        .unwrap_or_else(|| "python3".into())
}

fn make_checkpoint(kind: &str, dir: &Path) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_tiny.py");
    let out = Command::new(python())
        .arg(script)
        .arg(kind)
        .arg(dir)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "hf_tiny.py failed (is transformers installed? scripts/python-env.sh sets it up):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<Vec<u32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

fn check(kind: &str) {
    let dir = tempfile::tempdir().unwrap();
    let reference = make_checkpoint(kind, dir.path());
    let device = Default::default();
    let (cfg, lm) = CausalLm::<B>::from_pretrained(dir.path(), &device).unwrap();
    assert_eq!(cfg.model_type, kind);
    let arch = Architecture::<B>::new(cfg.clone(), 64, &device);
    let seqs = ids(&reference["seqs"]);
    let width = seqs.iter().map(Vec::len).max().unwrap();

    // The same left-padded batch the reference ran.
    let mut tok = Vec::new();
    let mut valid = Vec::new();
    for s in &seqs {
        let pad = width - s.len();
        tok.extend(std::iter::repeat_n(0i32, pad).chain(s.iter().map(|&t| t as i32)));
        valid.extend(std::iter::repeat_n(false, pad).chain(std::iter::repeat_n(true, s.len())));
    }
    let n = seqs.len();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(tok, [n, width]), &device);
    let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(valid, [n, width]), &device);
    let logits: Vec<f32> = lm
        .forward(tokens, mask, &arch, None)
        .into_data()
        .to_vec()
        .unwrap();
    let v = cfg.vocab_size;
    let mut max_diff = 0f32;
    for (i, s) in seqs.iter().enumerate() {
        for t in 0..s.len() {
            let row = &reference["logits"][i][t];
            for k in 0..v {
                let ours = logits[(i * width + width - s.len() + t) * v + k];
                let theirs = row[k].as_f64().unwrap() as f32;
                max_diff = max_diff.max((ours - theirs).abs());
            }
        }
    }
    println!("{kind}: max |logit difference| = {max_diff:e}");
    assert!(max_diff < 1e-4, "{kind}: logits differ by {max_diff}");

    // Greedy generation, batched (so with padding and a shrinking cache) must match
    // transformers' one-at-a-time greedy decoding exactly.
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: 12,
        ..Default::default()
    };
    let gens = generate(&lm, &arch, &seqs, &params, None, 0, &device);
    let expected = ids(&reference["greedy"]);
    for (g, e) in gens.iter().zip(&expected) {
        assert_eq!(&g.tokens, e, "{kind}: greedy tokens differ");
    }

    // The tokenizer.json the `tokenizers` Python package wrote encodes the same here.
    let tk = trainer::tokenizer::TextTokenizer::from_file(dir.path()).unwrap();
    let text = reference["tokenized"]["text"].as_str().unwrap();
    let want: Vec<u32> = reference["tokenized"]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let ids = tk.encode(text).unwrap();
    assert_eq!(ids, want, "{kind}: token ids differ");
    assert_eq!(tk.decode(&ids), text);
    assert_eq!(tk.token_id("<|im_end|>"), Some(1));
}

#[test]
fn qwen2_matches_transformers() {
    check("qwen2");
}

#[test]
fn llama_matches_transformers() {
    check("llama");
}

/// Decoding token by token through the KV cache gives the full forward pass's logits at
/// every position, for a batch with different prompt lengths.
#[test]
fn kv_cache_decoding_matches_full_forward() {
    let cfg = trainer::model::ModelConfig::from_json(
        r#"{"model_type":"qwen2","vocab_size":50,"hidden_size":32,"intermediate_size":48,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "tie_word_embeddings":false}"#,
    )
    .unwrap();
    let device = Default::default();
    let lm = CausalLm::<B>::random(&cfg, &device);
    let arch = Architecture::<B>::new(cfg.clone(), 32, &device);
    let seqs: Vec<Vec<i32>> = vec![
        (0..9).map(|i| (i * 7 + 3) % 50).collect(),
        (0..6).map(|i| (i * 5 + 1) % 50).collect(),
    ];
    let (n, w) = (seqs.len(), 9);
    let mut tok = Vec::new();
    let mut valid = Vec::new();
    for s in &seqs {
        let pad = w - s.len();
        tok.extend(std::iter::repeat_n(0, pad).chain(s.iter().copied()));
        valid.extend(std::iter::repeat_n(false, pad).chain(std::iter::repeat_n(true, s.len())));
    }
    let full: Vec<f32> = lm
        .forward(
            Tensor::<B, 2, Int>::from_data(TensorData::new(tok.clone(), [n, w]), &device),
            Tensor::<B, 2, Bool>::from_data(TensorData::new(valid.clone(), [n, w]), &device),
            &arch,
            None,
        )
        .into_data()
        .to_vec()
        .unwrap();
    // Prefill three columns, then one column at a time.
    let mut cache = KvCache::new(cfg.num_hidden_layers);
    let mut step_logits = vec![0f32; full.len()];
    let v = cfg.vocab_size;
    let mut col = 0;
    while col < w {
        let len = if col == 0 { 3 } else { 1 };
        let take = |x: &Vec<i32>| {
            (0..n)
                .flat_map(|r| x[r * w + col..r * w + col + len].to_vec())
                .collect::<Vec<_>>()
        };
        let vt: Vec<bool> = (0..n)
            .flat_map(|r| valid[r * w + col..r * w + col + len].to_vec())
            .collect();
        let out: Vec<f32> = lm
            .forward(
                Tensor::<B, 2, Int>::from_data(TensorData::new(take(&tok), [n, len]), &device),
                Tensor::<B, 2, Bool>::from_data(TensorData::new(vt, [n, len]), &device),
                &arch,
                Some(&mut cache),
            )
            .into_data()
            .to_vec()
            .unwrap();
        for r in 0..n {
            for j in 0..len {
                let dst = (r * w + col + j) * v;
                let src = (r * len + j) * v;
                step_logits[dst..dst + v].copy_from_slice(&out[src..src + v]);
            }
        }
        col += len;
    }
    let mut max_diff = 0f32;
    for r in 0..n {
        for c in 0..w {
            if !valid[r * w + c] {
                continue;
            }
            for k in 0..v {
                let i = (r * w + c) * v + k;
                max_diff = max_diff.max((full[i] - step_logits[i]).abs());
            }
        }
    }
    assert!(
        max_diff < 1e-5,
        "cached decoding differs from the full pass by {max_diff}"
    );
}
