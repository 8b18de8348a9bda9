//! Checkpoints independent of the plan: each rank writes the regions of parameters and AdamW
//! moments it owns to its own safetensors file; a manifest lists the files, exactly one per rank,
//! with their sizes and CRC-32s, and carries a CRC-32 of its own content. A tensor's key names its region ([`RegionKey`]:
//! `op.param|state|cols|flat_start:len`), so loading reassembles every full parameter and any plan at any world size can take its share.
//!
//! Writing is atomic: files go to a `.tmp-…` directory, are fsynced, the directory is renamed to
//! `step-NNNNNNNN`, and only then does `latest` point at it. A process killed mid-write leaves the
//! previous checkpoint and `latest` untouched; what it did leave, [`sweep`] removes once the
//! directory is held again.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use osdp_core::model::ModelSpec;

use super::exec::FullState;

/// Version 2 added the manifest's own checksum; version 1 manifests (without) still load.
pub const CHECKPOINT_FORMAT_VERSION: u32 = 2;
/// Manifests this build reads.
const READABLE_VERSIONS: [u32; 2] = [1, 2];
/// `latest.json` has kept its format.
const LATEST_FORMAT_VERSION: u32 = 1;
/// Most ranks a checkpoint may list: as many as a run may have.
const MAX_RANKS: usize = 1 << 16;
/// The last step a manifest may say: far past any run (a million steps a day for 700 years).
pub const MAX_STEP: u64 = 1 << 48;
/// The most elements one parameter may have (a 2^36-element tensor is 256 GiB in fp32).
const MAX_PARAM_ELEMENTS: i64 = 1 << 36;
const MANIFEST: &str = "manifest.json";
const LATEST: &str = "latest.json";
/// Complete checkpoints kept in a directory; older ones are removed after a new one lands.
const KEEP: usize = 2;

/// Which of a parameter's three saved values a region holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Saved {
    Param,
    ExpAvg,
    ExpAvgSq,
}

impl Saved {
    pub const ALL: [Saved; 3] = [Saved::Param, Saved::ExpAvg, Saved::ExpAvgSq];

    pub fn as_str(self) -> &'static str {
        match self {
            Saved::Param => "param",
            Saved::ExpAvg => "exp_avg",
            Saved::ExpAvgSq => "exp_avg_sq",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The key of one saved tensor: a contiguous run of a parameter's (or a column slice's)
/// flattened values, written `op.param|state|cols|flat_start:len` with `cols` either `-` (the
/// whole parameter) or `start:len` (columns of a 2-D weight split by columns). The executor
/// writes keys with `to_string` and the loader reads them with `parse`: the format has this
/// one home.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionKey {
    pub param: String,
    pub saved: Saved,
    pub cols: Option<(i64, i64)>,
    pub flat: (i64, i64),
}

impl std::fmt::Display for RegionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}|{}|", self.param, self.saved.as_str())?;
        match self.cols {
            Some((s, l)) => write!(f, "{s}:{l}")?,
            None => f.write_str("-")?,
        }
        write!(f, "|{}:{}", self.flat.0, self.flat.1)
    }
}

