//! Loading Hugging Face `*.safetensors` weights (single file or sharded with an index) into
//! the burn modules, converting f32/f16/bf16/f64 to the backend's float type.
//!
//! The files are memory-mapped and each tensor is converted when the model takes it, its
//! mapped pages released right after: loading holds the model plus about one tensor in
//! f32, not a copy of the files and every tensor widened at once (docs/BENCHMARKS.md has the
//! measured peaks).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::tensor::{backend::Backend, Tensor, TensorData};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::config::ModelConfig;
use super::transformer::{Attention, Backbone, Block, Dense, Mlp, RmsNorm};
use crate::error::ModelError;

/// The tensors of a checkpoint, by name, converted to f32 as they are taken.
pub struct WeightMap {
    storage: Storage,
    source: PathBuf,
}

enum Storage {
    /// The files mapped; each tensor converted when taken.
    Mapped {
        files: Vec<Mmap>,
        index: HashMap<String, Entry>,
    },
    /// Every tensor read and converted up front: how the trainer loaded before mapping, kept
    /// as the load benchmark's baseline.
    Decoded(HashMap<String, (Vec<usize>, Vec<f32>)>),
}

/// Where one tensor lies in the mapped files.
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range in the file.
    start: usize,
    end: usize,
}

/// How [`WeightMap`] reads the files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadMode {
    /// Memory-mapped, one tensor converted at a time (the default).
    Mapped,
    /// Each file read whole and every tensor converted up front (the benchmark's baseline).
    ReadWhole,
}

/// The safetensors files of a checkpoint directory: `model.safetensors`, or every shard
/// named by `model.safetensors.index.json`, or every `*.safetensors` file.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::Io(index.clone(), e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::InFile(index.clone(), Box::new(ModelError::Json(e))))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::Weights(format!("{}: no weight_map", index.display())))?;
        let mut shards: Vec<String> = map
            .values()
            .filter_map(|s| s.as_str().map(String::from))
            .collect();
        shards.sort();
        shards.dedup();
        shards.into_iter().map(|s| dir.join(s)).collect()
    } else if dir.join("model.safetensors").exists() {
        vec![dir.join("model.safetensors")]
    } else {
        let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| ModelError::Io(dir.to_path_buf(), e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        found.sort();
        found
    };
    if files.is_empty() {
        return Err(ModelError::Weights(format!(
            "no *.safetensors in {}",
            dir.display()
        )));
    }
    Ok(files)
}

