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

/// `osdp-tui ARGS` in `dir`, which must succeed; its stdout.
fn run_ok(dir: &Path, args: &[&str]) -> String {
    let out = crate::osdp().current_dir(dir).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
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

/// Run `python -c CODE ARGS…` with the test Python; its stdout.
fn python(code: &str, args: &[&Path]) -> String {
    let python = std::env::var_os("OSDP_TEST_PYTHON").expect("set where tiny_models ran");
    let out = std::process::Command::new(python)
        .arg("-c")
        .arg(code)
        .args(args)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether two safetensors checkpoint directories hold the same tensors, bit for bit.
const SAME_TENSORS: &str = "
import sys
from safetensors.torch import load_file
a = load_file(sys.argv[1] + '/model.safetensors')
b = load_file(sys.argv[2] + '/model.safetensors')
print(sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
      and bool((a[k].view(-1).view_as(a[k]) == b[k]).all()) for k in a))
";

/// `--init-from A`, nothing trained, `export-hf` to B: every tensor of B is A's, bit for bit
/// (GPT-2's transposed Conv1D weights included), through the trainer's own checkpoint.
#[test]
fn issue_33_weights_loaded_and_exported_untrained_are_bit_exact() {
    let Some(dir) = tiny_models() else { return };
    for family in FAMILIES {
        let r = reference(dir, family);
        let model = imported(dir, family, r.seq);
        let a = dir.join(family);
        let weights = osdp_train::hf_weights::HfWeights::open(&a, &model).unwrap();
        let b = tempfile::tempdir().unwrap();
        let value = |key: &str| {
            let t = weights.read(key).ok()?;
            Some((t.size(), Vec::<f32>::try_from(t.flatten(0, -1)).ok()?))
        };
        let out = b.path().join("out");
        osdp_train::hf_weights::export(&model, &value, &out, 5_000_000_000).unwrap();
        assert_eq!(
            python(SAME_TENSORS, &[&a, &out]).trim(),
            "True",
            "{family}: the exported tensors differ from the loaded ones"
        );
    }
}

/// The whole path a user takes: import-hf, plan, train from the Hugging Face weights on two
/// ranks, export-hf; transformers loads the export with no missing or unexpected keys and its
/// loss on the same samples is our eval's. A small shard size makes it write shards with an
/// index, which transformers reads too.
#[test]
fn issue_33_trained_export_loads_in_transformers_with_our_loss() {
    let Some(dir) = tiny_models() else { return };
    let r = reference(dir, "llama");
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let tokens: Vec<u8> = r.tokens.iter().map(|&t| t as u8).collect();
    std::fs::write(w.join("tokens.txt"), &tokens).unwrap();
    let run = |args: &[&str]| run_ok(w, args);
    let hf = dir.join("llama");
    let hf = hf.to_str().unwrap();
    let config = format!("{hf}/config.json");
    run(&["import-hf", &config, "--seq-len", "16", "-o", "m.json"]);
    // A mix: zero3 split in two, zero2, dp and the rest as the planner likes.
    run(&[
        "plan",
        "m.json",
        "--layout",
        "cpu",
        "--batch",
        "2",
        "-o",
        "p.json",
        "--pin",
        "layers0.mlp.up_proj=zero3/2:2",
        "--pin",
        "lm_head=zero2",
        "--pin",
        "embed_tokens=dp",
    ]);
    run(&[
        "train",
        "m.json",
        "--plan",
        "p.json",
        "--world-size",
        "2",
        "--init-from",
        hf,
        "--data",
        "tokens.txt",
        "--steps",
        "2",
        "--checkpoint-dir",
        "ck",
    ]);
    run(&[
        "export-hf",
        "m.json",
        "ck",
        "-o",
        "out",
        "--max-shard-size",
        "40KiB",
    ]);
    assert!(
        w.join("out/model.safetensors.index.json").is_file(),
        "sharded"
    );
    let ours: serde_json::Value = serde_json::from_str(&run(&[
        "eval",
        "m.json",
        "--init-from",
        "ck",
        "--data",
        "tokens.txt",
        "--json",
    ]))
    .unwrap();
    let theirs = python(
        "
import sys, torch, transformers as tf, torch.nn.functional as F
m, info = tf.AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)
assert not info['missing_keys'] and not info['unexpected_keys'], info
t = torch.tensor(list(open(sys.argv[2], 'rb').read()))
S, losses = 16, []
with torch.no_grad():
    for i in range((len(t) - 1) // S):
        w = t[i * S : i * S + S + 1]
        losses.append(F.cross_entropy(m(input_ids=w[:-1].unsqueeze(0)).logits[0], w[1:]).item())
print(sum(losses) / len(losses))
",
        &[&w.join("out"), &w.join("tokens.txt")],
    );
    let theirs: f64 = theirs.trim().parse().unwrap();
    let ours = ours["loss"].as_f64().unwrap();
    assert!(
        ((ours - theirs) / theirs).abs() < 1e-5,
        "our eval {ours}, transformers {theirs}"
    );
    assert!(
        (ours - r.loss).abs() > 1e-6,
        "two steps changed the weights"
    );
}

/// Each way a Hugging Face checkpoint can be wrong is refused before training, exit 2, in one
/// line that names the problem.
#[test]
fn issue_33_bad_hugging_face_checkpoints_are_refused_in_one_line() {
    let Some(dir) = tiny_models() else { return };
    let bad = tempfile::tempdir().unwrap();
    let python_bin = std::env::var_os("OSDP_TEST_PYTHON").unwrap();
    let made = std::process::Command::new(python_bin)
        .arg(root().join("tests/hf/bad_checkpoints.py"))
        .arg(dir.join("gpt2"))
        .arg(bad.path().join("bad"))
        .status()
        .unwrap();
    assert!(made.success());
    let w = tempfile::tempdir().unwrap();
    let config = dir.join("gpt2/config.json");
    let ok = crate::osdp()
        .current_dir(w.path())
        .args(["import-hf"])
        .arg(&config)
        .args(["--seq-len", "16", "-o", "m.json"])
        .output()
        .unwrap();
    assert!(ok.status.success());
    let ok = crate::osdp()
        .current_dir(w.path())
        .args(["plan", "m.json", "--layout", "cpu", "-o", "p.json"])
        .output()
        .unwrap();
    assert!(ok.status.success());
    for (case, says) in [
        ("missing", "is missing"),
        (
            "unexpected",
            "unexpected tensor \"transformer.h.0.attn.c_extra.weight\"",
        ),
        ("shape", "has shape [32, 127], the model needs [32, 128]"),
        ("truncated", "not a valid safetensors file"),
        ("corrupt-header", "not a valid safetensors file"),
        ("pickle", "convert them"),
        ("config", "`ffn_hidden` is 136 there and 128"),
    ] {
        let out = crate::osdp_bounded()
            .current_dir(w.path())
            .args([
                "train",
                "m.json",
                "--plan",
                "p.json",
                "--steps",
                "1",
                "--init-from",
            ])
            .arg(bad.path().join("bad").join(case))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{case}: {err}");
        assert_eq!(err.lines().count(), 1, "{case}: {err}");
        assert!(err.contains(says), "{case}: {err}");
    }
}

/// One AdamW step from loaded weights on two ranks, under a plan mixing zero3 split in two,
/// zero3, zero2, dp and a recomputed block, gives the parameters `torch.optim.AdamW` gives on
/// the transformers model (same batch, lr, betas, eps, weight decay; no warm-up, no clipping),
/// for every family.
#[test]
fn issue_33_one_adamw_step_from_loaded_weights_equals_torch() {
    let Some(dir) = tiny_models() else { return };
    for family in FAMILIES {
        one_adamw_step(dir, family);
    }
}

fn one_adamw_step(dir: &Path, family: &str) {
    use osdp_core::model::OpKind;
    use osdp_train::data::{Sampler, Source};
    use osdp_train::exec::OptimConfig;
    use osdp_train::hf_weights::HfWeights;
    use osdp_train::TrainConfig;
    use std::sync::atomic::AtomicBool;

    let r = reference(dir, family);
    let model = imported(dir, family, r.seq);
    let w = tempfile::tempdir().unwrap();
    std::fs::write(
        w.path().join("m.json"),
        serde_json::to_string(&model).unwrap(),
    )
    .unwrap();
    // Pins by kind: the first block linear split in two and sharded, the second zero3, the
    // head zero2 (or, tied, the embedding dp), the last block recomputed.
    let linears: Vec<&str> = model
        .ops
        .iter()
        .filter(|o| o.kind == OpKind::Linear && o.block.is_some())
        .map(|o| o.id.as_str())
        .collect();
    let embed = model
        .ops
        .iter()
        .find(|o| o.kind == OpKind::Embedding)
        .unwrap();
    let pins = [
        format!("{}=zero3/2:2", linears[0]),
        format!("{}=zero3", linears[1]),
        format!("{}=zero2", linears[2]),
        format!("{}=dp", embed.id),
    ];
    let mut cmd = crate::osdp();
    cmd.current_dir(w.path())
        .args([
            "plan", "m.json", "--layout", "cpu", "--batch", "2", "-o", "p.json",
        ])
        .args(["--recompute-block", "1=on"]);
    for p in &pins {
        cmd.args(["--pin", p]);
    }
    let planned = cmd.output().unwrap();
    assert!(planned.status.success(), "{family}: {planned:?}");
    let plan = osdp_core::plan::read_plan(&w.path().join("p.json"), &model).unwrap();
    assert!(plan.recompute[1], "{family}: block 1 recomputes");
    let optim = OptimConfig {
        lr: 3e-3,
        warmup_steps: 0,
        clip_norm: 0.0,
        ..OptimConfig::default()
    };
    let tokens: Vec<u8> = r.tokens.iter().map(|&t| t as u8).collect();
    let source = Source::Text {
        name: "tokens".into(),
        bytes: std::sync::Arc::new(tokens),
    };
    let global_batch = 4;
    let cfg = TrainConfig {
        plan,
        world_size: 2,
        ranks_per_node: None,
        global_batch,
        steps: 1,
        seed: 5,
        source: source.clone(),
        optim,
        target: osdp_train::exec::Target::CPU,
        checkpoint_dir: None,
        checkpoint_every: 0,
        resume_from: None,
        init_from: Some(HfWeights::open(&dir.join(family), &model).unwrap()),
        eval: None,
        collect_params: true,
        membership: None,
        model: model.clone(),
    };
    let ours = osdp_train::train(&cfg, &AtomicBool::new(false), |_| {})
        .unwrap_or_else(|e| panic!("{family}: {e}"));
    let batch = Sampler {
        source,
        seed: 5,
        seq: r.seq,
        vocab: model.config.vocab_size,
    }
    .batch(0, 0, global_batch as usize);
    let step = serde_json::json!({
        "rows": batch.rows, "seq": batch.seq, "inputs": batch.inputs, "labels": batch.labels,
        "lr": optim.lr, "beta1": optim.beta1, "beta2": optim.beta2, "eps": optim.eps,
        "weight_decay": optim.weight_decay,
    });
    std::fs::write(w.path().join("step.json"), step.to_string()).unwrap();
    let theirs_dir = w.path().join("torch");
    let loss = python(
        &std::fs::read_to_string(root().join("tests/hf/adamw_step.py")).unwrap(),
        &[&dir.join(family), &w.path().join("step.json"), &theirs_dir],
    );
    let loss: f64 = loss.trim().parse().unwrap();
    assert!(
        ((ours.losses[0] - loss) / loss).abs() < 1e-5,
        "{family}: loss {} here, {loss} in torch",
        ours.losses[0]
    );
    let start = HfWeights::open(&dir.join(family), &model).unwrap();
    let theirs = HfWeights::open(&theirs_dir, &model).unwrap();
    let owned = model
        .ops
        .iter()
        .flat_map(|o| &o.params)
        .filter(|p| p.tied_to.is_none());
    assert_eq!(
        ours.final_params.len(),
        owned.count(),
        "{family}: every parameter"
    );
    for (key, value) in &ours.final_params {
        let t = theirs.read(key).unwrap();
        let worst = (value - &t).abs().max().double_value(&[]);
        let moved = (value - &start.read(key).unwrap())
            .abs()
            .max()
            .double_value(&[]);
        assert!(
            worst < 1e-5,
            "{family}: {key} differs from torch by {worst}"
        );
        // A key bias adds the same to every score of a query: softmax ignores it, and its
        // gradient is zero (in torch too).
        if !key.ends_with("k_proj.bias") {
            assert!(
                moved > 1e-4,
                "{family}: {key}: the step moved it by only {moved}"
            );
        }
    }
}

/// bf16 and fp16 files load as the same weights rounded to that format: each tensor read is
/// exactly the fp32 checkpoint's value rounded, and the loss moves only by the rounding.
#[test]
fn issue_33_bf16_and_fp16_checkpoints_load_as_their_rounded_weights() {
    use osdp_train::hf_weights::HfWeights;
    use osdp_train::tch::Kind;
    let Some(dir) = tiny_models() else { return };
    let r = reference(dir, "llama");
    let model = imported(dir, "llama", r.seq);
    let full = HfWeights::open(&dir.join("llama"), &model).unwrap();
    for (name, kind) in [("llama-bf16", Kind::BFloat16), ("llama-fp16", Kind::Half)] {
        let narrow = HfWeights::open(&dir.join(name), &model).unwrap();
        for op in &model.ops {
            for p in &op.params {
                let key = osdp_core::model::param_key(&op.id, &p.name);
                let want = full.read(&key).unwrap().to_kind(kind).to_kind(Kind::Float);
                let got = narrow.read(&key).unwrap();
                assert!(got.equal(&want), "{name}: {key} is not the rounded weight");
            }
        }
        let weights = Weights::open(&dir.join(name), &model).unwrap();
        let mut exec = eval::executor(&model, &weights, 3, Target::CPU).unwrap();
        let loss = eval::evaluate(&mut exec, &r.tokens, r.samples, 3, |_| {})
            .unwrap()
            .loss;
        assert!(
            (loss - r.loss).abs() < 0.05 && loss != r.loss,
            "{name}: loss {loss} against {} in fp32",
            r.loss
        );
    }
}

/// A JSON-lines file tokenized with the model's tokenizer.json (documents joined by its
/// end-of-text token) gives `eval` the ids the `tokenizers` library gives: the loss equals
/// transformers' on those ids. Training on it reports held-out losses that `status` shows.
#[test]
fn issue_33_tokenized_documents_evaluate_and_train_with_held_out_loss() {
    let Some(dir) = tiny_models() else { return };
    let r = reference(dir, "llama");
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenized.json")).unwrap())
            .unwrap();
    let w = tempfile::tempdir().unwrap();
    let model = imported(dir, "llama", r.seq);
    std::fs::write(
        w.path().join("m.json"),
        serde_json::to_string(&model).unwrap(),
    )
    .unwrap();
    let run = |args: &[&str]| run_ok(w.path(), args);
    let (hf, docs, tok) = (
        dir.join("llama"),
        dir.join("docs.jsonl"),
        dir.join("tokenizer.json"),
    );
    let (hf, docs, tok) = (
        hf.to_str().unwrap(),
        docs.to_str().unwrap(),
        tok.to_str().unwrap(),
    );
    let ours: serde_json::Value = serde_json::from_str(&run(&[
        "eval",
        "m.json",
        "--init-from",
        hf,
        "--data",
        docs,
        "--tokenizer",
        tok,
        "--json",
    ]))
    .unwrap();
    assert_eq!(ours["samples"], want["samples"]);
    let (ours, theirs) = (
        ours["loss"].as_f64().unwrap(),
        want["loss"].as_f64().unwrap(),
    );
    assert!(
        ((ours - theirs) / theirs).abs() < 1e-5,
        "{ours} vs {theirs}"
    );

    run(&[
        "plan", "m.json", "--layout", "cpu", "--batch", "2", "-o", "p.json",
    ]);
    std::fs::create_dir(w.path().join("run")).unwrap();
    let err = {
        let out = crate::osdp()
            .current_dir(w.path())
            .args([
                "train",
                "m.json",
                "--plan",
                "p.json",
                "--world-size",
                "2",
                "--steps",
                "3",
            ])
            .args(["--init-from", hf, "--data", docs, "--tokenizer", tok])
            .args([
                "--eval-data",
                docs,
                "--eval-every",
                "2",
                "--eval-samples",
                "8",
            ])
            .args(["--metrics", "run/metrics.jsonl"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(err.contains("step 2: eval loss"), "{err}");
    assert!(err.contains("step 3: eval loss"), "{err}");
    let status = run(&["status", "run"]);
    assert!(status.contains("held-out loss"), "{status}");
    let metrics = std::fs::read_to_string(w.path().join("run/metrics.jsonl")).unwrap();
    let evals: Vec<serde_json::Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "eval")
        .collect();
    assert_eq!(evals.len(), 2, "{metrics}");
    assert_eq!(evals[0]["samples"], 8);
    // The first held-out loss is of the weights after two steps, near the loaded model's.
    let first = evals[0]["loss"].as_f64().unwrap();
    assert!((first - theirs).abs() < 0.1, "{first} vs {theirs}");
}

/// Pre-tokenized data: llm.c's .bin (header, uint16 tokens) reads as its tokens (the loss
/// equals the same tokens as text bytes), and a token beyond the vocabulary is refused with
/// its position.
#[test]
fn issue_33_llm_c_binaries_read_as_tokens_and_out_of_vocabulary_is_refused() {
    let Some(dir) = tiny_models() else { return };
    let r = reference(dir, "llama");
    let w = tempfile::tempdir().unwrap();
    let model = imported(dir, "llama", r.seq);
    std::fs::write(
        w.path().join("m.json"),
        serde_json::to_string(&model).unwrap(),
    )
    .unwrap();
    let write_bin = |name: &str, tokens: &[i64]| {
        let mut header = vec![0i32; 256];
        header[0] = 20240520;
        header[1] = 1;
        header[2] = tokens.len() as i32;
        let mut bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
        bytes.extend(tokens.iter().flat_map(|&t| (t as u16).to_le_bytes()));
        std::fs::write(w.path().join(name), bytes).unwrap();
    };
    write_bin("ok.bin", &r.tokens);
    let mut bad = r.tokens.clone();
    bad[17] = 4000;
    write_bin("bad.bin", &bad);
    let hf = dir.join("llama");
    let eval = |data: &str| {
        crate::osdp()
            .current_dir(w.path())
            .args(["eval", "m.json", "--data", data, "--json", "--init-from"])
            .arg(&hf)
            .output()
            .unwrap()
    };
    let ok = eval("ok.bin");
    assert!(ok.status.success(), "{ok:?}");
    let v: serde_json::Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert!(
        (v["loss"].as_f64().unwrap() - r.loss).abs() / r.loss < 1e-5,
        "{v}"
    );
    let bad = eval("bad.bin");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{err}");
    assert!(err.contains("token 4000 at position 17"), "{err}");
}

/// The dashboard's runs start from `--init-from` on `--data` with held-out losses every
/// `--eval-every` steps: the training panel names them and shows the latest held-out loss.
#[test]
fn issue_33_dashboard_runs_train_from_hugging_face_weights_with_held_out_loss() {
    use osdp_tui::supervisor::{LaunchSpec, RunData};
    use osdp_tui::tui::app::{App, RunControl};
    use std::time::{Duration, Instant};

    let Some(dir) = tiny_models() else { return };
    let r = reference(dir, "llama");
    let w = tempfile::tempdir().unwrap();
    let model = imported(dir, "llama", r.seq);
    let model_path = w.path().join("m.json");
    std::fs::write(&model_path, serde_json::to_string(&model).unwrap()).unwrap();
    let tokens: Vec<u8> = r.tokens.iter().map(|&t| t as u8).collect();
    let data = w.path().join("tokens.txt");
    std::fs::write(&data, tokens).unwrap();
    let data = data.to_str().unwrap().to_string();
    let layout = osdp_core::cluster::read_layout(&root().join("layouts/cpu.json")).unwrap();
    let mut app = App::new(model, layout, vec![1 << 30; 2], 8);
    app.request.batch = Some(2);
    let launch = LaunchSpec {
        exe: assert_cmd::cargo::cargo_bin("osdp-tui"),
        model: model_path,
        checkpoint_every: 50,
        hang_after: Duration::from_secs(120),
        data: RunData {
            init_from: Some(dir.join("llama")),
            data: Some(data.clone()),
            tokenizer: None,
            eval_data: Some(data),
            eval_every: Some(1),
        },
    };
    let mut app = app.with_run_control(RunControl::new(launch, w.path().join("run")));
    app.replan();
    let key = osdp_tui::tui::action_for(
        crossterm::event::KeyCode::Char('s'),
        crossterm::event::KeyModifiers::NONE,
    )
    .unwrap();
    app.update(key);
    let deadline = Instant::now() + Duration::from_secs(90);
    let screen = loop {
        app.poll_background();
        let screen = osdp_tui::tui::render_text(&app, 160, 50);
        if screen.contains("held-out loss") {
            break screen;
        }
        assert!(Instant::now() < deadline, "no held-out loss:\n{screen}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let data_line = format!("from {} · data", dir.join("llama").display());
    assert!(screen.contains(&data_line), "{screen}");
    app.update(
        osdp_tui::tui::action_for(
            crossterm::event::KeyCode::Char('x'),
            crossterm::event::KeyModifiers::NONE,
        )
        .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while app
        .run_control
        .as_ref()
        .and_then(|t| t.supervisor.as_ref())
        .is_some_and(|s| s.is_live())
    {
        app.poll_background();
        assert!(Instant::now() < deadline, "the run did not stop");
        std::thread::sleep(Duration::from_millis(50));
    }
}
