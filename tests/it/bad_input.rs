//! Every kind of bad input exits 2 with one message that names the file and the place, and
//! never panics.

use std::path::Path;

use crate::osdp;

/// (fixture under tests/data/bad, what the message must contain)
const CASES: &[(&str, &[&str])] = &[
    (
        "truncated.json",
        &["truncated.json:223:30", "ops[7].name", "EOF while parsing"],
    ),
    (
        "wrong-type.json",
        &[
            "wrong-type.json:9:17",
            "config.hidden",
            "invalid type: string \"8\"",
        ],
    ),
    (
        "unknown-field.json",
        &[
            "unknown-field.json:170:13",
            "ops[4].flops",
            "unknown field `flops`",
        ],
    ),
    (
        "missing-field.json",
        &[
            "missing-field.json:299:5",
            "ops[9]",
            "missing field `output_shape`",
        ],
    ),
    (
        "cycle.json",
        &[
            "op \"h0.ln_1\"",
            "cycle: h0.ln_1 -> h0.attn.c_attn",
            "-> h0.add_2 -> h0.ln_1",
        ],
    ),
    (
        "dangling-input.json",
        &[
            "op \"h0.mlp.act\" (ops[10])",
            "input \"h0.mlp.fc\" does not exist",
        ],
    ),
    (
        "duplicate-id.json",
        &["op \"h0.ln_1\" (ops[8])", "duplicate id: ops[3]"],
    ),
    (
        "negative-dimension.json",
        &["op \"h0.mlp.c_proj\"", "negative dimension", "[8, -32]"],
    ),
    ("overflow.json", &["op \"wte\"", "overflows"]),
    (
        "shape-mismatch.json",
        &[
            "op \"h0.mlp.c_proj\"",
            "shapes do not connect",
            "expects 24 input features",
            "width 32",
        ],
    ),
    (
        "empty-graph.json",
        &["empty-graph.json: ops:", "graph is empty"],
    ),
    (
        "future-version.json",
        &["format version 2 is not supported"],
    ),
    ("zero-heads.json", &["config.heads", "at least 1"]),
    (
        "bad-tie.json",
        &[
            "op \"lm_head\"",
            "tied_to \"wte.bias\"",
            "no parameter \"bias\"",
        ],
    ),
    ("deep-nesting.json", &["deep-nesting.json:1:", "name"]),
    ("binary.json", &["binary.json", "valid UTF-8"]),
    (
        "unsupported-architecture.hf.json",
        &[
            "\"T5ForConditionalGeneration\" is not supported",
            "GPT2LMHeadModel",
            "BertForMaskedLM",
        ],
    ),
    (
        "bad-field.hf.json",
        &["field `hidden_size`", "positive integer", "-4096"],
    ),
    (
        "bad-figure.layout.json",
        &["device.memory_gib", "positive number", "-80"],
    ),
    (
        "missing-source.layout.json",
        &["intra_node.latency_us.source", "source note"],
    ),
    ("no-inter-node.layout.json", &["inter_node", "2 nodes"]),
];

#[test]
fn each_bad_input_exits_2_naming_the_place() {
    let out_dir = tempfile::tempdir().unwrap();
    for (file, needles) in CASES {
        let path = format!("tests/data/bad/{file}");
        let mut cmd = osdp();
        if file.ends_with(".hf.json") {
            cmd.args(["import-hf", &path, "-o"])
                .arg(out_dir.path().join("out.json"));
        } else if file.ends_with(".layout.json") {
            cmd.args(["layout", &path]);
        } else {
            cmd.args(["inspect", &path]);
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{file}: exit code; stderr: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{file} panicked: {stderr}");
        assert!(stderr.starts_with("error: "), "{file}: {stderr}");
        assert_eq!(
            stderr.trim_end().lines().count(),
            1,
            "{file}: one line: {stderr}"
        );
        assert!(
            stderr.contains(file),
            "{file}: message names the file: {stderr}"
        );
        for needle in *needles {
            assert!(
                stderr.contains(needle),
                "{file}: expected {needle:?} in: {stderr}"
            );
        }
        assert!(out.stdout.is_empty(), "{file}: nothing on stdout");
    }
    assert!(
        !out_dir.path().join("out.json").exists(),
        "failed imports write nothing"
    );
}

#[test]
fn every_fixture_is_exercised() {
    let dir = crate::root().join("tests/data/bad");
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            CASES.iter().any(|(f, _)| *f == name),
            "fixture {name} has no case"
        );
    }
}

