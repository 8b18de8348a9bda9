//! Hugging Face import: parameter counts equal transformers' `num_parameters()`, and the shipped
//! samples are exactly what `import-hf` makes of the configs beside them.

use crate::{inspect_json, osdp, root};

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
