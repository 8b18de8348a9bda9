"""Damaged copies of a good Hugging Face checkpoint, one directory per way `--init-from`
must refuse it.

usage: bad_checkpoints.py GOOD_DIR OUT_DIR
"""

import json
import os
import shutil
import sys

from safetensors.torch import load_file, save_file


def copy(good, out, name):
    d = os.path.join(out, name)
    shutil.copytree(good, d)
    return d


def main():
    good, out = sys.argv[1], sys.argv[2]
    weights = load_file(os.path.join(good, "model.safetensors"))
    names = sorted(weights)

    d = copy(good, out, "missing")
    save_file({k: v for k, v in weights.items() if k != names[0]}, os.path.join(d, "model.safetensors"))

    d = copy(good, out, "unexpected")
    extra = dict(weights)
    extra["transformer.h.0.attn.c_extra.weight"] = weights[names[0]].clone()
    save_file(extra, os.path.join(d, "model.safetensors"))

    d = copy(good, out, "shape")
    odd = dict(weights)
    key = [k for k in names if k.endswith("c_fc.weight")][0]
    odd[key] = odd[key][:, :-1].contiguous()
    save_file(odd, os.path.join(d, "model.safetensors"))

    d = copy(good, out, "truncated")
    path = os.path.join(d, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])

    d = copy(good, out, "corrupt-header")
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"{not json at all")

    d = copy(good, out, "pickle")
    os.remove(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "pytorch_model.bin"), "wb") as f:
        f.write(b"PK\x03\x04 a torch.save zip")

    d = copy(good, out, "config")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["n_inner"] = 4 * cfg["n_embd"] + 8
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


if __name__ == "__main__":
    main()