#[test]
fn missing_files_and_arguments_are_clear() {
    let out = osdp()
        .args(["inspect", "no/such/model.json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no/such/model.json: cannot read"), "{err}");

    let out = osdp().output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no model given"));
}

#[test]
fn import_refuses_a_sequence_longer_than_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let out = osdp()
        .args([
            "import-hf",
            "sample-models/hf/gpt2.json",
            "--seq-len",
            "4096",
            "-o",
        ])
        .arg(dir.path().join("m.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--seq-len") && err.contains("1024 positions"),
        "{err}"
    );
}

#[test]
fn a_failed_write_keeps_the_previous_file() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("m.json");
    std::fs::write(&target, "previous").unwrap();
    // A bad config must not touch the existing output.
    let out = osdp()
        .args(["import-hf", "tests/data/bad/bad-field.hf.json", "-o"])
        .arg(&target)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "previous");
}

#[test]
fn calibrate_for_cuda_without_a_gpu_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("local-gpu.json");
    let out = osdp()
        .args(["calibrate", "--device", "cuda", "-o"])
        .arg(&target)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no CUDA device") && err.contains("--device cpu"),
        "{err}"
    );
    assert!(!target.exists(), "nothing is written");
}

/// Issue 21: a model names itself, and the dashboard keeps its runs in `runs/NAME`; a name such
/// as `../../x` or `/etc/x` must not choose where files are written.
#[test]
fn issue_21_a_model_name_cannot_pick_where_runs_are_written() {
    use osdp_tui::run::RunDir;
    use std::path::Component;
    for hostile in [
        "../../escaped",
        "/etc/escaped",
        "..",
        ".",
        "",
        "a/../../b",
        "\u{1b}]0;x\u{7}",
    ] {
        let dir = RunDir::default_for(hostile).0;
        let parts: Vec<Component> = dir.components().collect();
        assert_eq!(parts.len(), 2, "{hostile:?} gave {}", dir.display());
        assert_eq!(parts[0], Component::Normal("runs".as_ref()));
        let Component::Normal(name) = parts[1] else {
            panic!("{hostile:?} gave {}", dir.display());
        };
        let name = name.to_str().unwrap();
        assert!(!name.starts_with('.'), "{hostile:?} gave {name:?}");
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)),
            "{hostile:?} gave {name:?}"
        );
    }
    assert_eq!(RunDir::default_for("gpt2-xl").0, Path::new("runs/gpt2-xl"));

    // Starting a run from the dashboard writes only inside the run directory.
    let tmp = tempfile::tempdir().unwrap();
    let work = tmp.path().join("work");
    let mut model: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(crate::root().join("sample-models/tiny-gpt2.json")).unwrap(),
    )
    .unwrap();
    model["name"] = "../../escaped".into();
    let model_path = tmp.path().join("model.json");
    std::fs::write(&model_path, model.to_string()).unwrap();
    let spec = osdp_core::model::read_model(&model_path).unwrap();
    let layout = osdp_core::cluster::read_layout(&crate::root().join("layouts/cpu.json")).unwrap();
    let run_dir = work.join(RunDir::default_for(&spec.name).0);
    let launch = osdp_tui::supervisor::LaunchSpec {
        exe: assert_cmd::cargo::cargo_bin("osdp-tui"),
        model: model_path,
        checkpoint_every: 3,
        hang_after: std::time::Duration::from_secs(20),
        data: Default::default(),
    };
    let mut app = osdp_tui::tui::app::App::new(spec, layout, vec![1 << 30; 2], 8)
        .with_run_control(osdp_tui::tui::app::RunControl::new(launch, run_dir.clone()));
    app.replan();
    app.update(osdp_tui::tui::app::Action::StartRun);
    if let Some(run) = app.run_control.as_mut().and_then(|t| t.supervisor.as_mut()) {
        run.stop_and_wait(std::time::Duration::from_secs(20));
    }
    assert!(run_dir.join("plan.json").is_file(), "{:?}", app.message);
    assert_eq!(run_dir.parent(), Some(work.join("runs").as_path()));
    assert!(!tmp.path().join("escaped").exists());
    assert!(!work.join("escaped").exists());
}

