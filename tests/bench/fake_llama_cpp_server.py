"""A stand-in for `python -m llama_cpp.server`, for testing engine_bench's llama.cpp peer without
llama.cpp: it takes the same flags, answers GET /v1/models and POST /v1/completions (prompt tokens =
UTF-8 bytes, a prompt cache of the previous prompt's longest common prefix, a completion of
`max_tokens` letters) and writes the lines llama-cpp-python's verbose server writes to stderr
(prefix-match hits, llama_perf_context_print timings). It records its flags in $FAKE_LLAMA_ARGS_FILE."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PREVIOUS: list[bytes] = [b""]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep stderr to what llama-cpp-python prints
        pass

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send({"object": "list", "data": [{"id": "fake"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        prompt = body["prompt"].encode()
        hit = 0
        for a, b in zip(PREVIOUS[0], prompt):
            if a != b:
                break
            hit += 1
        hit = min(hit, len(prompt) - 1)
        PREVIOUS[0] = prompt
        if hit > 0:
            print(
                f"Llama.generate: {hit} prefix-match hit, remaining {len(prompt) - hit} prompt tokens to eval",
                file=sys.stderr,
            )
        new, runs = len(prompt) - hit, body["max_tokens"] - 1
        time.sleep(0.001 * new / 100 + 0.002 * runs)
        print(f"llama_perf_context_print: prompt eval time =   {new / 100:8.2f} ms / {new:5d} tokens", file=sys.stderr)
        print(f"llama_perf_context_print:        eval time =   {2.0 * runs:8.2f} ms / {runs:5d} runs", file=sys.stderr)
        sys.stderr.flush()
        usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"]}
        self._send({"choices": [{"text": "a" * body["max_tokens"]}], "usage": usage})


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--host", "--port", "--n_threads", "--n_threads_batch", "--n_ctx"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    with open(os.environ["FAKE_LLAMA_ARGS_FILE"], "w") as f:
        json.dump({**vars(args), "pid": os.getpid()}, f)
    ThreadingHTTPServer((args.host, int(args.port)), Handler).serve_forever()


if __name__ == "__main__":
    main()