impl WeightMap {
    /// Maps the checkpoint's safetensors files in `dir` (see [`LoadMode`]).
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        Self::open(dir, LoadMode::Mapped)
    }

    /// Opens the checkpoint's safetensors files in `dir` the given way.
    pub fn open(dir: &Path, mode: LoadMode) -> Result<Self, ModelError> {
        let files = weight_files(dir)?;
        let safetensors_error = |file: &Path, source| ModelError::Safetensors {
            what: file.display().to_string(),
            source,
        };
        let storage = match mode {
            LoadMode::Mapped => {
                let mut maps = Vec::with_capacity(files.len());
                let mut index = HashMap::new();
                for (k, file) in files.iter().enumerate() {
                    let f =
                        std::fs::File::open(file).map_err(|e| ModelError::Io(file.clone(), e))?;
                    // SAFETY: the map is only read, and a checkpoint is not modified while it
                    // is loaded (the trainer writes new ones under temporary names).
                    let map =
                        unsafe { Mmap::map(&f) }.map_err(|e| ModelError::Io(file.clone(), e))?;
                    let (header, meta) =
                        SafeTensors::read_metadata(&map).map_err(|e| safetensors_error(file, e))?;
                    let data = 8 + header;
                    for (name, info) in meta.tensors() {
                        let (start, end) = (data + info.data_offsets.0, data + info.data_offsets.1);
                        if end > map.len() || start > end {
                            return Err(ModelError::Weights(format!(
                                "{}: {name} lies outside the file",
                                file.display()
                            )));
                        }
                        index.insert(
                            name,
                            Entry {
                                file: k,
                                dtype: info.dtype,
                                shape: info.shape.clone(),
                                start,
                                end,
                            },
                        );
                    }
                    maps.push(map);
                }
                Storage::Mapped { files: maps, index }
            }
            LoadMode::ReadWhole => {
                let mut tensors = HashMap::new();
                for file in &files {
                    let bytes = std::fs::read(file).map_err(|e| ModelError::Io(file.clone(), e))?;
                    let st =
                        SafeTensors::deserialize(&bytes).map_err(|e| safetensors_error(file, e))?;
                    for (name, view) in st.tensors() {
                        let data = to_f32(view.dtype(), view.data()).map_err(|m| {
                            ModelError::Weights(format!("{}: {name}: {m}", file.display()))
                        })?;
                        tensors.insert(name, (view.shape().to_vec(), data));
                    }
                }
                Storage::Decoded(tensors)
            }
        };
        Ok(Self {
            storage,
            source: dir.to_path_buf(),
        })
    }

    /// Names of all tensors not yet taken.
    pub fn names(&self) -> Vec<&str> {
        match &self.storage {
            Storage::Mapped { index, .. } => index.keys().map(String::as_str).collect(),
            Storage::Decoded(t) => t.keys().map(String::as_str).collect(),
        }
    }

    /// Removes tensor `name`, checked to have `shape`, as f32.
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<TensorData, ModelError> {
        let missing =
            || ModelError::Weights(format!("{} lacks tensor {name}", self.source.display()));
        let (s, data) = match &mut self.storage {
            Storage::Mapped { files, index } => {
                let e = index.remove(name).ok_or_else(missing)?;
                if e.shape != shape {
                    return Err(ModelError::Weights(format!(
                        "{name}: shape {:?}, config expects {shape:?}",
                        e.shape
                    )));
                }
                let map = &files[e.file];
                let data = to_f32(e.dtype, &map[e.start..e.end])
                    .map_err(|m| ModelError::Weights(format!("{name}: {m}")))?;
                // The tensor is copied out: its pages leave this process's resident set (they
                // stay in the page cache, and a later read would fault them back in).
                // SAFETY: the map is a read-only file mapping, so dropping its pages loses
                // nothing, and no reference into the range outlives this call.
                let _ = unsafe {
                    map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        e.start,
                        e.end - e.start,
                    )
                };
                (e.shape, data)
            }
            Storage::Decoded(t) => {
                let (s, data) = t.remove(name).ok_or_else(missing)?;
                if s != shape {
                    return Err(ModelError::Weights(format!(
                        "{name}: shape {s:?}, config expects {shape:?}"
                    )));
                }
                (s, data)
            }
        };
        Ok(TensorData::new(data, s))
    }

    fn has(&self, name: &str) -> bool {
        match &self.storage {
            Storage::Mapped { index, .. } => index.contains_key(name),
            Storage::Decoded(t) => t.contains_key(name),
        }
    }

    fn dense<B: Backend>(
        &mut self,
        prefix: &str,
        d_in: usize,
        d_out: usize,
        bias: bool,
        device: &B::Device,
    ) -> Result<Dense<B>, ModelError> {
        Ok(Dense::from_parts(vec![
            self.dense_part(prefix, d_in, d_out, bias, device)?
        ]))
    }

    /// One layer's weight `[in, out]` and bias as plain tensors (parameters are made once the
    /// parts of a fused layer are joined: a parameter must be a leaf of the autodiff graph).
    fn dense_part<B: Backend>(
        &mut self,
        prefix: &str,
        d_in: usize,
        d_out: usize,
        bias: bool,
        device: &B::Device,
    ) -> Result<(Tensor<B, 2>, Option<Tensor<B, 1>>), ModelError> {
        // Stored [out, in]; the forward pass wants [in, out].
        let w = Tensor::<B, 2>::from_data(
            self.take(&format!("{prefix}.weight"), &[d_out, d_in])?,
            device,
        )
        .transpose();
        let b = if bias {
            Some(Tensor::<B, 1>::from_data(
                self.take(&format!("{prefix}.bias"), &[d_out])?,
                device,
            ))
        } else {
            None
        };
        Ok((w, b))
    }

    fn norm<B: Backend>(
        &mut self,
        name: &str,
        d: usize,
        eps: f64,
        device: &B::Device,
    ) -> Result<RmsNorm<B>, ModelError> {
        Ok(RmsNorm {
            weight: Param::from_tensor(Tensor::from_data(self.take(name, &[d])?, device)),
            eps,
        })
    }

    /// Builds the backbone from `model.*` tensors, consuming them.
    pub fn backbone<B: Backend>(
        &mut self,
        cfg: &ModelConfig,
        device: &B::Device,
    ) -> Result<Backbone<B>, ModelError> {
        let (d, hd, h, kv) = (
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        );
        let embed = Tensor::from_data(
            self.take("model.embed_tokens.weight", &[cfg.vocab_size, d])?,
            device,
        );
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layers.push(Block {
                input_layernorm: self.norm(
                    &format!("{p}.input_layernorm.weight"),
                    d,
                    cfg.rms_norm_eps,
                    device,
                )?,
                self_attn: Attention {
                    qkv_proj: Dense::from_parts(vec![
                        self.dense_part(
                            &format!("{p}.self_attn.q_proj"),
                            d,
                            h * hd,
                            cfg.qkv_bias,
                            device,
                        )?,
                        self.dense_part(
                            &format!("{p}.self_attn.k_proj"),
                            d,
                            kv * hd,
                            cfg.qkv_bias,
                            device,
                        )?,
                        self.dense_part(
                            &format!("{p}.self_attn.v_proj"),
                            d,
                            kv * hd,
                            cfg.qkv_bias,
                            device,
                        )?,
                    ]),
                    o_proj: self.dense(
                        &format!("{p}.self_attn.o_proj"),
                        h * hd,
                        d,
                        cfg.o_bias,
                        device,
                    )?,
                    n_heads: h,
                    n_kv_heads: kv,
                    head_dim: hd,
                },
                post_attention_layernorm: self.norm(
                    &format!("{p}.post_attention_layernorm.weight"),
                    d,
                    cfg.rms_norm_eps,
                    device,
                )?,
                mlp: Mlp {
                    gate_up_proj: Dense::from_parts(vec![
                        self.dense_part(
                            &format!("{p}.mlp.gate_proj"),
                            d,
                            cfg.intermediate_size,
                            cfg.mlp_bias,
                            device,
                        )?,
                        self.dense_part(
                            &format!("{p}.mlp.up_proj"),
                            d,
                            cfg.intermediate_size,
                            cfg.mlp_bias,
                            device,
                        )?,
                    ]),
                    down_proj: self.dense(
                        &format!("{p}.mlp.down_proj"),
                        cfg.intermediate_size,
                        d,
                        cfg.mlp_bias,
                        device,
                    )?,
                },
            });
        }
        Ok(Backbone {
            embed_tokens: Param::from_tensor(embed),
            layers,
            norm: self.norm("model.norm.weight", d, cfg.rms_norm_eps, device)?,
        })
    }

    /// The untied output projection, or `None` when the config ties it to the embeddings
    /// (a checkpoint that ties but still ships `lm_head.weight` is read as untied).
    pub fn lm_head<B: Backend>(
        &mut self,
        cfg: &ModelConfig,
        device: &B::Device,
    ) -> Result<Option<Dense<B>>, ModelError> {
        if cfg.tie_word_embeddings && !self.has("lm_head.weight") {
            return Ok(None);
        }
        self.dense("lm_head", cfg.hidden_size, cfg.vocab_size, false, device)
            .map(Some)
    }
}