fn plan_to(output: &Path) -> assert_cmd::Command {
    let mut cmd = crate::osdp_bounded();
    cmd.args([
        "plan",
        "sample-models/tiny-gpt2.json",
        "--layout",
        "layouts/cpu.json",
        "--budget",
        "1GiB",
        "-o",
    ])
    .arg(output);
    cmd
}

/// Issue 21: `-o /dev/null` renamed a regular file over the device (as root, replacing
/// /dev/null for everyone). A character device is written in place.
#[test]
fn issue_21_output_to_a_character_device_keeps_the_device() {
    use std::os::unix::fs::FileTypeExt;
    // As root, a private copy of /dev/null (1, 3) shows the fix without risking the real one;
    // where nodes cannot be made or opened (not root, a nodev mount), /dev/null is safe to use
    // because an unprivileged process cannot replace it.
    let tmp = tempfile::tempdir().unwrap();
    let private = tmp.path().join("null");
    let c_path = std::ffi::CString::new(private.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string; mknod only creates a node.
    let made = unsafe { libc::mknod(c_path.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) }
        == 0
        && std::fs::OpenOptions::new()
            .write(true)
            .open(&private)
            .is_ok();
    let device = if made {
        private
    } else {
        Path::new("/dev/null").to_path_buf()
    };
    let out = plan_to(&device).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta = std::fs::metadata(&device).unwrap();
    assert!(
        meta.file_type().is_char_device(),
        "{} was replaced",
        device.display()
    );
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "null")
        .collect();
    assert!(leftovers.is_empty(), "temp files left: {leftovers:?}");
}

/// Issue 21: a FIFO or a directory as `-o` is refused (exit 1, the path named), not replaced
/// or waited on.
#[test]
fn issue_21_output_to_a_fifo_or_directory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("pipe");
    let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o644) }, 0);
    crate::refused(
        &mut plan_to(&fifo),
        1,
        &[fifo.to_str().unwrap(), "cannot write", "a FIFO"],
    );
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());

    let dir = tmp.path().join("d");
    std::fs::create_dir(&dir).unwrap();
    crate::refused(
        &mut plan_to(&dir),
        1,
        &[dir.to_str().unwrap(), "cannot write", "a directory"],
    );
    assert!(dir.is_dir());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

/// Issue 21: the temp file was `.NAME.tmp-PID`, created by following a symlink planted there.
/// A link at the old name (this process's pid, as a caller of the library) is left alone, and
/// what it points to is untouched.
#[test]
fn issue_21_a_symlink_at_the_temp_name_is_not_followed() {
    let tmp = tempfile::tempdir().unwrap();
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, "keep me").unwrap();
    let target = tmp.path().join("out.json");
    let planted = tmp
        .path()
        .join(format!(".out.json.tmp-{}", std::process::id()));
    std::os::unix::fs::symlink(&victim, &planted).unwrap();
    osdp_core::input::write_atomically(&target, b"new\n").unwrap();
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "new\n");
    assert!(std::fs::symlink_metadata(&planted).unwrap().is_symlink());
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        3,
        "no temp file left"
    );
}

