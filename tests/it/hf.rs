//! Hugging Face weights in and out, proven against transformers itself: tiny random models of
//! every family the trainer runs, made and measured by `tests/hf/tiny_models.py` with the
//! pinned transformers in `.venv` (scripts/test.sh installs it and sets OSDP_TEST_PYTHON).

use std::path::Path;
use std::sync::OnceLock;

use osdp_core::model::hf::{import_file, ImportOptions};
use osdp_core::model::ModelSpec;
use osdp_train::eval::{self, Weights};
use osdp_train::exec::Target;

use crate::root;

pub const FAMILIES: [&str; 5] = ["gpt2", "opt", "llama", "mistral", "qwen2"];

/// The tiny models and transformers' figures on them, made once per test run; `None` (and a
/// note) where no Python with transformers is configured.
pub fn tiny_models() -> Option<&'static Path> {
    static DIR: OnceLock<Option<tempfile::TempDir>> = OnceLock::new();
    DIR.get_or_init(|| {
        let Some(python) = std::env::var_os("OSDP_TEST_PYTHON") else {
            eprintln!("OSDP_TEST_PYTHON is not set (scripts/test.sh sets it): skipping");
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new(python)
            .arg(root().join("tests/hf/tiny_models.py"))
            .arg(dir.path())
            .output()
            .expect("python runs");
        assert!(
            out.status.success(),
            "tiny_models.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(dir)
    })
    .as_ref()
    .map(|d| d.path())
}

/// transformers' figures for one family.
pub struct Reference {
    pub seq: usize,
    pub tokens: Vec<i64>,
    pub samples: usize,
    pub loss: f64,
    pub logits0: Vec<f32>,
}

pub fn reference(dir: &Path, family: &str) -> Reference {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{family}.json"))).unwrap())
            .unwrap();
    Reference {
        seq: v["seq"].as_u64().unwrap() as usize,
        tokens: v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_i64().unwrap())
            .collect(),
        samples: v["samples"].as_u64().unwrap() as usize,
        loss: v["loss"].as_f64().unwrap(),
        logits0: v["logits0"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_f64().unwrap() as f32)
            .collect(),
    }
}

/// The model description `import-hf` makes of a family's config, at the reference's length.
pub fn imported(dir: &Path, family: &str, seq: usize) -> ModelSpec {
    let opts = ImportOptions {
        seq_len: Some(seq as u64),
        ..Default::default()
    };
    import_file(&dir.join(family).join("config.json"), &opts).expect("imports")
}

#[test]
fn issue_33_eval_of_loaded_weights_equals_transformers_for_every_family() {
    let Some(dir) = tiny_models() else { return };
    for family in FAMILIES {
        let r = reference(dir, family);
        let model = imported(dir, family, r.seq);
        let weights =
            Weights::open(&dir.join(family), &model).unwrap_or_else(|e| panic!("{family}: {e}"));
        let mut exec = eval::executor(&model, &weights, 3, Target::CPU).unwrap();
        let ours = eval::evaluate(&mut exec, &r.tokens, r.samples, 3, |_| {}).unwrap();
        let rel = (ours.loss - r.loss).abs() / r.loss.abs();
        assert!(
            rel < 1e-5,
            "{family}: loss {} here, {} in transformers",
            ours.loss,
            r.loss
        );
        let logits = eval::logits(&mut exec, &r.tokens, 0).unwrap();
        let logits = Vec::<f32>::try_from(logits.flatten(0, -1)).unwrap();
        assert_eq!(logits.len(), r.logits0.len(), "{family}");
        let worst = logits
            .iter()
            .zip(&r.logits0)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        eprintln!(
            "{family}: loss {} (transformers {}), logits within {worst}",
            ours.loss, r.loss
        );
        assert!(worst < 1e-4, "{family}: logits differ by up to {worst}");
    }
}
