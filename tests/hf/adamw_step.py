"""One AdamW step of a Hugging Face model with torch.optim.AdamW, the reference the trainer's
step is compared with.

usage: adamw_step.py MODEL_DIR STEP.json OUT_DIR
STEP.json: {"rows", "seq", "inputs", "labels" (flat), "lr", "beta1", "beta2", "eps",
"weight_decay"}. The loss is the mean next-token loss over every token of the batch; matrices
(2 or more dimensions) decay, vectors do not, as the trainer does. OUT_DIR gets the stepped
model (save_pretrained).
"""

import json
import sys

import torch
import torch.nn.functional as F
import transformers as tf


def main():
    model_dir, step_file, out = sys.argv[1:4]
    s = json.load(open(step_file))
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": s["weight_decay"]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=s["lr"], betas=(s["beta1"], s["beta2"]), eps=s["eps"])
    shape = (s["rows"], s["seq"])
    inputs = torch.tensor(s["inputs"]).view(shape)
    labels = torch.tensor(s["labels"]).view(shape)
    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    loss.backward()
    opt.step()
    model.save_pretrained(out)
    print(loss.item())


if __name__ == "__main__":
    main()