/// Issue 21: inputs were read whole, whatever they were: `/dev/zero` until memory ran out, a
/// FIFO forever. Only regular files are read, and at most up to the size limit.
#[test]
fn issue_21_inputs_that_never_end_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("model.json");
    let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o644) }, 0);
    let fifo = fifo.to_str().unwrap();
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["inspect", "/dev/zero"],
            &["/dev/zero", "a character device"],
        ),
        (&["inspect", fifo], &[fifo, "a FIFO"]),
        (&["inspect", "/tmp"], &["/tmp", "a directory"]),
        (
            &["import-hf", "/dev/zero", "-o", "/tmp/never-written.json"],
            &["/dev/zero", "a character device"],
        ),
        (
            &["plan", "sample-models/gpt2.json", "--layout", fifo],
            &[fifo, "a FIFO"],
        ),
        (
            &[
                "evaluate",
                "sample-models/gpt2.json",
                "--layout",
                "layouts/cpu.json",
                "--plan",
                "/dev/zero",
            ],
            &["/dev/zero", "not a regular file"],
        ),
    ];
    for (args, needles) in cases {
        crate::refused(crate::osdp_bounded().args(*args), 2, needles);
    }
    assert!(!Path::new("/tmp/never-written.json").exists());

    // Sizes: a sparse 300 MB model file, a 2 MB config.
    let big = tmp.path().join("big.json");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(300 << 20)
        .unwrap();
    crate::refused(
        crate::osdp_bounded().arg("inspect").arg(&big),
        2,
        &["big.json", "larger than 268435456 bytes"],
    );
    let config = tmp.path().join("config.json");
    let padding = " ".repeat(2 << 20);
    std::fs::write(&config, format!("{{\"model_type\": \"gpt2\"{padding}}}")).unwrap();
    crate::refused(
        crate::osdp_bounded()
            .arg("import-hf")
            .arg(&config)
            .arg("-o")
            .arg(tmp.path().join("m.json")),
        2,
        &["config.json", "larger than 1048576 bytes"],
    );
}

/// `import-hf CONFIG -o OUT` on `config` (JSON text), under the refusal limits.
fn import_config(dir: &Path, config: &serde_json::Value, extra: &[&str]) -> assert_cmd::Command {
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let mut cmd = crate::osdp_bounded();
    cmd.arg("import-hf")
        .arg(&path)
        .args(extra)
        .arg("-o")
        .arg(dir.join("out.json"));
    cmd
}

/// Issue 21: a config (any family) or `--layers` asking for 10^6–10^12 layers hung building the
/// graph; 2^31 layers in model.json passed and then aborted on a 51 GB allocation.
#[test]
fn issue_21_layer_counts_are_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    for (arch, field) in [
        ("GPT2LMHeadModel", "n_layer"),
        ("OPTForCausalLM", "num_hidden_layers"),
        ("LlamaForCausalLM", "num_hidden_layers"),
        ("BertForMaskedLM", "num_hidden_layers"),
    ] {
        for layers in [1_000_000u64, 1_000_000_000_000] {
            let config = serde_json::json!({"architectures": [arch], field: layers});
            crate::refused(
                &mut import_config(tmp.path(), &config, &[]),
                2,
                &[&format!(
                    "field `{field}`: {layers} is too large (at most 10000)"
                )],
            );
        }
    }
    crate::refused(
        &mut import_config(
            tmp.path(),
            &serde_json::json!({"model_type": "gpt2"}),
            &["--layers", "1000000"],
        ),
        2,
        &["--layers", "1000000 layers are too many (at most 10000)"],
    );
    assert!(!tmp.path().join("out.json").exists());

    let mut model: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(crate::root().join("sample-models/tiny-gpt2.json")).unwrap(),
    )
    .unwrap();
    model["config"]["layers"] = (1u64 << 31).into();
    let path = tmp.path().join("deep.json");
    std::fs::write(&path, model.to_string()).unwrap();
    let needles = [
        "deep.json",
        "config.layers",
        "2147483648 layers are too many (at most 10000)",
    ];
    crate::refused(crate::osdp_bounded().arg("inspect").arg(&path), 2, &needles);
    crate::refused(
        crate::osdp_bounded()
            .arg("plan")
            .arg(&path)
            .args(["--layout", "layouts/cpu.json"]),
        2,
        &needles,
    );
}