impl RegionKey {
    /// Parse a key; `None` for anything that is not one (a negative or empty range included).
    pub fn parse(key: &str) -> Option<RegionKey> {
        let parts: Vec<&str> = key.split('|').collect();
        let [param, saved, cols, flat] = parts.as_slice() else {
            return None;
        };
        let range = |s: &str| -> Option<(i64, i64)> {
            let (a, b) = s.split_once(':')?;
            let (a, b) = (a.parse().ok()?, b.parse().ok()?);
            (a >= 0 && b > 0).then_some((a, b))
        };
        Some(RegionKey {
            param: param.to_string(),
            saved: Saved::ALL.into_iter().find(|s| s.as_str() == *saved)?,
            cols: match *cols {
                "-" => None,
                c => Some(range(c)?),
            },
            flat: range(flat)?,
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[error("checkpoint {}: {problem}", path.display())]
pub struct CheckpointError {
    pub path: PathBuf,
    pub problem: String,
}

fn err(path: &Path, problem: impl Into<String>) -> CheckpointError {
    CheckpointError {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub version: u32,
    pub model: String,
    pub model_fingerprint: String,
    /// Optimizer steps taken; training resumes at this step.
    pub step: u64,
    /// Data stream position: seed and global batch size (samples are a function of step).
    pub seed: u64,
    pub global_batch: u64,
    pub data: String,
    /// World size and plan of the run that wrote it (informational: loading reshards).
    pub world_size: usize,
    pub files: Vec<FileEntry>,
    /// Full shape of every parameter.
    pub params: BTreeMap<String, Vec<i64>>,
    /// CRC-32 of the manifest's canonical JSON without this field ([`Manifest::checksum`]):
    /// an edited or damaged manifest is refused instead of restoring wrong state. Absent in
    /// version 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest_crc32: Option<u32>,
}

impl Manifest {
    /// CRC-32 of the manifest as compact JSON, fields in declaration order and parameters
    /// sorted, without `manifest_crc32` itself: what `manifest_crc32` must hold.
    pub fn checksum(&self) -> u32 {
        let bare = Manifest {
            manifest_crc32: None,
            ..self.clone()
        };
        crc32fast::hash(&serde_json::to_vec(&bare).unwrap_or_default())
    }

    /// Why a field is out of what any run writes, if one is: a checksum proves the bytes are
    /// the manifest's, not that the manifest is sane (a forged one can be re-checksummed).
    fn check_fields(&self) -> Result<(), String> {
        if self.step > MAX_STEP {
            return Err(format!("says step {} (at most {MAX_STEP})", self.step));
        }
        let per_rank = self.global_batch.div_ceil(self.world_size.max(1) as u64);
        if self.global_batch == 0 || per_rank > osdp_core::plan::MAX_BATCH {
            return Err(format!(
                "says global batch {} over {} rank(s) (1 to {} samples per rank)",
                self.global_batch,
                self.world_size,
                osdp_core::plan::MAX_BATCH
            ));
        }
        for (name, shape) in &self.params {
            let numel = shape
                .iter()
                .try_fold(1i64, |n, &d| (d >= 1).then(|| n.checked_mul(d)).flatten());
            if shape.is_empty() || numel.is_none_or(|n| n > MAX_PARAM_ELEMENTS) {
                return Err(format!(
                    "says parameter {:?} has shape {shape:?} (dimensions of at least 1, at most \
                     {MAX_PARAM_ELEMENTS} elements)",
                    osdp_core::text::printable(name)
                ));
            }
        }
        Ok(())
    }

    /// Why this manifest is not of `model`, if it is not: another model (fingerprint), or
    /// parameters other than the model's (names and shapes). Checked before any state is
    /// allocated.
    pub fn check_model(&self, model: &ModelSpec) -> Result<(), String> {
        if self.model_fingerprint != osdp_core::plan::fingerprint(model) {
            return Err(format!(
                "is of model {:?}, not {:?} (the operator graphs differ)",
                osdp_core::text::printable(&self.model),
                osdp_core::text::printable(&model.name)
            ));
        }
        let expected = params_of(model);
        for (name, shape) in &expected {
            match self.params.get(name) {
                Some(s) if s == shape => {}
                Some(s) => {
                    return Err(format!(
                        "says parameter {name:?} has shape {s:?}; the model's is {shape:?}"
                    ))
                }
                None => return Err(format!("lists no parameter {name:?}")),
            }
        }
        match self.params.keys().find(|k| !expected.contains_key(*k)) {
            Some(extra) => Err(format!(
                "lists parameter {:?}, which the model does not have",
                osdp_core::text::printable(extra)
            )),
            None => Ok(()),
        }
    }

    /// Why the file list is not exactly one file per rank of `world_size`, if it is not: a
    /// rank listed twice would load its shard twice and leave another rank's zero.
    fn check_files(&self) -> Result<(), String> {
        let world = self.world_size;
        if world == 0 || world > MAX_RANKS {
            return Err(format!(
                "says world size {world} (expected 1 to {MAX_RANKS})"
            ));
        }
        let mut seen = vec![false; world];
        for f in &self.files {
            let rank = rank_of_file(&f.name).filter(|&r| r < world);
            let Some(rank) = rank else {
                return Err(format!(
                    "lists {:?}, which is not a rank file of a {world}-rank checkpoint",
                    osdp_core::text::printable(&f.name)
                ));
            };
            if std::mem::replace(&mut seen[rank], true) {
                return Err(format!("lists {} twice", f.name));
            }
        }
        match seen.iter().position(|s| !s) {
            Some(r) => Err(format!(
                "lists no file for rank {r} of {world} ({})",
                rank_file_name(r)
            )),
            None => Ok(()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub name: String,
    pub bytes: u64,
    pub crc32: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Latest {
    version: u32,
    checkpoint: String,
    step: u64,
}

pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

pub fn tmp_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!(".tmp-{}", step_dir_name(step)))
}

pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// The rank whose file `name` is, when it is named exactly as [`rank_file_name`] names one.
fn rank_of_file(name: &str) -> Option<usize> {
    let rank = name
        .strip_prefix("rank-")?
        .strip_suffix(".safetensors")?
        .parse::<usize>()
        .ok()?;
    (rank_file_name(rank) == name).then_some(rank)
}

/// The step of a checkpoint directory named exactly as [`step_dir_name`] names one.
fn step_of_dir(name: &str) -> Option<u64> {
    let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
    (step_dir_name(step) == name).then_some(step)
}

/// Prepare an empty temporary directory for `step` (rank 0, before the ranks write).
pub fn begin(root: &Path, step: u64) -> Result<PathBuf, CheckpointError> {
    let tmp = tmp_dir(root, step);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| err(&tmp, e.to_string()))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| err(&tmp, e.to_string()))?;
    Ok(tmp)
}

/// One rank's file, written and fsynced.
pub fn write_rank(
    tmp: &Path,
    rank: usize,
    tensors: &[(String, Tensor)],
) -> Result<(), CheckpointError> {
    let path = tmp.join(rank_file_name(rank));
    Tensor::write_safetensors(tensors, &path).map_err(|e| err(&path, e.to_string()))?;
    let f = std::fs::File::open(&path).map_err(|e| err(&path, e.to_string()))?;
    f.sync_all().map_err(|e| err(&path, e.to_string()))?;
    Ok(())
}

fn crc_of(path: &Path) -> Result<(u64, u32), CheckpointError> {
    let mut f = std::fs::File::open(path).map_err(|e| err(path, e.to_string()))?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| err(path, e.to_string()))?;
        if n == 0 {
            break;
        }
        bytes += n as u64;
        h.update(&buf[..n]);
    }
    Ok((bytes, h.finalize()))
}

fn sync_dir(dir: &Path) {
    // Directory fsync makes the rename durable; not every filesystem supports it.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Seal a checkpoint (rank 0, after every rank wrote): manifest, rename, `latest`, pruning.
pub fn commit(root: &Path, tmp: &Path, mut manifest: Manifest) -> Result<PathBuf, CheckpointError> {
    manifest.files.clear();
    for rank in 0..manifest.world_size {
        let name = rank_file_name(rank);
        let path = tmp.join(&name);
        if !path.exists() {
            // Every rank wrote before this: a file rank 0 cannot see is on another machine.
            return Err(err(
                &path,
                format!(
                    "is missing: rank {rank} wrote it where rank 0 cannot see it (--checkpoint-dir \
                     must be a directory every rank shares)"
                ),
            ));
        }
        let (bytes, crc32) = crc_of(&path)?;
        manifest.files.push(FileEntry { name, bytes, crc32 });
    }
    manifest.version = CHECKPOINT_FORMAT_VERSION;
    manifest.manifest_crc32 = Some(manifest.checksum());
    let mpath = tmp.join(MANIFEST);
    osdp_core::input::write_json_atomically(&mpath, &manifest)
        .map_err(|e| err(&mpath, e.to_string()))?;
    sync_dir(tmp);
    let dir_name = step_dir_name(manifest.step);
    let dest = root.join(&dir_name);
    if dest.exists() {
        std::fs::remove_dir_all(&dest).map_err(|e| err(&dest, e.to_string()))?;
    }
    std::fs::rename(tmp, &dest).map_err(|e| err(&dest, e.to_string()))?;
    sync_dir(root);
    let latest = Latest {
        version: LATEST_FORMAT_VERSION,
        checkpoint: dir_name,
        step: manifest.step,
    };
    let lpath = root.join(LATEST);
    osdp_core::input::write_json_atomically(&lpath, &latest)
        .map_err(|e| err(&lpath, e.to_string()))?;
    sync_dir(root);
    prune(root, manifest.step);
    sweep(root);
    Ok(dest)
}

/// Complete checkpoint directories under `root`, oldest first.
pub fn list(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            e.path().join(MANIFEST).exists().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    out
}

fn prune(root: &Path, newest: u64) {
    let all = list(root);
    let keep_from = all.len().saturating_sub(KEEP);
    for (step, path) in &all[..keep_from] {
        if *step < newest {
            let _ = std::fs::remove_dir_all(path);
        }
    }
}

/// The checkpoint `latest.json` in `root` points at, if any.
pub fn latest(root: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    let lpath = root.join(LATEST);
    if !lpath.exists() {
        return Ok(None);
    }
    let l: Latest = osdp_core::input::read_strict(&lpath, LATEST_FORMAT_VERSION)
        .map_err(|e| err(&lpath, e.to_string()))?;
    if l.checkpoint.contains('/') || l.checkpoint.contains("..") {
        return Err(err(
            &lpath,
            format!(
                "names {:?}, which is not a checkpoint directory",
                l.checkpoint
            ),
        ));
    }
    Ok(Some(root.join(l.checkpoint)))
}

/// Remove from `root` what interrupted checkpoint writers left, as far as it is provably
/// theirs; what was removed. The caller holds `root`'s lock and writes no checkpoint now, so
/// no live process writes there (another rank of this run writes only between `begin` and
/// `commit`). Removed:
/// - `.latest.json.tmp-…` files: `latest.json` written by a process killed before its rename;
/// - `.tmp-step-NNNNNNNN` directories: checkpoints never committed;
/// - `step-NNNNNNNN` directories without `manifest.json` at or before the step `latest.json`
///   names (itself sealed): what a kill during pruning or replacing left.
///
/// A directory is removed only when it holds nothing but the files the trainer writes there.
/// Never touched: sealed checkpoints (with a manifest), a step after the latest (no proof), any
/// other name, symbolic links, and everything when `latest.json` cannot be read.
pub fn sweep(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let latest = latest_sealed_step(root);
    let mut removed: Vec<PathBuf> = Vec::new();
    for entry in entries.flatten() {
        let (name, path) = (entry.file_name(), entry.path());
        let (Some(name), Ok(kind)) = (name.to_str(), entry.file_type()) else {
            continue;
        };
        let debris = if kind.is_file() {
            osdp_core::input::is_temp_name_of(name, LATEST)
        } else if !kind.is_dir() {
            false
        } else if let Some(step) = step_of_dir(name) {
            latest.is_some_and(|l| step <= l) && only_writer_files(&path, false)
        } else {
            name.strip_prefix(".tmp-").and_then(step_of_dir).is_some()
                && only_writer_files(&path, true)
        };
        if !debris {
            continue;
        }
        let gone = if kind.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        if gone.is_ok() {
            removed.push(path);
        }
    }
    removed.sort();
    removed
}

/// The step of the checkpoint `latest.json` names, when it can be read and that checkpoint is
/// sealed (has its manifest).
fn latest_sealed_step(root: &Path) -> Option<u64> {
    let dir = latest(root).ok()??;
    let step = step_of_dir(dir.file_name()?.to_str()?)?;
    dir.join(MANIFEST).is_file().then_some(step)
}

/// Whether `dir` holds only plain files a checkpoint writer puts there: rank files, the
/// manifest's temp file and, where `manifest`, the manifest itself.
fn only_writer_files(dir: &Path, manifest: bool) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.into_iter().all(|e| {
        let Ok(e) = e else { return false };
        let name = e.file_name();
        let Some(name) = name.to_str() else {
            return false;
        };
        e.file_type().is_ok_and(|t| t.is_file())
            && (rank_of_file(name).is_some()
                || (manifest && name == MANIFEST)
                || osdp_core::input::is_temp_name_of(name, MANIFEST))
    })
}

/// Check a checkpoint's manifest (its checksum, one file per rank) and files (sizes and
/// CRC-32) without loading tensors.
pub fn verify(dir: &Path) -> Result<Manifest, CheckpointError> {
    let mpath = dir.join(MANIFEST);
    if !mpath.exists() {
        return Err(err(
            dir,
            "has no manifest.json (incomplete or not a checkpoint)",
        ));
    }
    let m = read_manifest(&mpath)?;
    if m.version >= 2 || m.manifest_crc32.is_some() {
        let actual = m.checksum();
        match m.manifest_crc32 {
            Some(said) if said == actual => {}
            Some(said) => {
                return Err(err(
                    &mpath,
                    format!(
                        "does not match its checksum (edited or damaged): its content has \
                         CRC-32 {actual:08x}, it says {said:08x}"
                    ),
                ))
            }
            None => {
                return Err(err(
                    &mpath,
                    "has no manifest_crc32 (required since version 2)",
                ))
            }
        }
    }
    m.check_files().map_err(|problem| err(&mpath, problem))?;
    m.check_fields().map_err(|problem| err(&mpath, problem))?;
    for f in &m.files {
        if f.name.contains('/') || f.name.contains("..") {
            return Err(err(
                &mpath,
                format!("lists file {:?} outside the checkpoint", f.name),
            ));
        }
        let path = dir.join(&f.name);
        if !path.exists() {
            return Err(err(&path, "is missing"));
        }
        let (bytes, crc) = crc_of(&path)?;
        if bytes != f.bytes || crc != f.crc32 {
            return Err(err(
                &path,
                format!(
                    "is corrupt: {bytes} bytes with CRC-32 {crc:08x}, the manifest says {} bytes with {:08x}",
                    f.bytes, f.crc32
                ),
            ));
        }
    }
    Ok(m)
}

/// Every parameter a checkpoint of `model` holds, by key, with its full shape: the model's
/// parameters but those tied to another (saved once, as their owner).
pub fn params_of(model: &ModelSpec) -> BTreeMap<String, Vec<i64>> {
    model
        .ops
        .iter()
        .flat_map(|op| {
            op.params
                .iter()
                .filter(|p| p.tied_to.is_none())
                .map(move |p| {
                    (
                        osdp_core::model::param_key(&op.id, &p.name),
                        p.shape.clone(),
                    )
                })
        })
        .collect()
}

/// The manifest at `path`, in any format version this build reads.
fn read_manifest(path: &Path) -> Result<Manifest, CheckpointError> {
    let text = osdp_core::input::read_text(path, osdp_core::input::MAX_INPUT_BYTES)
        .map_err(|e| err(path, e.to_string()))?;
    #[derive(Deserialize)]
    struct VersionOnly {
        version: u32,
    }
    // Parse under the version the file says when this build reads it; under the current one
    // otherwise, so that the message names both.
    let version = serde_json::from_str::<VersionOnly>(&text)
        .ok()
        .map(|v| v.version)
        .filter(|v| READABLE_VERSIONS.contains(v))
        .unwrap_or(CHECKPOINT_FORMAT_VERSION);
    osdp_core::input::parse_strict(path, &text, version).map_err(|e| err(path, e.to_string()))
}

/// Verify and load a checkpoint: every parameter's full value and AdamW moments.
pub fn load(dir: &Path) -> Result<(Manifest, HashMap<String, FullState>), CheckpointError> {
    let m = verify(dir)?;
    read_state(dir, m)
}

/// [`load`] for a run of `model`: the manifest is checked against the model (fingerprint,
/// every parameter's name and shape) before any state is allocated.
pub fn load_for(
    dir: &Path,
    model: &ModelSpec,
) -> Result<(Manifest, HashMap<String, FullState>), CheckpointError> {
    let m = verify(dir)?;
    m.check_model(model)
        .map_err(|problem| err(&dir.join(MANIFEST), problem))?;
    read_state(dir, m)
}

/// The state a verified manifest's files hold, each region placed once: a region outside its
/// tensor, or two that overlap, is refused (counts alone would let an overlap hide a gap).
fn read_state(
    dir: &Path,
    m: Manifest,
) -> Result<(Manifest, HashMap<String, FullState>), CheckpointError> {
    let mut full: HashMap<String, [Tensor; 3]> = m
        .params
        .iter()
        .map(|(k, shape)| {
            let z = || Tensor::zeros(shape.as_slice(), (tch::Kind::Float, tch::Device::Cpu));
            (k.clone(), [z(), z(), z()])
        })
        .collect();
    // Every region placed, by tensor: checked for overlaps, then summed for coverage.
    let mut placed: HashMap<(String, Saved), Vec<Placement>> = HashMap::new();
    for f in &m.files {
        let path = dir.join(&f.name);
        let tensors = Tensor::read_safetensors(&path).map_err(|e| err(&path, e.to_string()))?;
        for (key, t) in tensors {
            let bad = || {
                err(
                    &path,
                    format!("holds a tensor with an unreadable key {key:?}"),
                )
            };
            let region = RegionKey::parse(&key).ok_or_else(bad)?;
            let target = full.get_mut(&region.param).ok_or_else(|| {
                err(
                    &path,
                    format!("holds {:?}, which the manifest does not list", region.param),
                )
            })?;
            let dest = &mut target[region.saved.index()];
            let block = match region.cols {
                None => dest.shallow_clone(),
                Some((s, l)) => {
                    let width = *dest.size().get(1).unwrap_or(&0);
                    if dest.dim() != 2 || s.checked_add(l).is_none_or(|end| end > width) {
                        return Err(bad());
                    }
                    dest.narrow(1, s, l)
                }
            };
            let (start, len) = region.flat;
            let numel = block.numel() as i64;
            if start.checked_add(len).is_none_or(|end| end > numel) || t.numel() as i64 != len {
                return Err(bad());
            }
            placed
                .entry((region.param.clone(), region.saved))
                .or_default()
                .push((region.cols, region.flat));
            let flat_block = block.contiguous().reshape([-1]);
            flat_block
                .narrow(0, start, len)
                .copy_(&t.reshape([-1]).to_kind(tch::Kind::Float));
            let mut block = block;
            block.copy_(&flat_block.reshape(block.size().as_slice()));
        }
    }
    for ((k, saved), regions) in &mut placed {
        if let Some(why) = overlap(regions) {
            return Err(err(
                dir,
                format!("places {why} of {k} ({}) twice", saved.as_str()),
            ));
        }
    }
    for (k, shape) in &m.params {
        let numel: i64 = shape.iter().product();
        for saved in Saved::ALL {
            let got: i64 = placed
                .get(&(k.clone(), saved))
                .map_or(0, |r| r.iter().map(|&(_, (_, len))| len).sum());
            if got != numel {
                return Err(err(
                    dir,
                    format!(
                        "covers {got} of {numel} values of {k} ({}): files are missing",
                        saved.as_str()
                    ),
                ));
            }
        }
    }
    let host = full
        .into_iter()
        .map(|(k, [p, mo, v])| {
            let values = |t: Tensor| Vec::<f32>::try_from(t.reshape([-1])).unwrap_or_default();
            let state = FullState {
                shape: p.size(),
                param: values(p),
                m: values(mo),
                v: values(v),
            };
            (k, state)
        })
        .collect();
    Ok((m, host))
}

/// Where a region sits: its column slice (`None`: the whole tensor) and its flat range in it.
type Placement = (Option<(i64, i64)>, (i64, i64));

/// The first overlap of `regions` (sorted here), in words: regions of one column slice must not
/// share elements, column slices must not share columns, and a whole-tensor region shares
/// with every other.
fn overlap(regions: &mut [Placement]) -> Option<String> {
    regions.sort();
    for pair in regions.windows(2) {
        let [(ca, (fa, la)), (cb, (fb, _))] = pair else {
            continue;
        };
        let clash = match (ca, cb) {
            (None, None) => fa + la > *fb,
            (Some(a), Some(b)) if a == b => fa + la > *fb,
            (Some((sa, wa)), Some((sb, _))) => sa + wa > *sb,
            // A whole-tensor region beside a column slice.
            _ => true,
        };
        if clash {
            return Some(match ca {
                Some((s, w)) => format!("columns {s}..{} (elements from {fb})", s + w),
                None => format!("elements {fb}..{}", fa + la),
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_that_share_elements_or_columns_are_an_overlap() {
        let whole = |a, n| (None, (a, n));
        let cols = |s, w, a, n| (Some((s, w)), (a, n));
        assert_eq!(overlap(&mut [whole(0, 4), whole(4, 4)]), None, "adjacent");
        assert!(
            overlap(&mut [whole(4, 4), whole(0, 5)]).is_some(),
            "shared element 4"
        );
        assert_eq!(
            overlap(&mut [cols(0, 2, 0, 6), cols(2, 2, 0, 6), cols(0, 2, 6, 2)]),
            None,
            "two slices, one in two pieces"
        );
        assert!(
            overlap(&mut [cols(0, 3, 0, 6), cols(2, 2, 0, 4)]).is_some(),
            "column 2"
        );
        assert!(overlap(&mut [whole(0, 8), cols(0, 2, 0, 4)]).is_some());
    }

    #[test]
    fn a_region_key_reads_back_as_written() {
        for key in [
            RegionKey {
                param: "h0.attn.c_attn.weight".into(),
                saved: Saved::ExpAvgSq,
                cols: Some((64, 32)),
                flat: (0, 2048),
            },
            RegionKey {
                param: "wte.weight".into(),
                saved: Saved::Param,
                cols: None,
                flat: (96, 1),
            },
        ] {
            let text = key.to_string();
            assert_eq!(RegionKey::parse(&text), Some(key), "{text}");
        }
        assert_eq!(
            RegionKey {
                param: "ln_f.bias".into(),
                saved: Saved::ExpAvg,
                cols: None,
                flat: (3, 5),
            }
            .to_string(),
            "ln_f.bias|exp_avg|-|3:5"
        );
    }

    #[test]
    fn only_names_the_trainer_writes_are_read_as_steps_and_ranks() {
        assert_eq!(step_of_dir(&step_dir_name(7)), Some(7));
        assert_eq!(step_of_dir(&step_dir_name(123_456_789)), Some(123_456_789));
        for other in [
            "step-7",
            "step-0000007",
            "step-+0000007",
            "step-00000007-old",
            "step-",
        ] {
            assert_eq!(step_of_dir(other), None, "{other}");
        }
        assert_eq!(rank_of_file(&rank_file_name(3)), Some(3));
        for other in [
            "rank-3.safetensors",
            "rank-+0003.safetensors",
            "rank-00003.st",
        ] {
            assert_eq!(rank_of_file(other), None, "{other}");
        }
    }

    #[test]
    fn a_key_that_is_not_a_region_is_refused() {
        for bad in [
            "",
            "w|param|-",
            "w|param|-|0:4|extra",
            "w|momentum|-|0:4",
            "w|param|-|0:0",
            "w|param|-|-1:4",
            "w|param|x|0:4",
            "w|param|0:-3|0:4",
            "w|param|-|04",
        ] {
            assert_eq!(RegionKey::parse(bad), None, "{bad:?}");
        }
    }
}
