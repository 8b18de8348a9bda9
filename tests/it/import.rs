//! Hugging Face import: parameter counts equal transformers' `num_parameters()`, and the shipped
//! samples are exactly what `import-hf` makes of the configs beside them.

use crate::{inspect_json, osdp, root, stdout_ok};

/// Figures from the issue (transformers' `num_parameters()`, tied weights counted once).
const SAMPLE_PARAMS: &[(&str, u64)] = &[
    ("gpt2", 124_439_808),
    ("gpt2-medium", 354_823_168),
    ("gpt2-large", 774_030_080),
    ("gpt2-xl", 1_557_611_200),
    ("opt-1.3b", 1_315_758_080),
    ("llama-2-7b", 6_738_415_616),
    ("llama-2-13b", 13_015_864_320),
    ("llama-3-8b", 8_030_261_248),
    ("bert-large-uncased", 335_174_458),
];

#[test]
fn samples_report_hugging_face_parameter_counts() {
    for (name, params) in SAMPLE_PARAMS {
        let s = inspect_json(&root().join(format!("sample-models/{name}.json")));
        assert_eq!(s["params"].as_u64(), Some(*params), "{name}");
        assert_eq!(s["name"].as_str(), Some(*name));
        assert!(s["ops"].as_u64().unwrap() > 0 && s["layers"].as_u64().unwrap() > 0);
    }
}

/// Configs not shipped as samples, with transformers 5.23's `num_parameters()` for each
/// (measured by building the model class from the config on the meta device).
const EXTRA_PARAMS: &[(&str, u64)] = &[
    ("distilgpt2", 81_912_576),
    ("opt-125m", 125_239_296),
    ("opt-350m", 331_196_416),
    ("opt-2.7b", 2_651_596_800),
    ("opt-13b", 12_853_473_280),
    ("bert-base-uncased", 109_514_298),
    ("tinyllama-1.1b-chat-v1.0", 1_100_048_384),
    ("mistral-7b-v0.1", 7_241_732_096),
    ("qwen2.5-0.5b", 494_032_768),
    ("qwen2-7b", 7_615_616_512),
    ("llama-3.2-1b", 1_235_814_400),
];

#[test]
fn other_public_configs_import_with_hugging_face_counts() {
    let dir = tempfile::tempdir().unwrap();
    for (name, params) in EXTRA_PARAMS {
        let out = dir.path().join(format!("{name}.json"));
        let run = osdp()
            .args([
                "import-hf",
                &format!("tests/data/hf-extra/{name}.json"),
                "--seq-len",
                "256",
                "-o",
            ])
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let s = inspect_json(&out);
        assert_eq!(s["params"].as_u64(), Some(*params), "{name}");
        assert_eq!(s["seq_len"].as_u64(), Some(256), "{name}");
    }
}

/// The committed samples are exactly what `scripts/regen-samples.sh` makes of the configs.
#[test]
fn samples_are_regenerated_from_their_configs() {
    let manifest = std::fs::read_to_string(root().join("sample-models/MANIFEST.tsv")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for line in manifest
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let mut fields = line.split('\t');
        let (name, config) = (fields.next().unwrap(), fields.next().unwrap());
        let flags: Vec<&str> = fields.next().unwrap_or("").split_whitespace().collect();
        let out = dir.path().join(format!("{name}.json"));
        let run = osdp()
            .args([
                "import-hf",
                &format!("sample-models/hf/{config}"),
                "--name",
                name,
            ])
            .args(&flags)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let fresh = std::fs::read_to_string(&out).unwrap();
        let committed =
            std::fs::read_to_string(root().join(format!("sample-models/{name}.json"))).unwrap();
        assert!(
            fresh == committed,
            "sample-models/{name}.json is stale: run scripts/regen-samples.sh"
        );
        checked += 1;
    }
    let samples = std::fs::read_dir(root().join("sample-models"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "json")
        })
        .count();
    assert_eq!(checked, samples, "every sample is listed in MANIFEST.tsv");
}

