"""One backend of benchmarks/engine_speed.py: loads the model once, then runs the jobs it reads on stdin.

    <python of the backend's virtualenv> benchmarks/engine_speed_worker.py {pagedkv,hf,llamacpp} --model FILE.gguf
        [--threads N|default]

Each stdin line is a JSON job ``{"batch": B, "input_len": I, "output_len": O, "seed": S}``; the worker answers one
JSON line on stdout with the wall time and tokens/s. Every backend gets the same workload: ``B`` prompts of ``I``
random token ids (``numpy.random.default_rng(S).integers(100, vocab, I)`` per prompt, as ``pagedkv bench
throughput`` makes them), all submitted at once, ``O`` tokens generated for each with end-of-sequence ignored,
sampled at temperature 1 over the whole vocabulary (no top-k, no top-p). Tokens/s counts prompt plus output
tokens (vLLM's benchmark_throughput convention); output tokens/s is given too.

Backends (each runs in its own interpreter; only pagedkv's is the project's own virtualenv):

* ``pagedkv``: ``pagedkv.engine.throughput.run_throughput`` (the code of ``pagedkv bench throughput``) on a fresh
  ``LLM`` per job (an empty prefix cache: repeats do not hit each other's prompts), weights shared; the model
  class after the file's architecture (SmolLM2: ``PagedLlama``, Gemma 3: ``PagedGemma3`` on KV cache groups);
* ``hf``: transformers' ``generate`` on the same GGUF file (dequantized to float32 by transformers), one static
  batch, ``do_sample=True, top_k=0``, an all-ones attention mask;
* ``llamacpp``: llama.cpp through llama-cpp-python's C API on the same (quantized) GGUF file: one context with
  ``B`` sequences, prompts decoded in one batch, then one ``llama_decode`` per step for all ``B`` sequences (what
  llama-server does with ``B`` parallel slots), the ``dist`` sampler (temperature 1, whole vocabulary).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from pagedkv.engine.config import ModelRunConfig


def make_prompts(batch: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, input_len).tolist() for _ in range(batch)]


class PagedKV:
    def __init__(self, model: str, threads: int | None) -> None:
        import pagedkv.engine  # noqa: F401 - first, as in any use of the engine: its runtime settings precede torch
        import torch

        from pagedkv.engine.registry import load_model

        self.threads = threads  # None: the engine's own policy (pagedkv.engine.cpu)
        if threads is not None:
            torch.set_num_threads(threads)
        self.model = load_model(model)  # PagedLlama or PagedGemma3, after the file's architecture
        self.vocab = self.model.config.vocab_size

    def run(self, batch: int, input_len: int, output_len: int, seed: int) -> dict:
        from pagedkv.engine.llm import LLM
        from pagedkv.engine.throughput import run_throughput

        llm = LLM(self.model, max_num_seqs=max(32, batch), run_config=ModelRunConfig(threads=self.threads))
        r = run_throughput(llm, input_len=input_len, output_len=output_len, num_prompts=batch, seed=seed,
                           use_tqdm=False)
        return {"elapsed_s": r["elapsed_s"], "threads": r["torch_threads"], "split": {k: r[k] for k in (
            "block_manager_share", "scheduler_share", "model_share", "sampling_share")}}


class HF:
    def __init__(self, model: str, threads: int | None) -> None:
        import os

        import torch
        from transformers import AutoModelForCausalLM

        if threads is not None:  # None: torch's default
            torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model),
                                                          dtype=torch.float32)
        self.model.eval()
        self.vocab = self.model.config.vocab_size

    def run(self, batch: int, input_len: int, output_len: int, seed: int) -> dict:
        torch = self.torch
        ids = torch.tensor(make_prompts(batch, input_len, self.vocab, seed))
        self.model.generate(ids[:1, :4], attention_mask=torch.ones_like(ids[:1, :4]), max_new_tokens=2,
                            do_sample=True, top_k=0, pad_token_id=0)  # warm-up
        torch.manual_seed(seed)
        t = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                  top_p=1.0, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
        elapsed = time.perf_counter() - t
        assert out.shape == (batch, input_len + output_len), out.shape
        return {"elapsed_s": elapsed, "threads": torch.get_num_threads()}


class LlamaCpp:
    def __init__(self, model: str, threads: int | None) -> None:
        import multiprocessing

        import llama_cpp as lc

        self.lc = lc
        # None: llama-cpp-python's default (its Llama class: n_threads = max(cpu_count // 2, 1))
        self.threads = max(multiprocessing.cpu_count() // 2, 1) if threads is None else threads
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        if hasattr(mparams, "use_extra_bufts"):
            # no AMX / repacked weight buffers: with them llama_decode crashes (SIGSEGV) on this VM, whose CPU
            # lists AMX; the plain CPU path still uses AVX-512 (VNNI, BF16) for the Q4_1 dot products
            mparams.use_extra_bufts = False
        self.model = lc.llama_model_load_from_file(model.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))

    def run(self, batch: int, input_len: int, output_len: int, seed: int) -> dict:
        lc = self.lc
        prompts = make_prompts(batch, input_len, self.vocab, seed)
        cparams = lc.llama_context_default_params()
        per_seq = -(-(input_len + output_len + 8) // 256) * 256  # llama.cpp pads contexts to 256
        cparams.n_ctx = batch * per_seq
        cparams.n_batch = min(2048, cparams.n_ctx)
        cparams.n_ubatch = min(512, cparams.n_batch)
        cparams.n_seq_max = batch
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        if hasattr(cparams, "kv_unified"):
            # a KV stream per sequence: what llama.h advises for sequences that share no prefix
            cparams.kv_unified = False
        ctx = lc.llama_init_from_model(self.model, cparams)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))
        cap = max(cparams.n_batch, batch)
        b = lc.llama_batch_init(cap, 0, 1)
        try:
            def decode(part):  # part: (token, pos, seq, wants_logits), at most n_batch entries
                b.n_tokens = len(part)
                for i, (tok, pos, seq, want) in enumerate(part):
                    b.token[i] = tok
                    b.pos[i] = pos
                    b.n_seq_id[i] = 1
                    b.seq_id[i][0] = seq
                    b.logits[i] = want
                if lc.llama_decode(ctx, b) != 0:
                    raise RuntimeError("llama_decode failed")

            t = time.perf_counter()
            # prefill: every prompt, n_batch tokens per llama_decode; sample after each prompt's last token
            tokens = [0] * batch
            entries = [(tok, pos, s, pos == input_len - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
            for start in range(0, len(entries), cparams.n_batch):
                part = entries[start:start + cparams.n_batch]
                decode(part)
                for i, e in enumerate(part):
                    if e[3]:
                        tokens[e[2]] = lc.llama_sampler_sample(chain, ctx, i)
            for step in range(1, output_len):  # one llama_decode per step for every sequence
                decode([(tokens[s], input_len + step - 1, s, True) for s in range(batch)])
                tokens = [lc.llama_sampler_sample(chain, ctx, s) for s in range(batch)]
            elapsed = time.perf_counter() - t
        finally:
            lc.llama_batch_free(b)
            lc.llama_sampler_free(chain)
            lc.llama_free(ctx)
        return {"elapsed_s": elapsed, "threads": self.threads}


BACKENDS = {"pagedkv": PagedKV, "hf": HF, "llamacpp": LlamaCpp}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("backend", choices=sorted(BACKENDS))
    p.add_argument("--model", required=True)
    p.add_argument("--threads", required=True, help="an int, or 'default': the backend's own default")
    a = p.parse_args()
    backend = BACKENDS[a.backend](a.model, None if a.threads == "default" else int(a.threads))
    print(json.dumps({"ready": a.backend}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        r = backend.run(job["batch"], job["input_len"], job["output_len"], job["seed"])
        n_out = job["batch"] * job["output_len"]
        n_all = job["batch"] * (job["input_len"] + job["output_len"])
        r.update(job, backend=a.backend, tokens_per_s=n_all / r["elapsed_s"], output_tokens_per_s=n_out / r["elapsed_s"])
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