/// Issue 21: config dimensions were multiplied unchecked (a vocabulary of 2^64−1 panicked on
/// overflow). Each is bounded, and a config at every bound at once is refused by the size
/// check, never by a panic or a wrapped (small) figure.
#[test]
fn issue_21_config_dimensions_are_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let max = u64::MAX;
    for (config, needle) in [
        (
            serde_json::json!({"model_type": "gpt2", "vocab_size": max}),
            format!("field `vocab_size`: {max} is too large (at most 4194304)"),
        ),
        (
            serde_json::json!({"model_type": "gpt2", "n_inner": max}),
            format!("field `n_inner`: {max} is too large (at most 1048576)"),
        ),
        (
            serde_json::json!({"model_type": "llama", "num_attention_heads": 1024, "head_dim": 1 << 20}),
            "1024 heads of 1048576 make attention 1073741824 wide (at most 1048576)".to_string(),
        ),
    ] {
        crate::refused(&mut import_config(tmp.path(), &config, &[]), 2, &[&needle]);
    }
    crate::refused(
        &mut import_config(
            tmp.path(),
            &serde_json::json!({"model_type": "gpt2", "n_positions": 1u64 << 31}),
            &["--seq-len", "2000000"],
        ),
        2,
        &["--seq-len", "2000000 tokens are too many (at most 1048576)"],
    );
    let (wide, vocab, positions) = (1u64 << 20, 1u64 << 22, 1u64 << 31);
    for config in [
        serde_json::json!({"architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
            "n_embd": wide, "n_layer": 10000, "n_head": wide, "n_positions": positions,
            "n_inner": wide}),
        serde_json::json!({"architectures": ["OPTForCausalLM"], "vocab_size": vocab,
            "hidden_size": wide, "num_hidden_layers": 10000, "num_attention_heads": wide,
            "max_position_embeddings": positions, "ffn_dim": wide, "word_embed_proj_dim": wide}),
        serde_json::json!({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
            "hidden_size": wide, "num_hidden_layers": 10000, "num_attention_heads": wide,
            "num_key_value_heads": wide, "max_position_embeddings": positions,
            "intermediate_size": wide}),
        serde_json::json!({"architectures": ["BertForMaskedLM"], "vocab_size": vocab,
            "hidden_size": wide, "num_hidden_layers": 10000, "num_attention_heads": wide,
            "max_position_embeddings": positions, "intermediate_size": wide,
            "type_vocab_size": vocab}),
    ] {
        for extra in [
            &[][..],
            &["--seq-len", "1048576", "--attention", "eager"][..],
        ] {
            crate::refused(
                &mut import_config(tmp.path(), &config, extra),
                2,
                &["the imported model is not valid", "overflows"],
            );
        }
    }
    assert!(!tmp.path().join("out.json").exists());
}

