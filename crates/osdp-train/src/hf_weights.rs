//! Hugging Face checkpoints: the weights of `--init-from DIR` (a `save_pretrained` directory:
//! `config.json` and `model.safetensors`, or shards listed by `model.safetensors.index.json`).
//!
//! Every file is memory-mapped and only its header is parsed when the directory is opened, so
//! opening costs nothing whatever the model's size; a rank then reads one parameter at a time
//! ([`HfWeights::read`]: the file's bytes of that tensor, converted to fp32) and keeps only
//! its share, so its peak while loading is its planned state plus the largest parameter.
//!
//! Names: an op's `name` is its module path in `transformers`, so a parameter is
//! `{op.name}.{param}`; files saved from the bare model (GPT-2's `h.0…` without
//! `transformer.`, OPT's `decoder.…` without `model.`) are matched without that first part.
//! GPT-2's block linears are `Conv1D` modules, stored `[in, out]`: they are transposed to the
//! model's `[out, in]` on the way in and back on the way out.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use safetensors::SafeTensors;
use tch::{Kind, Tensor};

use osdp_core::model::{self, Family, ModelSpec, OpKind, OpSpec};

/// The single-file checkpoint's name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Largest index read (real ones: tens of kilobytes).
const MAX_INDEX_BYTES: u64 = 64 << 20;

/// An opened checkpoint: its files mapped, each parameter of the model located in one.
pub struct HfWeights {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Parameter key (`op.param`) → where its values are.
    located: HashMap<String, Located>,
}

struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Offset of the data section (after the 8-byte length and the header).
    data_start: usize,
    meta: Metadata,
}

struct Located {
    shard: usize,
    name: String,
    transpose: bool,
}

/// The module path of `op`'s parameter `param`, as `transformers` names it.
pub fn hf_name(op: &OpSpec, param: &str) -> String {
    format!("{}.{param}", op.name)
}

/// Whether the file stores this op's weight transposed (GPT-2's `Conv1D`: `[in, out]`).
pub fn stored_transposed(model: &ModelSpec, op: &OpSpec, param: &str) -> bool {
    model.family == Family::Gpt2
        && op.kind == OpKind::Linear
        && op.block.is_some()
        && param == "weight"
}

/// Buffers some checkpoints carry that are not parameters (causal masks, rotary tables).
fn is_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias")
        || name.ends_with(".attn.masked_bias")
        || name.ends_with("rotary_emb.inv_freq")
}

