"""Tiny random Hugging Face models of every family osdp-tui trains, saved with save_pretrained,
with transformers' own figures on fixed tokens for the Rust tests to compare with.

usage: tiny_models.py OUT_DIR

For each family FAMILY it writes OUT_DIR/FAMILY/ (config.json, model.safetensors in fp32; for
llama also OUT_DIR/llama-bf16/ and OUT_DIR/llama-fp16/, the same weights rounded) and
OUT_DIR/FAMILY.json: {"seq": S, "tokens": [...], "samples": N, "loss": mean next-token loss
over samples 0..N (sample i = tokens[i*S : i*S+S+1]), "logits0": logits of sample 0, flat}.
"""

import copy
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


def tokenizer_fixture(out, model):
    """A byte-level BPE tokenizer of VOCAB tokens (its end-of-text token included), a JSON-lines
    file of documents, and transformers' loss on the documents tokenized by it and joined by
    end-of-text, for `eval --tokenizer` to match."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = open(os.path.join(os.path.dirname(__file__), "../../data/shakespeare.txt")).read()
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "[UNK]"],
                                  limit_alphabet=70)
    tok.train_from_iterator([text[:20000]], trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    docs = [text[i * 300 : i * 300 + 300] for i in range(3)]
    with open(os.path.join(out, "docs.jsonl"), "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    eos = tok.token_to_id("<|endoftext|>")
    ids = []
    for d in docs:
        ids += tok.encode(d).ids + [eos]
    samples = (len(ids) - 1) // SEQ
    t = torch.tensor(ids)
    losses = []
    with torch.no_grad():
        for i in range(samples):
            w = t[i * SEQ : i * SEQ + SEQ + 1]
            losses.append(F.cross_entropy(model(input_ids=w[:-1].unsqueeze(0)).logits[0], w[1:]).item())
    with open(os.path.join(out, "tokenized.json"), "w") as f:
        json.dump({"samples": samples, "loss": sum(losses) / samples, "tokens": len(ids)}, f)


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
        if family == "llama":
            tokenizer_fixture(out, model)
            # The same weights as bf16 and fp16 files, as models are usually published.
            for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
                copy.deepcopy(model).to(dtype).save_pretrained(os.path.join(out, f"llama-{name}"))
        with open(os.path.join(out, family + ".json"), "w") as f:
            json.dump(
                {"seq": SEQ, "tokens": tokens, "samples": SAMPLES, "loss": loss,
                 "logits0": logits0},
                f,
            )


if __name__ == "__main__":
    main()