fn to_f32(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>, String> {
    let chunks = |n: usize| bytes.chunks_exact(n);
    Ok(match dtype {
        Dtype::F32 => chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => chunks(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => chunks(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F64 => chunks(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        other => return Err(format!("dtype {other:?} is not a float type")),
    })
}

/// Tensors by name: shape and f32 values.
pub type NamedTensors = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// Reads every tensor of one safetensors file as f32, by name (adapters and small files; a
/// model's weights go through [`WeightMap`]).
pub fn read_safetensors(path: &Path) -> Result<NamedTensors, ModelError> {
    let bytes = std::fs::read(path).map_err(|e| ModelError::Io(path.to_path_buf(), e))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Safetensors {
        what: path.display().to_string(),
        source: e,
    })?;
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = to_f32(view.dtype(), view.data())
                .map_err(|m| ModelError::Weights(format!("{}: {name}: {m}", path.display())))?;
            Ok((name, (view.shape().to_vec(), data)))
        })
        .collect()
}

/// Writes named f32 tensors as one safetensors file (used for checkpoints and test fixtures).
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
) -> Result<(), ModelError> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, d)| d.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| {
            safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| ModelError::Safetensors {
                    what: n.clone(),
                    source: e,
                })
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| ModelError::Safetensors {
        what: path.display().to_string(),
        source: e,
    })
}
