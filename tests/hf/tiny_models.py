"""Tiny random Hugging Face models of every family osdp-tui trains, saved with save_pretrained,
with transformers' own figures on fixed tokens for the Rust tests to compare with.

usage: tiny_models.py OUT_DIR

For each family FAMILY it writes OUT_DIR/FAMILY/ (config.json, model.safetensors in fp32) and
OUT_DIR/FAMILY.json: {"seq": S, "tokens": [...], "samples": N, "loss": mean next-token loss
over samples 0..N (sample i = tokens[i*S : i*S+S+1]), "logits0": logits of sample 0, flat}.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
import transformers as tf

SEQ = 16
SAMPLES = 6
VOCAB = 96


def configs():
    common = dict(vocab_size=VOCAB, max_position_embeddings=32)
    return {
        "gpt2": tf.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        ),
        "opt": tf.OPTConfig(
            hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
            word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
            **common,
        ),
        "llama": tf.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
            **common,
        ),
        "mistral": tf.MistralConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
            sliding_window=None, **common,
        ),
        "qwen2": tf.Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
            **common,
        ),
    }


def reference(model, tokens):
    """transformers' mean next-token loss over the samples, and sample 0's logits."""
    t = torch.tensor(tokens)
    losses = []
    first = None
    with torch.no_grad():
        for i in range(SAMPLES):
            w = t[i * SEQ : i * SEQ + SEQ + 1]
            logits = model(input_ids=w[:-1].unsqueeze(0)).logits[0].float()
            losses.append(F.cross_entropy(logits, w[1:]).item())
            if first is None:
                first = logits
    return sum(losses) / len(losses), first.flatten().tolist()


def main():
    out = sys.argv[1]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (SEQ * SAMPLES + 1,), generator=g).tolist()
    for family, cfg in configs().items():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        model.eval()
        # Random weights of the usual scale everywhere, norms and biases too, so that a
        # mis-mapped or mis-transposed tensor cannot hide behind ones and zeros.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2 if p.dim() == 1 else 0.08)
        model.save_pretrained(os.path.join(out, family))
        loss, logits0 = reference(model, tokens)
        with open(os.path.join(out, family + ".json"), "w") as f:
            json.dump(
                {"seq": SEQ, "tokens": tokens, "samples": SAMPLES, "loss": loss,
                 "logits0": logits0},
                f,
            )


if __name__ == "__main__":
    main()