impl HfWeights {
    /// Open `dir` for `model`: its config must describe the same shapes, and its files must
    /// hold exactly the model's parameters (names, shapes, a floating-point dtype).
    pub fn open(dir: &Path, model: &ModelSpec) -> Result<HfWeights, String> {
        if !dir.is_dir() {
            return Err(format!(
                "--init-from {}: not a directory (a Hugging Face checkpoint: config.json and \
                 model.safetensors)",
                dir.display()
            ));
        }
        check_config(dir, model)?;
        let shards = open_shards(dir)?;
        let located = locate(dir, model, &shards)?;
        Ok(HfWeights {
            dir: dir.to_path_buf(),
            shards,
            located,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Parameter `key`'s values in fp32 on the CPU, in the model's shape.
    pub fn read(&self, key: &str) -> Result<Tensor, String> {
        let at = self
            .located
            .get(key)
            .ok_or_else(|| format!("{}: no tensor for {key:?}", self.dir.display()))?;
        let shard = &self.shards[at.shard];
        let info = shard
            .meta
            .info(&at.name)
            .ok_or_else(|| format!("{}: tensor {:?} vanished", shard.path.display(), at.name))?;
        let (start, end) = info.data_offsets;
        let bytes = &shard.map[shard.data_start + start..shard.data_start + end];
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        let t = Tensor::from_data_size(bytes, &shape, kind_of(info.dtype)?).to_kind(Kind::Float);
        // The file's pages of this tensor were mapped into this process while copied: give
        // them back, so that a rank's resident memory never grows toward the file's size.
        // SAFETY: a read-only file mapping, never written; a later read faults the same bytes
        // back in from the file.
        let _ = unsafe {
            shard.map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                shard.data_start + start,
                end - start,
            )
        };
        Ok(if at.transpose { t.tr().contiguous() } else { t })
    }
}

fn kind_of(dtype: Dtype) -> Result<Kind, String> {
    match dtype {
        Dtype::F32 => Ok(Kind::Float),
        Dtype::BF16 => Ok(Kind::BFloat16),
        Dtype::F16 => Ok(Kind::Half),
        other => Err(format!(
            "dtype {other:?} is not a weight format osdp-tui loads (F32, BF16, F16)"
        )),
    }
}

/// Config fields that are training choices, not the model's shapes.
const NOT_SHAPES: [&str; 6] = [
    "seq_len",
    "attention",
    "dtype",
    "dropout",
    "attention_dropout",
    "max_positions",
];

/// `dir/config.json`, imported as `import-hf` would, must describe the model: one line names
/// the first field that differs.
fn check_config(dir: &Path, model: &ModelSpec) -> Result<(), String> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Err(format!(
            "{}: no config.json (a Hugging Face checkpoint directory has one beside its \
             weights)",
            dir.display()
        ));
    }
    let opts = model::hf::ImportOptions {
        seq_len: Some(model.config.seq_len),
        ..Default::default()
    };
    let theirs = model::hf::import_file(&path, &opts).map_err(|e| e.to_string())?;
    if theirs.family != model.family {
        return Err(format!(
            "{} describes a {} model; the model description {:?} is a {} model",
            path.display(),
            theirs.family.as_str(),
            model.name,
            model.family.as_str()
        ));
    }
    let ours = serde_json::to_value(&model.config).map_err(|e| e.to_string())?;
    let theirs = serde_json::to_value(&theirs.config).map_err(|e| e.to_string())?;
    let (Some(ours), Some(theirs)) = (ours.as_object(), theirs.as_object()) else {
        return Ok(());
    };
    for (field, mine) in ours {
        if NOT_SHAPES.contains(&field.as_str()) {
            continue;
        }
        let there = theirs
            .get(field)
            .cloned()
            .unwrap_or(serde_json::Value::Null);
        if &there != mine {
            return Err(format!(
                "{} does not describe {}: `{field}` is {there} there and {mine} in the model \
                 description",
                path.display(),
                model.name
            ));
        }
    }
    Ok(())
}

/// Map and parse the checkpoint's files: the single file, or every file the index names.
fn open_shards(dir: &Path) -> Result<Vec<Shard>, String> {
    let single = dir.join(SINGLE_FILE);
    let index = dir.join(INDEX_FILE);
    let files: Vec<PathBuf> = if single.is_file() {
        vec![single]
    } else if index.is_file() {
        index_files(&index)?
            .into_iter()
            .map(|f| dir.join(f))
            .collect()
    } else if dir.join("pytorch_model.bin").exists()
        || dir.join("pytorch_model.bin.index.json").exists()
    {
        return Err(format!(
            "{}: weights in pytorch_model.bin (PyTorch's pickle format, which can run code); \
             osdp-tui reads safetensors: convert them with `python -c \"import transformers as \
             t; t.AutoModelForCausalLM.from_pretrained('DIR').save_pretrained('DIR')\"`",
            dir.display()
        ));
    } else {
        return Err(format!(
            "{}: no {SINGLE_FILE} or {INDEX_FILE}",
            dir.display()
        ));
    };
    files.into_iter().map(|f| open_shard(&f)).collect()
}

/// The distinct file names `weight_map` lists, in order; each a plain name in the directory.
fn index_files(index: &Path) -> Result<Vec<String>, String> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let text = osdp_core::input::read_text(index, MAX_INDEX_BYTES).map_err(|e| e.to_string())?;
    let parsed: Index = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a safetensors index: {e}", index.display()))?;
    let mut files: Vec<String> = Vec::new();
    for file in parsed.weight_map.values() {
        let plain = Path::new(file)
            .file_name()
            .is_some_and(|n| n == std::ffi::OsStr::new(file));
        if !plain || file == ".." {
            return Err(format!(
                "{}: weight_map names {file:?}, not a file beside the index",
                index.display()
            ));
        }
        if !files.contains(file) {
            files.push(file.clone());
        }
    }
    if files.is_empty() {
        return Err(format!("{}: weight_map is empty", index.display()));
    }
    Ok(files)
}

