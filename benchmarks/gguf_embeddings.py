"""An encoder GGUF (llama.cpp's `bert` architecture) served as streamq serves it, against
sentence-transformers on the source folder and llama.cpp's own `llama-server --embedding` on the
same file, in one run: all-MiniLM-L6-v2 written as llama.cpp's converter writes it
(streamq/testing/tiny_encoders.write_gguf), F32 and Q8_0.

    .venv/bin/python benchmarks/gguf_embeddings.py            # builds llama.cpp first (scripts/llama-cpp.sh)
    .venv/bin/python benchmarks/gguf_embeddings.py --gguf /path/model.gguf --source /path/st-folder

Reported per file: the least cosine of streamq's embeddings to sentence-transformers' and to
llama-server's, llama-server's to sentence-transformers', and whether the token ids equal
llama-server's /tokenize on every text. A file llama-server cannot serve is reported as such.
Prints JSON, then a markdown table and the machine line.
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine, print_machine, print_table
from shared import tokenizer_files
from shared.gguf_convert import convert_gguf
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_encoders import minilm, write_gguf
from worker.model.encoders import Packed, load

TEXTS = ["A man is eating food.", "The Weather in PARIS is mild, isn't it?", "naïve café résumé", "x",
         "Streams, batches and caches: a worker runs requests together, step by step, 12345.",
         "中文 and ☃ and emoji 🙂", "unbelievably long-winded tokenization"]


def ours(gguf: Path, work: Path, texts: list[str]) -> tuple[np.ndarray, list[list[int]]]:
    tokenizer_files.write_from_gguf(gguf, work / "tokenizer")
    convert_gguf(gguf, work / "weights", work / "tokenizer")
    tok = Tokenizer(work / "tokenizer")
    encoder = load(work / "weights", tok.pooling, torch.device("cpu"), torch.float32)
    ids = [tok.encode(t) for t in texts]
    packed = Packed.of([(i, len(i)) for i in ids], torch.device("cpu"))
    return torch.stack(encoder.embed(packed, [0] * len(ids))).numpy(), ids


def llama_server(binary: Path, gguf: Path, texts: list[str]) -> tuple[np.ndarray | None, list[list[int]] | str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--embedding", "--port", str(port), "-c", "512",
                             "-np", "1", "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return None, f"llama-server exited with {proc.returncode}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        try:
            data = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=60).json()["data"]
            tokens = [httpx.post(f"{url}/tokenize", json={"content": t, "add_special": True}, timeout=10
                                 ).json()["tokens"] for t in texts]
        except httpx.HTTPError as exc:
            time.sleep(0.5)
            return None, f"llama-server failed ({type(exc).__name__}; exit code {proc.poll()})"
        return np.array([d["embedding"] for d in data], dtype=np.float32), tokens
    finally:
        proc.terminate()
        proc.wait()


def least_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, action="append", help="a GGUF file (default: MiniLM, F32 and Q8_0)")
    parser.add_argument("--source", type=Path, default=None, help="the sentence-transformers folder it came from")
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    work = Path(tempfile.mkdtemp(prefix="gguf-embeddings-"))
    source = args.source or minilm()
    files = args.gguf or [write_gguf(minilm(), work / f"all-MiniLM-L6-v2.{q}.gguf", qtype=q) for q in ("F32", "Q8_0")]
    binary = Path(subprocess.run([str(ROOT / "scripts" / "llama-cpp.sh")], check=True, capture_output=True,
                                 text=True).stdout.strip()) / "bin" / "llama-server"
    reference = SentenceTransformer(str(source), device="cpu").encode(TEXTS)
    rows = []
    for gguf in files:
        embedded, ids = ours(gguf, work / gguf.stem, TEXTS)
        peer, peer_tokens = llama_server(binary, gguf, TEXTS)
        rows.append({"file": gguf.name, "streamq_vs_st": round(least_cosine(embedded, reference), 6),
                     "llama_cpp_vs_st": None if peer is None else round(least_cosine(peer, reference), 6),
                     "streamq_vs_llama_cpp": None if peer is None else round(least_cosine(embedded, peer), 6),
                     "same_token_ids": peer_tokens if isinstance(peer_tokens, str) else peer_tokens == ids})
    shutil.rmtree(work, ignore_errors=True)
    facts = machine("float32", torch.get_num_threads(), peer="llama.cpp of llama-cpp-python 0.3.36 (scripts/llama-cpp.sh)")
    print(json.dumps({"machine": facts, "rows": rows}, indent=1))
    print_table(["file", "streamq vs ST (least cos)", "llama-server vs ST", "streamq vs llama-server", "same token ids"],
                [[r["file"], r["streamq_vs_st"], r["llama_cpp_vs_st"], r["streamq_vs_llama_cpp"], r["same_token_ids"]]
                 for r in rows])
    print_machine(facts)


if __name__ == "__main__":
    main()
