"""pagedllm on a CUDA GPU: correctness against transformers on the same GPU, then throughput.

CI has no GPU, so this is a script to run by hand where one is lent:

    python benchmarks/gpu_check.py --tokenizer DIR

``DIR`` is a Hugging Face tokenizer folder (SmolLM2's: ``--save-tokenizer
DIR`` writes it from the bundled GGUF on a machine that has it). No weights
are needed: the checks build tiny random-weight Llama / Llama 3 / Qwen2 /
Qwen3 models from transformers configs, and the throughput part a random
model with SmolLM2-135M's shapes (speed does not depend on the values).

Correctness, per tiny model, float32 on the GPU: greedy tokens equal
transformers' (plain and with chunked prefill), a tight pool that forces
preemption gives the ones an ample pool gives, seeded n=3 samples are the
same chunked or not, and every block is free again afterwards. bfloat16:
the share of greedy tokens equal to transformers' in bfloat16 is printed,
not asserted (both round differently). Throughput: the 64-request workload
of ``pagedllm bench throughput`` (and a 256-request one) in float32 and
bfloat16, with transformers' padded ``generate`` on the same GPU as the peer.

Prints one JSON line per result and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _prompts(lengths: list[int], seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(n)]} for n in lengths]


def _tokens(outs) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in outs]


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def save_tokenizer(out_dir: str) -> None:
    """Write the bundled model's tokenizer as a Hugging Face folder."""
    from transformers import AutoTokenizer

    from pagedllm.loader import bundled_model_path

    gguf = bundled_model_path()
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(out_dir)
    print(f"tokenizer saved to {out_dir}")


def _save_model(config, tokenizer_dir: str, out_dir: str, dtype) -> str:  # noqa: ANN001
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    return out_dir


def check_correctness(tokenizer_dir: str, work: str, device: str) -> bool:
    import torch
    from conftest import _tiny_config, hf_greedy
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    ok = True
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for arch in ("llama", "llama3", "qwen2", "qwen3"):
        path = _save_model(_tiny_config(arch), tokenizer_dir, os.path.join(work, arch), torch.float32)
        checks: dict[str, object] = {}
        try:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
            prompts = _prompts([1, 5, 8, 16, 37, 90], seed=7)
            want = [hf_greedy(hf, p["prompt_token_ids"], 20) for p in prompts]
            for backend in ("sdpa", "reference"):
                llm = LLM(path, device=device, num_kv_blocks=64, max_model_len=256, block_size=8,
                          attention_backend=backend)
                checks[f"greedy_{backend}"] = _tokens(llm.generate(prompts, greedy, use_tqdm=False)) == want
                checks[f"pool_whole_{backend}"] = llm.llm_engine.block_manager.num_free_blocks == 64
            chunked = LLM(path, device=device, num_kv_blocks=64, max_model_len=256, block_size=8,
                          max_num_batched_tokens=16)
            checks["greedy_chunked"] = _tokens(chunked.generate(prompts, greedy, use_tqdm=False)) == want
            many = _prompts([12, 20, 9, 30, 17, 25, 14, 22], seed=3)
            long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            ample = LLM(path, device=device, num_kv_blocks=256, max_model_len=128, block_size=4)
            tight = LLM(path, device=device, num_kv_blocks=40, max_model_len=128, block_size=4)
            same = _tokens(ample.generate(many, long, use_tqdm=False)) == _tokens(tight.generate(many, long, use_tqdm=False))
            checks["preemption_same_tokens"] = same and tight.llm_engine.scheduler.num_preemptions > 0
            checks["pool_whole_after_preemption"] = tight.llm_engine.block_manager.num_free_blocks == 40
            sampled = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
            a = [c.token_ids for c in ample.generate(many[3], sampled, use_tqdm=False)[0].outputs]
            b = [c.token_ids for c in chunked.generate(many[3], sampled, use_tqdm=False)[0].outputs]
            checks["seeded_n3_chunked_same"] = a == b and len({tuple(t) for t in a}) > 1
            hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
            llm16 = LLM(path, device=device, dtype="bfloat16", num_kv_blocks=64, max_model_len=256, block_size=8)
            got16 = _tokens(llm16.generate(prompts, greedy, use_tqdm=False))
            want16 = [hf_greedy(hf16, p["prompt_token_ids"], 20) for p in prompts]
            equal = sum(x == y for g, w in zip(got16, want16) for x, y in zip(g, w))
            checks["bf16_greedy_equal_share"] = round(equal / sum(len(w) for w in want16), 3)
        except Exception:  # noqa: BLE001 - report and go on to the next model
            checks["error"] = traceback.format_exc()
        failed = [k for k, v in checks.items() if v is False or k == "error"]
        ok = ok and not failed
        _emit({"check": "correctness", "arch": arch, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", **checks,
               "failed": failed})
    return ok


def check_throughput(tokenizer_dir: str, work: str, device: str) -> None:
    import torch
    from transformers import LlamaConfig

    from pagedllm import LLM, SamplingParams
    from pagedllm.bench.transformers_peer import load_model, run_padded
    from pagedllm.bench.workload import make_workload

    # SmolLM2-135M's shapes
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2)
    path = _save_model(config, tokenizer_dir, os.path.join(work, "smollm2-shaped"), torch.float32)
    for num_requests in (64, 256):
        workload = make_workload(num_requests, 32, 256, 1234)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in workload]
        num_out = sum(r.output_len for r in workload)
        for dtype in ("float32", "bfloat16"):
            try:
                llm = LLM(path, device=device, dtype=dtype)
                llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                assert sum(len(o.outputs[0].token_ids) for o in outs) == num_out
                _emit({"check": "throughput", "engine": "pagedllm", "dtype": dtype, "num_requests": num_requests,
                       "elapsed_s": round(elapsed, 3), "output_tokens_per_s": round(num_out / elapsed, 1),
                       "num_kv_blocks": llm.llm_engine.block_manager.num_blocks})
                del llm
            except Exception:  # noqa: BLE001
                _emit({"check": "throughput", "engine": "pagedllm", "dtype": dtype, "error": traceback.format_exc()})
        if num_requests == 64:
            try:
                model = load_model(path).to(device)
                result = run_padded(model, workload)
                _emit({"check": "throughput", **result, "dtype": "float32"})
                del model
            except Exception:  # noqa: BLE001
                _emit({"check": "throughput", "engine": "transformers", "error": traceback.format_exc()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer folder")
    p.add_argument("--save-tokenizer", metavar="DIR", help="write the bundled model's tokenizer to DIR and exit")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: try the script itself here")
    args = p.parse_args()
    if args.save_tokenizer:
        save_tokenizer(args.save_tokenizer)
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this script checks pagedllm on a GPU")
    if not args.tokenizer:
        sys.exit("--tokenizer DIR is required")
    with tempfile.TemporaryDirectory() as work:
        ok = check_correctness(args.tokenizer, work, args.device)
        if not args.skip_throughput:
            check_throughput(args.tokenizer, work, args.device)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
