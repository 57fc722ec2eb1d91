"""Count the project source files one greedy request walks through (issue 32's indicator).

Every Python call made while one greedy request runs is recorded (``sys.setprofile`` on the calling thread,
``threading.setprofile`` on the threads started after it: the engine thread and uvicorn's), after a warm-up
request of the same shape, and the distinct files under ``src/pagedkv`` among the called functions are counted.

    PYTHONPATH=$PWD/src .venv/bin/python scripts/count_request_files.py            # LLM.generate and serve
    PYTHONPATH=$PWD/src .venv/bin/python scripts/count_request_files.py --list     # and the files

Two paths: ``LLM.generate`` of one 8-token greedy completion, and ``pagedkv serve`` (the server in a thread on
127.0.0.1, a port chosen by the OS) answering one 8-token greedy ``/v1/completions`` request, from the HTTP route
to the block manager and back. The default model (SmolLM2-135M) on the CPU.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src" / "pagedkv") + "/"


class Recorder:
    """The files under ``src/pagedkv`` of the Python functions called while :attr:`on` is set (any thread)."""

    def __init__(self) -> None:
        self.on = False
        self.files: set[str] = set()
        self.funcs: set[tuple[str, str]] = set()  # (file, function)

    def __call__(self, frame, event, arg):  # (a profile function: every call and return)
        if self.on and event == "call":
            f = frame.f_code.co_filename
            if f.startswith(SRC):
                self.files.add(f[len(SRC):])
                self.funcs.add((f[len(SRC):], frame.f_code.co_qualname))

    def install(self) -> None:
        threading.setprofile(self)
        sys.setprofile(self)


def count_generate(rec: Recorder, llm, prompt: str) -> set[str]:
    from pagedkv.engine import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    rec.files.clear()
    rec.funcs.clear()
    rec.on = True
    try:
        llm.generate(prompt, params, use_tqdm=False)
    finally:
        rec.on = False
    return set(rec.files)


def count_serve(rec: Recorder, llm, prompt: str) -> set[str]:
    import httpx

    from pagedkv.server.launch import make_server

    srv = make_server(llm, model_name="m").start_in_thread()
    try:
        body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        url = srv.url + "/v1/completions"  # (read before recording: the client's own call is not the request's path)
        with httpx.Client(timeout=60) as c:
            c.post(url, json=body).raise_for_status()  # warm-up
            rec.files.clear()
            rec.funcs.clear()
            rec.on = True
            try:
                r = c.post(url, json=body)
            finally:
                rec.on = False
            r.raise_for_status()
    finally:
        srv.close()
    return set(rec.files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the files too")
    ap.add_argument("--functions", action="store_true", help="print the files and the functions called in each")
    ap.add_argument("--no-serve", action="store_true", help="LLM.generate only")
    args = ap.parse_args()
    rec = Recorder()
    rec.install()  # (before the server's threads start)
    from pagedkv.engine import LLM

    llm = LLM(None, num_gpu_blocks=64, max_num_seqs=4)
    prompt = "The capital of France is"
    runs = [("LLM.generate", count_generate)] + ([] if args.no_serve else [("pagedkv serve", count_serve)])
    for name, fn in runs:
        files = fn(rec, llm, prompt)
        print(f"{name}: {len(files)} files under src/pagedkv")
        if args.list or args.functions:
            for f in sorted(files):
                print("   ", f)
                if args.functions:
                    for fn_name in sorted(q for g, q in rec.funcs if g == f):
                        print("       ", fn_name)


if __name__ == "__main__":
    main()
