//! Property: any valid graph survives write → read unchanged.

use std::path::Path;

use osdp_core::model::{
    self, Activation, AttentionImpl, Biases, ComposedGelu, DType, Family, GraphBuilder, Kernels,
    ModelConfig, ModelSpec, NormKind, NormPosition, Positional,
};
use proptest::prelude::*;

/// One step of a random graph: an action and two picks, interpreted against what exists.
type Step = (u8, u16, u16, Option<u8>);

fn config(
    hidden_mult: u64,
    heads: u64,
    grouped: bool,
    seq: u64,
    vocab: u64,
    eps: f64,
    drop: f64,
) -> ModelConfig {
    let head_dim = hidden_mult;
    let hidden = heads * head_dim;
    let kv_heads = if grouped && heads % 2 == 0 {
        heads / 2
    } else {
        heads
    };
    ModelConfig {
        vocab_size: vocab,
        seq_len: seq,
        max_positions: seq + 3,
        hidden,
        embed_dim: hidden,
        layers: 4,
        heads,
        kv_heads,
        head_dim,
        ffn_hidden: 4 * hidden,
        norm: if grouped {
            NormKind::RmsNorm
        } else {
            NormKind::LayerNorm
        },
        norm_eps: eps,
        norm_position: NormPosition::Pre,
        final_norm: true,
        activation: if grouped {
            Activation::Silu
        } else {
            Activation::GeluTanh
        },
        gated_mlp: grouped,
        tied_embeddings: !grouped,
        bias: Biases {
            qkv: true,
            attn_out: !grouped,
            mlp: true,
            norm: true,
            lm_head: false,
        },
        positional: if grouped {
            Positional::Rotary
        } else {
            Positional::Learned
        },
        position_offset: 0,
        rope_theta: grouped.then_some(10000.0 + eps),
        type_vocab_size: 0,
        causal: true,
        dropout: drop,
        attention_dropout: drop / 2.0,
        attention: if grouped {
            AttentionImpl::Flash
        } else {
            AttentionImpl::Eager
        },
        kernels: if grouped {
            Kernels::Pytorch
        } else {
            Kernels::Osdp
        },
        composed_gelu: (drop > 0.05).then_some(ComposedGelu::New),
        dtype: DType::Bf16,
    }
}

/// Build a random but valid graph: every op reads earlier ops whose shapes fit.
fn build(cfg: ModelConfig, name: String, steps: &[Step]) -> ModelSpec {
    let (h, v) = (cfg.hidden, cfg.vocab_size);
    let (q, kv) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
    let tied = cfg.tied_embeddings;
    let mut g = GraphBuilder::new(cfg);
    let mut widths: Vec<(String, u64)> = vec![(g.embedding("emb", "embed", v, h), h)];
    for (i, &(action, a, b, block)) in steps.iter().enumerate() {
        g.set_block(block.map(|b| u32::from(b % 4)));
        let id = format!("op{i}");
        let pick = |k: u16| widths[k as usize % widths.len()].clone();
        let (x, w) = pick(a);
        let same_width: Vec<(String, u64)> =
            widths.iter().filter(|(_, ww)| *ww == w).cloned().collect();
        let made = match action % 5 {
            0 => (
                g.norm(&id, &format!("n.{i}"), &x, b % 2 == 0, b % 3 == 0),
                w,
            ),
            1 => {
                let out = [h, 2 * h, q + 2 * kv, q, kv][b as usize % 5];
                (
                    g.linear(&id, &format!("l.{i}"), &x, out, b % 2 == 1, None),
                    out,
                )
            }
            2 => {
                let other = &same_width[b as usize % same_width.len()].0;
                let inputs: Vec<&str> = if b % 2 == 0 {
                    vec![&x]
                } else {
                    vec![&x, other]
                };
                (g.activation(&id, &format!("a.{i}"), &inputs), w)
            }
            3 => {
                let other = same_width[b as usize % same_width.len()].0.clone();
                (g.add(&id, &format!("r.{i}"), &[&x, &other], b % 2 == 0), w)
            }
            _ => {
                // Attention needs a fused qkv input; make one from `x` first.
                let qkv = g.linear(
                    &format!("{id}.qkv"),
                    &format!("qkv.{i}"),
                    &x,
                    q + 2 * kv,
                    true,
                    None,
                );
                widths.push((qkv.clone(), q + 2 * kv));
                (g.attention(&id, &format!("att.{i}"), &[&qkv]), q)
            }
        };
        widths.push(made);
    }
    g.set_block(None);
    let (last, w) = widths.last().cloned().expect("graph has ops");
    let tie = (tied && w == h).then_some("emb.weight");
    let logits = g.linear("head", "lm_head", &last, v, false, tie);
    g.cross_entropy("loss", "loss", &logits);
    g.finish(&name, Family::Gpt2, Some(format!("proptest «{name}»")))
}

fn graphs() -> impl Strategy<Value = ModelSpec> {
    (
        (1u64..=8, 1u64..=4, any::<bool>(), 1u64..=16, 2u64..=64),
        (1e-12f64..1e-3, 0.0f64..0.5),
        "[a-zA-Z0-9é✓][a-zA-Z0-9 _.\\-é✓]{0,15}",
        prop::collection::vec(
            (any::<u8>(), any::<u16>(), any::<u16>(), any::<Option<u8>>()),
            0..40,
        ),
    )
        .prop_map(
            |((hd, heads, grouped, seq, vocab), (eps, drop), name, steps)| {
                build(
                    config(hd, heads, grouped, seq, vocab, eps, drop),
                    name,
                    &steps,
                )
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn valid_graphs_survive_write_then_read(spec in graphs()) {
        prop_assert!(model::validate(&spec).is_ok(), "{:?}", model::validate(&spec));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.json");
        model::write_model(&path, &spec).unwrap();
        let back = model::read_model(&path).unwrap();
        prop_assert_eq!(&back, &spec);
        // And once more from the in-memory text.
        let text = serde_json::to_string(&spec).unwrap();
        prop_assert_eq!(model::from_json_str(Path::new("m.json"), &text).unwrap(), spec);
    }
}