#[test]
fn paper_and_tiny_samples_have_the_intended_shapes() {
    let opt8 = inspect_json(&root().join("sample-models/opt-30b-8layers.json"));
    assert_eq!(
        (
            opt8["layers"].as_u64(),
            opt8["hidden"].as_u64(),
            opt8["seq_len"].as_u64()
        ),
        (Some(8), Some(7168), Some(512))
    );
    for (name, hidden) in [("osdp-gpt-48x1536", 1536), ("osdp-gpt-48x2048", 2048)] {
        let s = inspect_json(&root().join(format!("sample-models/{name}.json")));
        assert_eq!(
            (s["layers"].as_u64(), s["hidden"].as_u64()),
            (Some(48), Some(hidden)),
            "{name}"
        );
    }
    // The tiny models train on a CPU in seconds: under a million parameters, a few MiB of
    // activations per sample. transformers counts 842,496 and 803,968.
    for (name, params) in [("tiny-gpt2", 842_496), ("tiny-llama", 803_968)] {
        let s = inspect_json(&root().join(format!("sample-models/{name}.json")));
        assert_eq!(s["params"].as_u64(), Some(params), "{name}");
        assert!(
            s["saved_activation_bytes_per_sample"].as_u64().unwrap() < 8 << 20,
            "{name}"
        );
    }
}

#[test]
fn every_layout_reads_and_says_where_its_figures_come_from() {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(root().join("layouts")).unwrap() {
        let path = entry.unwrap().path();
        let out = osdp()
            .args(["layout", "--json"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let l: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(l["device"]["memory_gib"]["source"]
            .as_str()
            .is_some_and(|s| !s.is_empty()));
        names.push(l["name"].as_str().unwrap().to_string());
    }
    names.sort();
    for want in [
        "osdp-paper-8x-titan-rtx-pcie3",
        "a100-80gb-8x-nvlink",
        "h100-sxm-8x-nvlink",
        "h100-sxm-2x8-ib-ndr",
        "h100-1x",
        "h200-1x",
        "rtx4090-4x-pcie",
        "cpu",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "missing layout {want}; have {names:?}"
        );
    }
}

/// Issue 19: `import-hf` names the model from the config (`_name_or_path`), or its directory
/// when the file is the usual `config.json`, and says which sequence length it chose.
#[test]
fn import_names_the_model_from_its_config_and_says_the_sequence_length() {
    let tmp = tempfile::tempdir().unwrap();
    let base = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 688, "num_attention_heads": 4, "num_hidden_layers": 2,
        "max_position_embeddings": 1024, "vocab_size": 1000, "rms_norm_eps": 1e-5
    });
    let run = |config: &serde_json::Value, dir: &str, extra: &[&str]| -> String {
        let d = tmp.path().join(dir);
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("config.json");
        std::fs::write(&path, config.to_string()).unwrap();
        let out = d.join("m.json");
        let said = stdout_ok(
            osdp()
                .args([
                    "import-hf",
                    path.to_str().unwrap(),
                    "-o",
                    out.to_str().unwrap(),
                ])
                .args(extra),
        );
        let m = osdp_core::model::read_model(&out).unwrap();
        format!("{} | {said}", m.name)
    };
    let mut named = base.clone();
    named["_name_or_path"] = "my-org/tiny-llama-x".into();
    let said = run(&named, "a", &[]);
    assert!(said.starts_with("tiny-llama-x | "), "{said}");
    assert!(
        said.contains("sequence length 1024 (the config's positions"),
        "{said}"
    );
    let said = run(&base, "Mistral-mini", &["--seq-len", "512"]);
    assert!(said.starts_with("Mistral-mini | "), "{said}");
    assert!(said.trim_end().ends_with("sequence length 512"), "{said}");
}

/// GPT-2's own `gelu_new` is eight PyTorch ops in transformers: an import for PyTorch's eager
/// modules records it and `inspect` says so; the fused tanh GELU and osdp's kernels do not.
#[test]
fn inspect_says_when_transformers_writes_the_gelu_as_separate_ops() {
    let tmp = tempfile::tempdir().unwrap();
    let said = |activation: &str, kernels: &str| -> String {
        let config = tmp
            .path()
            .join(format!("{activation}-{kernels}.config.json"));
        let model = tmp.path().join(format!("{activation}-{kernels}.json"));
        std::fs::write(
            &config,
            serde_json::json!({"architectures": ["GPT2LMHeadModel"], "n_embd": 64,
                "n_layer": 1, "n_head": 4, "n_positions": 32, "vocab_size": 100,
                "activation_function": activation})
            .to_string(),
        )
        .unwrap();
        stdout_ok(
            osdp()
                .arg("import-hf")
                .arg(&config)
                .args(["--kernels", kernels, "-o"])
                .arg(&model),
        );
        stdout_ok(osdp().arg("inspect").arg(&model))
    };
    let separate = "GELU as separate PyTorch ops";
    assert!(said("gelu_new", "pytorch").contains(separate));
    assert!(!said("gelu_pytorch_tanh", "pytorch").contains(separate));
    assert!(!said("gelu_new", "osdp").contains(separate));
}