fn open_shard(path: &Path) -> Result<Shard, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    // SAFETY: the map is read-only; a file truncated while mapped would fault, as with any
    // reader of a file another process rewrites under it.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| format!("{}: {e}", path.display()))?;
    let (n, meta) = SafeTensors::read_metadata(&map)
        .map_err(|e| format!("{}: not a valid safetensors file ({e})", path.display()))?;
    Ok(Shard {
        path: path.to_path_buf(),
        map,
        data_start: 8 + n,
        meta,
    })
}

/// Every parameter of the model found in the files with its shape and a loadable dtype; every
/// tensor of the files used (or a tied copy, or a known buffer).
fn locate(
    dir: &Path,
    model: &ModelSpec,
    shards: &[Shard],
) -> Result<HashMap<String, Located>, String> {
    let mut names: HashMap<String, (usize, TensorInfo)> = HashMap::new();
    for (s, shard) in shards.iter().enumerate() {
        for (name, info) in shard.meta.tensors() {
            if let Some((other, _)) = names.get(&name) {
                return Err(format!(
                    "{}: tensor {name:?} is in both {} and {}",
                    dir.display(),
                    shards[*other].path.display(),
                    shard.path.display()
                ));
            }
            names.insert(name, (s, info.clone()));
        }
    }
    let mut located = HashMap::new();
    let mut used: HashSet<&String> = HashSet::new();
    for op in &model.ops {
        for p in &op.params {
            let full = hf_name(op, &p.name);
            let found = candidates(&full)
                .into_iter()
                .find_map(|c| names.get_key_value(c.as_str()));
            if p.tied_to.is_some() {
                // A tied head may be stored (an equal copy) or left out.
                if let Some((k, _)) = found {
                    used.insert(k);
                }
                continue;
            }
            let Some((name, (shard, info))) = found else {
                return Err(format!(
                    "{}: tensor {full:?} is missing (parameter {} of the model)",
                    dir.display(),
                    model::param_key(&op.id, &p.name)
                ));
            };
            kind_of(info.dtype).map_err(|e| format!("{}: tensor {name:?}: {e}", dir.display()))?;
            let transpose = stored_transposed(model, op, &p.name);
            let mut want: Vec<usize> = p.shape.iter().map(|&d| d as usize).collect();
            if transpose {
                want.reverse();
            }
            if info.shape != want {
                return Err(format!(
                    "{}: tensor {name:?} has shape {:?}, the model needs {want:?}{}",
                    dir.display(),
                    info.shape,
                    if transpose {
                        " (GPT-2 stores [in, out])"
                    } else {
                        ""
                    }
                ));
            }
            used.insert(name);
            located.insert(
                model::param_key(&op.id, &p.name),
                Located {
                    shard: *shard,
                    name: name.clone(),
                    transpose,
                },
            );
        }
    }
    let mut extra: Vec<&String> = names
        .keys()
        .filter(|n| !used.contains(n) && !is_buffer(n))
        .collect();
    extra.sort();
    if let Some(name) = extra.first() {
        return Err(format!(
            "{}: unexpected tensor {name:?}, which {} has no parameter for",
            dir.display(),
            model.name
        ));
    }
    Ok(located)
}

/// The names a parameter may have in a file: its full module path, and without the first part
/// (files saved from the bare model rather than the `…ForCausalLM`).
fn candidates(full: &str) -> Vec<String> {
    let mut c = vec![full.to_string()];
    if let Some((_, rest)) = full.split_once('.') {
        c.push(rest.to_string());
    }
    c
}

/// What `export-hf` wrote.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Exported {
    /// The weight files, in order.
    pub files: Vec<String>,
    pub tensors: usize,
    pub bytes: u64,
}

/// A parameter's full shape and fp32 values by `op.param` key, where the export reads them.
pub type ParamValues<'a> = dyn Fn(&str) -> Option<(Vec<i64>, Vec<f32>)> + 'a;