/// Issue 21: `--budget 16EiB` climbed the micro-batch ladder until it aborted after 5 GB, and
/// `--batch 2^62` overflowed into "fits in 313.9 MiB". Budgets stop at 1 PiB per GPU and
/// micro-batches at 2^20, wherever they come from.
#[test]
fn issue_21_budgets_and_batches_are_bounded() {
    let plan = |extra: &[&str]| {
        let mut cmd = crate::osdp_bounded();
        cmd.args([
            "plan",
            "sample-models/tiny-gpt2.json",
            "--layout",
            "layouts/cpu.json",
        ])
        .args(extra);
        cmd
    };
    crate::refused(
        &mut plan(&["--budget", "16EiB"]),
        2,
        &["'16EiB'", "--budget", "at most 1.0 PiB per GPU"],
    );
    crate::refused(
        &mut plan(&["--budget-per-gpu", "1GiB,2EiB"]),
        2,
        &["'2EiB'", "at most 1.0 PiB per GPU"],
    );
    let huge = (1u64 << 62).to_string();
    crate::refused(
        &mut plan(&["--batch", &huge]),
        2,
        &[&format!("{huge} is too large: at most 1048576")],
    );
    crate::refused(
        crate::osdp_bounded().args([
            "sample-models/tiny-gpt2.json",
            "--layout",
            "layouts/cpu.json",
            "--once",
            "--batch",
            &huge,
        ]),
        2,
        &[&format!("{huge} is too large: at most 1048576")],
    );

    // The largest budget with the micro-batch searched: answered, within the limits.
    let out = plan(&["--budget", "1PiB", "--json"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let batch = json["plan"]["batch_size"]
        .as_u64()
        .or_else(|| json["batch_size"].as_u64())
        .expect("a batch size in the JSON");
    assert!((1..=1 << 20).contains(&batch), "{batch}");

    // A hand-edited plan file and a layout are held to the same bounds.
    let tmp = tempfile::tempdir().unwrap();
    let plan_path = tmp.path().join("plan.json");
    crate::stdout_ok(
        plan(&["-o", plan_path.to_str().unwrap()])
            .arg("--budget")
            .arg("1GiB"),
    );
    let mut file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan_path).unwrap()).unwrap();
    file["batch_size"] = (1u64 << 62).into();
    std::fs::write(&plan_path, file.to_string()).unwrap();
    crate::refused(
        crate::osdp_bounded()
            .args([
                "evaluate",
                "sample-models/tiny-gpt2.json",
                "--layout",
                "layouts/cpu.json",
            ])
            .arg("--plan")
            .arg(&plan_path),
        2,
        &[
            "plan.json",
            "batch_size",
            &format!("micro-batch {} is too large (at most 1048576", 1u64 << 62),
        ],
    );
    let mut layout: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(crate::root().join("layouts/cpu.json")).unwrap(),
    )
    .unwrap();
    layout["device"]["memory_gib"]["value"] = 1e30.into();
    let layout_path = tmp.path().join("layout.json");
    std::fs::write(&layout_path, layout.to_string()).unwrap();
    crate::refused(
        crate::osdp_bounded()
            .args(["plan", "sample-models/tiny-gpt2.json", "--layout"])
            .arg(&layout_path),
        2,
        &["device.memory_gib", "1.0 PiB per GPU", "give --budget"],
    );
}

/// Issue 21: `train --world-size 100000` and `--global-batch 1000000000` crashed the trainer,
/// and `--lr NaN|inf|-1` was accepted. Refused as arguments, before anything is read.
#[test]
fn issue_21_training_arguments_are_bounded() {
    let train = |extra: &[&str]| {
        let mut cmd = crate::osdp_bounded();
        cmd.args([
            "train",
            "sample-models/tiny-gpt2.json",
            "--plan",
            "no-such-plan.json",
        ])
        .args(extra);
        cmd
    };
    crate::refused(
        &mut train(&["--world-size", "100000"]),
        2,
        &[
            "'100000'",
            "--world-size",
            "100000 ranks are too many (at most 65536)",
        ],
    );
    crate::refused(
        &mut train(&["--global-batch", "1000000000"]),
        2,
        &[
            "--global-batch 1000000000",
            "1000000000 samples per rank (at most 1048576)",
        ],
    );
    for lr in ["NaN", "inf", "-1", "0"] {
        crate::refused(
            &mut train(&["--lr", lr]),
            2,
            &[&format!("'{lr}'"), "--lr", "not a learning rate"],
        );
    }
}

/// Issue 21: serde read a model or layout written as a JSON array (`[{...}]`, or the fields by
/// position); a second `--pin` of one op silently replaced the first; `zero3/1024:1` was
/// accepted on a linear of 128 input features.
#[test]
fn issue_21_strict_parsing_gaps() {
    let tmp = tempfile::tempdir().unwrap();
    for (sample, command) in [
        ("sample-models/tiny-gpt2.json", "inspect"),
        ("layouts/cpu.json", "layout"),
    ] {
        let value: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(crate::root().join(sample)).unwrap())
                .unwrap();
        let by_position: Vec<serde_json::Value> =
            value.as_object().unwrap().values().cloned().collect();
        for (name, text) in [
            ("wrapped.json", serde_json::json!([value]).to_string()),
            (
                "positional.json",
                serde_json::Value::from(by_position).to_string(),
            ),
        ] {
            let path = tmp.path().join(name);
            std::fs::write(&path, text).unwrap();
            crate::refused(
                crate::osdp_bounded().arg(command).arg(&path),
                2,
                &[
                    &format!("{name}:1:1"),
                    "(top level)",
                    "expected a JSON object",
                ],
            );
        }
    }
    let plan = |pins: &[&str]| {
        let mut cmd = crate::osdp_bounded();
        cmd.args([
            "plan",
            "sample-models/tiny-gpt2.json",
            "--layout",
            "layouts/cpu.json",
        ]);
        for p in pins {
            cmd.args(["--pin", p]);
        }
        cmd
    };
    crate::refused(
        &mut plan(&["h0.mlp.c_fc=zero3", "h0.attn.c_proj=dp", "h0.mlp.c_fc=dp"]),
        2,
        &[
            "\"h0.mlp.c_fc=zero3\"",
            "\"h0.mlp.c_fc=dp\"",
            "the same op \"h0.mlp.c_fc\"",
        ],
    );
    crate::refused(
        &mut plan(&["h0.mlp.c_fc=zero3/1024:1"]),
        2,
        &[
            "zero3/1024:1",
            "128 input features",
            "cannot be split into 1024 slices",
        ],
    );
    crate::stdout_ok(&mut plan(&["h0.mlp.c_fc=zero3/64:1"]));
}

