"""Embedding throughput: pagedllm's pooling runner against sentence-transformers on the same model and dtype.

Both embed the same ``--num-passages`` passages of ``--min-tokens`` to ``--max-tokens`` tokens (lengths
drawn uniformly from ``--seed``; text cut from the licenses in ``/usr/share/common-licenses``, or random
token ids where they are missing), in float32, with the same pooling (the folder's sentence-transformers
config; one is written into a temporary copy, mean pooling and normalisation, where the folder has none).
pagedllm runs ``LLM(runner="pooling").embed`` (every passage queued at once: the scheduler batches them
under ``max_num_batched_tokens``); sentence-transformers its ``encode`` with ``--st-batch-size``. Prints
sequences/s and tokens/s of each, and the lowest cosine between the two runs' vectors (they must agree).

    PYTHONPATH=. python benchmarks/embed_throughput.py --model PATH_TO_HF_FOLDER
    PYTHONPATH=. python benchmarks/embed_throughput.py --model PATH --num-passages 32 --json   # a quick check

Needs ``sentence-transformers`` (``pip install sentence-transformers``); ``--skip-st`` runs pagedllm alone.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import tempfile
import time

import torch

from pagedllm import LLM


def passages(tokenizer, num: int, min_tokens: int, max_tokens: int, seed: int) -> list[list[int]]:  # noqa: ANN001
    """``num`` token-id lists with lengths uniform in [min_tokens, max_tokens], cut from license texts."""
    rng = random.Random(seed)
    text = " ".join(open(p, errors="ignore").read() for p in sorted(glob.glob("/usr/share/common-licenses/*"))
                    if os.path.isfile(p))
    ids = tokenizer.encode(text, add_special_tokens=False) if text else []
    out = []
    for _ in range(num):
        n = rng.randint(min_tokens, max_tokens)
        if len(ids) > n:
            start = rng.randrange(len(ids) - n)
            out.append(ids[start : start + n])
        else:
            out.append([rng.randrange(1000, 20000) for _ in range(n)])
    return out


def with_st_config(model: str, tmp: str) -> str:
    """``model`` itself where it has sentence-transformers' modules.json, else a copy given mean pooling."""
    if os.path.isfile(os.path.join(model, "modules.json")):
        return model
    copy = os.path.join(tmp, "model")
    shutil.copytree(model, copy)
    with open(os.path.join(copy, "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    with open(os.path.join(copy, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(copy, "1_Pooling"))
    with open(os.path.join(copy, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": hidden, "pooling_mode_mean_tokens": True}, f)
    return copy


def run_pagedllm(path: str, texts: list[str], batched_tokens: int) -> tuple[float, torch.Tensor]:
    llm = LLM(path, runner="pooling", convert="embed", dtype="float32", max_model_len=1024,
              max_num_batched_tokens=batched_tokens)
    llm.embed(texts[:1])  # warm-up
    start = time.perf_counter()
    outs = llm.embed(texts)
    seconds = time.perf_counter() - start
    return seconds, torch.tensor([o.outputs.embedding for o in outs])


def run_st(path: str, texts: list[str], batch_size: int) -> tuple[float, torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu", model_kwargs={"dtype": torch.float32})
    model.encode(texts[:1])
    start = time.perf_counter()
    vecs = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
    return time.perf_counter() - start, vecs.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face folder")
    parser.add_argument("--num-passages", type=int, default=256)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-st", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = passages(tokenizer, args.num_passages, args.min_tokens, args.max_tokens, args.seed)
    # both take the same texts (sentence-transformers takes text), counted as they tokenize
    texts = [tokenizer.decode(p) for p in prompts]
    num_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    with tempfile.TemporaryDirectory() as tmp:
        path = with_st_config(args.model, tmp)
        results = {}
        seconds, ours = run_pagedllm(path, texts, args.max_num_batched_tokens)
        results["pagedllm"] = {"seconds": seconds, "seq_per_s": len(prompts) / seconds, "tok_per_s": num_tokens / seconds}
        if not args.skip_st:
            seconds, theirs = run_st(path, texts, args.st_batch_size)
            results["sentence-transformers"] = {"seconds": seconds, "seq_per_s": len(prompts) / seconds,
                                                "tok_per_s": num_tokens / seconds}
            results["min_cosine"] = float(torch.nn.functional.cosine_similarity(ours, theirs, dim=1).min())
    results.update(num_passages=len(prompts), num_tokens=num_tokens, threads=torch.get_num_threads())
    if args.json:
        print(json.dumps(results))
        return
    for name in ("pagedllm", "sentence-transformers"):
        if name in results:
            r = results[name]
            print(f"{name:>22}: {r['seconds']:7.2f} s  {r['seq_per_s']:7.1f} seq/s  {r['tok_per_s']:8.0f} tok/s")
    if "min_cosine" in results:
        print(f"lowest cosine between the two: {results['min_cosine']:.6f}")


if __name__ == "__main__":
    main()