/// transformers' default largest shard (`save_pretrained(max_shard_size="5GB")`).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Write `model`'s parameters (full fp32 values by `op.param` key) into `dir` as a
/// `save_pretrained` directory: config.json (the imported config, its dtype fp32 and its layer
/// count the model's) and model.safetensors, or shards of at most `max_shard_bytes` with
/// model.safetensors.index.json. Tied parameters are written once, at their owner, as
/// transformers does.
pub fn export(
    model: &ModelSpec,
    value: &ParamValues<'_>,
    dir: &Path,
    max_shard_bytes: u64,
) -> Result<Exported, String> {
    let config = export_config(model)?;
    // Every tensor, in the model's op order, as little-endian fp32 bytes in the file's layout.
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for op in &model.ops {
        for p in op.params.iter().filter(|p| p.tied_to.is_none()) {
            let key = model::param_key(&op.id, &p.name);
            let (shape, values) =
                value(&key).ok_or_else(|| format!("the checkpoint has no parameter {key:?}"))?;
            if shape != p.shape {
                return Err(format!(
                    "the checkpoint's {key:?} has shape {shape:?}, the model says {:?}",
                    p.shape
                ));
            }
            let mut dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
            let values = if stored_transposed(model, op, &p.name) && dims.len() == 2 {
                let (rows, cols) = (dims[0], dims[1]);
                dims.reverse();
                let mut t = vec![0f32; values.len()];
                for r in 0..rows {
                    for c in 0..cols {
                        t[c * rows + r] = values[r * cols + c];
                    }
                }
                t
            } else {
                values
            };
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.push((hf_name(op, &p.name), dims, bytes));
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    write_json(&dir.join("config.json"), &serde_json::Value::Object(config))?;
    let groups = shard_groups(&tensors, max_shard_bytes);
    let n = groups.len();
    let mut files = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (k, group) in groups.iter().enumerate() {
        let name = if n == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", k + 1)
        };
        let views = group.iter().map(|&i| {
            let (tname, dims, bytes) = &tensors[i];
            let view = safetensors::tensor::TensorView::new(Dtype::F32, dims.clone(), bytes)
                .expect("shape and bytes agree");
            (tname.clone(), view)
        });
        safetensors::serialize_to_file(views, None, &dir.join(&name))
            .map_err(|e| format!("{}: {e}", dir.join(&name).display()))?;
        for &i in group {
            weight_map.insert(tensors[i].0.clone(), name.clone());
        }
        files.push(name);
    }
    let bytes: u64 = tensors.iter().map(|t| t.2.len() as u64).sum();
    if n > 1 {
        let index = serde_json::json!({
            "metadata": {"total_size": bytes},
            "weight_map": weight_map,
        });
        write_json(&dir.join(INDEX_FILE), &index)?;
    }
    Ok(Exported {
        files,
        tensors: tensors.len(),
        bytes,
    })
}

/// Consecutive tensors packed into shards of at most `max` bytes (a larger tensor alone).
fn shard_groups(tensors: &[(String, Vec<usize>, Vec<u8>)], max: u64) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let len = t.2.len() as u64;
        if size + len > max && !groups.last().is_some_and(Vec::is_empty) {
            groups.push(Vec::new());
            size = 0;
        }
        groups.last_mut().expect("one group").push(i);
        size += len;
    }
    groups
}

/// The imported config.json, with fp32 weights and the model's own layer count.
fn export_config(model: &ModelSpec) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let mut config = model.hf_config.clone().ok_or_else(|| {
        format!(
            "{} keeps no Hugging Face config (it was not made by `import-hf`): import the \
             model's config.json with `osdp-tui import-hf` and train that description",
            model.name
        )
    })?;
    for dtype in ["torch_dtype", "dtype"] {
        if config.contains_key(dtype) {
            config.insert(dtype.into(), "float32".into());
        }
    }
    let layers = if model.family == Family::Gpt2 {
        "n_layer"
    } else {
        "num_hidden_layers"
    };
    config.insert(layers.into(), model.config.layers.into());
    Ok(config)
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), String> {
    let text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))
}