/// Issue 21: names come from files the user may not have written; printed raw, a name holding
/// an escape sequence clears the screen, retitles the window or rings the bell. Every text
/// output shows such characters escaped (JSON escapes them itself).
#[test]
fn issue_21_names_cannot_drive_the_terminal() {
    let tmp = tempfile::tempdir().unwrap();
    let mut model: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(crate::root().join("sample-models/tiny-gpt2.json")).unwrap(),
    )
    .unwrap();
    let hostile_name = "tiny\u{1b}[2J\u{7}";
    let hostile_op = "wpe\u{1b}[2J\u{7}";
    model["name"] = hostile_name.into();
    for op in model["ops"].as_array_mut().unwrap() {
        if op["id"] == "wpe" {
            op["id"] = hostile_op.into();
        }
        for input in op["inputs"].as_array_mut().unwrap() {
            if input == "wpe" {
                *input = hostile_op.into();
            }
        }
    }
    let model_path = tmp.path().join("model.json");
    std::fs::write(&model_path, model.to_string()).unwrap();
    let model_arg = model_path.to_str().unwrap();
    let escaped_name = r"tiny\u{1b}[2J\u{7}";
    let escaped_op = r"wpe\u{1b}[2J\u{7}";
    let runs: [(&str, Vec<&str>, &[&str]); 3] = [
        ("inspect", vec!["inspect", model_arg], &[escaped_name]),
        (
            "plan",
            vec!["plan", model_arg, "--layout", "layouts/cpu.json"],
            &[escaped_name, escaped_op],
        ),
        (
            "dashboard",
            vec![model_arg, "--layout", "layouts/cpu.json", "--once"],
            &[escaped_name],
        ),
    ];
    for (what, args, needles) in runs {
        let out = crate::osdp_bounded().args(&args).output().unwrap();
        assert!(out.status.success(), "{what}: {out:?}");
        for stream in [&out.stdout, &out.stderr] {
            assert!(
                !stream.iter().any(|&b| b == 0x1b || b == 0x07),
                "{what} printed a raw control byte: {}",
                String::from_utf8_lossy(stream)
            );
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        for needle in needles {
            assert!(stdout.contains(needle), "{what} lacks {needle}: {stdout}");
        }
    }
    // JSON keeps the name as it is: serde writes the control characters as \u001b escapes.
    let out = crate::osdp_bounded()
        .args(["inspect", model_arg, "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(!out.stdout.iter().any(|&b| b == 0x1b || b == 0x07));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["name"], hostile_name);
}

/// Issue 21: a model of a hundred distinct blocks (each with its own figures) has thousands of
/// transient caps, each a sum over every class; the planner coarsens its memory resolution to
/// stay within bounds and says so.
#[test]
fn issue_21_many_distinct_blocks_stay_within_bounds() {
    let tmp = tempfile::tempdir().unwrap();
    let config = serde_json::json!({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 384,
        "n_head": 6, "n_layer": 100, "n_positions": 256, "vocab_size": 256,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": true
    });
    import_config(tmp.path(), &config, &[]).assert().success();
    let imported = tmp.path().join("out.json");
    let mut model: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&imported).unwrap()).unwrap();
    for op in model["ops"].as_array_mut().unwrap() {
        if let Some(b) = op["block"].as_u64() {
            let flops = op["fwd_flops_per_sample"].as_u64().unwrap();
            op["fwd_flops_per_sample"] = (flops + b * 1000).into();
            let saved = op["saved_bytes_per_sample"].as_u64().unwrap();
            op["saved_bytes_per_sample"] = (saved + b * 64).into();
        }
    }
    let model_path = tmp.path().join("hostile.json");
    std::fs::write(&model_path, model.to_string()).unwrap();
    // The bound under test is memory; a whole search of a hundred distinct blocks takes
    // seconds in a test build, so time gets a loaded machine's margin.
    let out = crate::osdp_bounded()
        .timeout(std::time::Duration::from_secs(120))
        .args([
            "plan",
            model_path.to_str().unwrap(),
            "--layout",
            "layouts/h100-sxm-8x-nvlink.json",
            "--global-batch",
            "any",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("samples/s"), "{stdout}");
    assert!(stdout.contains("memory was resolved to"), "{stdout}");
}

/// Issue 34: a negative budget is refused as one, not with clap's advice to write `-- -5`
/// (which would make it a model path); every budget flag takes the same path.
#[test]
fn a_negative_budget_is_named_negative() {
    for flag in ["--budget", "--budget-per-gpu", "--host-budget"] {
        let out = osdp()
            .args([
                "plan",
                "sample-models/gpt2.json",
                "--layout",
                "layouts/cpu.json",
                flag,
                "-5GiB",
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert!(err.contains("cannot be negative"), "{flag}: {err}");
        assert!(!err.contains("-- -5"), "{flag}: {err}");
    }
}

/// `layout` keeps a space between every figure and its source, however long the figure.
#[test]
fn layout_figures_and_sources_never_run_together() {
    let out = osdp().args(["layout", "cpu"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("per micro-batch none priced"),
        "the figure runs into its source:\n{text}"
    );
}

/// Issue 32: a model, layout or plan file followed by a second object or any text was
/// accepted, the first object winning. Each is refused at the place the trailing text starts.
#[test]
fn a_file_with_text_after_its_object_is_refused_where_the_text_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let root = crate::root();
    let model_text = std::fs::read_to_string(root.join("sample-models/tiny-gpt2.json")).unwrap();
    let layout_text = std::fs::read_to_string(root.join("layouts/cpu.json")).unwrap();
    let model = tmp.path().join("model.json");
    std::fs::write(
        &model,
        format!("{}\n{{\"version\": 1}}\n", model_text.trim_end()),
    )
    .unwrap();
    let lines = model_text.trim_end().lines().count() + 1;
    crate::refused(
        crate::osdp_bounded().arg("inspect").arg(&model),
        2,
        &[&format!("model.json:{lines}:1"), "trailing text"],
    );
    let layout = tmp.path().join("layout.json");
    std::fs::write(&layout, format!("{}garbage", layout_text.trim_end())).unwrap();
    crate::refused(
        crate::osdp_bounded()
            .arg("plan")
            .arg(root.join("sample-models/tiny-gpt2.json"))
            .arg("--layout")
            .arg(&layout),
        2,
        &["layout.json:", "trailing text"],
    );
    // A plan the planner wrote, then the same plan again after it.
    let plan = tmp.path().join("plan.json");
    crate::stdout_ok(
        crate::osdp()
            .arg("plan")
            .arg(root.join("sample-models/tiny-gpt2.json"))
            .args(["--layout", "cpu", "--budget", "1GiB", "-o"])
            .arg(&plan),
    );
    let text = std::fs::read_to_string(&plan).unwrap();
    std::fs::write(&plan, format!("{text}{text}")).unwrap();
    crate::refused(
        crate::osdp_bounded()
            .arg("evaluate")
            .arg(root.join("sample-models/tiny-gpt2.json"))
            .args(["--layout", "cpu", "--plan"])
            .arg(&plan),
        2,
        &["plan.json:", "trailing text"],
    );
}
